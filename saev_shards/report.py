"""One picture of a cache, to see at a glance whether it is sane (`saev-shards report`, `Shards.report`).

The panels, each where the cache has what it needs:

* **norms by layer**: the distribution of vector norms of every layer (log scale), with
  its median;
* **dimensions, layer L** (one per layer): the mean and the standard deviation of every
  dimension; *outlier dimensions* ("massive activations") are marked and listed: those
  whose root mean square ``sqrt(mean^2 + var)`` exceeds `OUTLIER_MULTIPLE` times the median
  root mean square of the layer's dimensions;
* **CLS and content tokens** (caches with a CLS token): the norms of the two kinds apart;
* **lengths and truncation** (a ``lengths`` column; ``true_lengths`` too for a dump): how
  long the examples are, and how many were cut to ``T``;
* **shard sizes**: the bytes of every shard file.

Everything comes from one sequential pass over the cache with bounded memory (the norms of
`saev_shards.norms.vector_blocks`, counted in fixed histograms; the per-dimension sums
only when the cache has no statistics: stats.json or the stats sidecar are used when
present), with a progress bar. Norms are counted over the population stats.json describes
(valid positions, non-finite vectors left out). matplotlib comes with the ``plot`` extra.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .errors import ShardsError
from .norms import vector_blocks
from .optional import require
from .units import human_bytes

if TYPE_CHECKING:
    from .reader import Shards

#: A dimension is an outlier when its root mean square exceeds this many times the layer's median.
OUTLIER_MULTIPLE = 10.0
#: Histogram buckets: float32 norms by their high 16 bits (sign, exponent, 7 bits of mantissa:
#: 0.8% wide), which keeps memory fixed whatever the cache's size.
_BUCKETS = 1 << 16
#: Bins of a drawn norm distribution (log-spaced between the smallest and largest norm).
DRAWN_BINS = 80


@dataclasses.dataclass
class CacheReport:
    """What `report` computed, and the figure drawn from it (``figure`` is a matplotlib Figure)."""

    path: Path
    layers: tuple[int, ...]
    #: Layer value -> histogram of its norms: 65,536 counts by the high 16 bits of the float32 norm.
    norm_buckets: dict[int, npt.NDArray[np.int64]]
    #: Layer value -> the same, for the CLS position and the content positions (caches with a CLS token).
    cls_buckets: dict[int, npt.NDArray[np.int64]]
    content_buckets: dict[int, npt.NDArray[np.int64]]
    #: Layer value -> (mean, std) per dimension, float64 ``(D,)`` each.
    dims: dict[int, tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]]
    #: Layer value -> outlier dimensions, ascending (see `OUTLIER_MULTIPLE`).
    outliers: dict[int, list[int]]
    #: Where the per-dimension numbers came from: "stats.json", "the stats sidecar" or "this pass".
    dims_source: str
    lengths: npt.NDArray[np.int64] | None
    true_lengths: npt.NDArray[np.int64] | None
    tokens_per_ex: int
    shard_nbytes: list[int]
    figure: Any = None

    def median_norm(self, layer: int, which: str = "all") -> float:
        """Median norm of ``layer`` from its histogram (the lower edge of the bucket holding it)."""
        buckets = {"all": self.norm_buckets, "cls": self.cls_buckets, "content": self.content_buckets}[which][layer]
        total = int(buckets.sum())
        if total == 0:
            return float("nan")
        b = int(np.searchsorted(np.cumsum(buckets), (total - 1) // 2, side="right"))
        return float(_edge(b))

    @property
    def truncated(self) -> int | None:
        """Examples longer than ``T`` (from ``true_lengths``), or None when not recorded."""
        if self.true_lengths is None:
            return None
        return int((self.true_lengths > self.tokens_per_ex).sum())

    def save(self, out: str | Path) -> Path:
        """Write the figure as PNG (``.png``) or as an HTML page (``.html``: the picture and the numbers)."""
        out = Path(out)
        if out.suffix.lower() == ".png":
            self.figure.savefig(out, dpi=100)
        elif out.suffix.lower() in (".html", ".htm"):
            out.write_text(self.html())
        else:
            raise ShardsError(f"report: expected an output file ending in .png or .html, found {str(out)!r}")
        return out

    def html(self) -> str:
        buffer = io.BytesIO()
        self.figure.savefig(buffer, format="png", dpi=100)
        picture = base64.b64encode(buffer.getvalue()).decode("ascii")
        rows = "".join(
            f"<tr><td>{layer}</td><td>{self.median_norm(layer):.4g}</td>"
            f"<td>{html.escape(', '.join(map(str, self.outliers[layer])) or 'none')}</td></tr>"
            for layer in self.layers
        )
        name = html.escape(str(self.path))
        return (
            f"<!doctype html><meta charset='utf-8'><title>{name}</title><h1>{name}</h1>"
            f"<img src='data:image/png;base64,{picture}' alt='report of {name}'>"
            "<table><tr><th>layer</th><th>median norm</th>"
            f"<th>outlier dimensions (RMS above {OUTLIER_MULTIPLE:g} x the median)</th></tr>{rows}</table>\n"
        )


def _edge(bucket: int | npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    """The smallest float32 of a bucket (its high 16 bits)."""
    return (np.asarray(bucket, np.uint32) << np.uint32(16)).view(np.float32)


def outlier_dimensions(mean: npt.NDArray[np.float64], std: npt.NDArray[np.float64]) -> list[int]:
    """Dimensions whose RMS exceeds `OUTLIER_MULTIPLE` times the median RMS of the layer."""
    rms = np.sqrt(mean * mean + std * std)
    median = float(np.median(rms)) if len(rms) else 0.0
    return [int(d) for d in np.flatnonzero(rms > OUTLIER_MULTIPLE * median)] if median > 0 else []


def report(shards: Shards, out: str | Path | None = None, *, progress: bool | None = None) -> CacheReport:
    """The picture of ``shards`` (module docstring); saved to ``out`` (``.png`` or ``.html``) when given."""
    require("matplotlib", "plot", "a cache report")
    if out is not None and Path(out).suffix.lower() not in (".png", ".html", ".htm"):
        raise ShardsError(f"report: expected an output file ending in .png or .html, found {str(out)!r}")
    md = shards.metadata
    n_layers, d = md.n_layers, md.d_model
    stats = shards.stats
    sums = None if stats is not None else (np.zeros((n_layers, d)), np.zeros((n_layers, d)), np.zeros(n_layers))
    every = np.zeros((n_layers, _BUCKETS), np.int64)
    cls = np.zeros((n_layers, _BUCKETS), np.int64)
    for _, x, norms in vector_blocks(shards, "report", progress):
        valid = np.isfinite(norms)  # (b, L, T): the population
        for li in range(n_layers):
            v = norms[:, li][valid[:, li]]
            every[li] += np.bincount(v.view(np.uint32) >> 16, minlength=_BUCKETS)
            if md.cls_token:
                c = norms[:, li, 0][valid[:, li, 0]]
                cls[li] += np.bincount(c.view(np.uint32) >> 16, minlength=_BUCKETS)
            if sums is not None:
                rows = x[:, li][valid[:, li]].astype(np.float64)  # (n, D)
                sums[0][li] += rows.sum(axis=0)
                sums[1][li] += (rows * rows).sum(axis=0)
                sums[2][li] += len(rows)
    dims: dict[int, tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]] = {}
    for li, layer in enumerate(md.layers):
        if stats is not None:
            mean = np.asarray(stats["mean"][li], np.float64)
            std = np.sqrt(np.maximum(np.asarray(stats["var"][li], np.float64), 0))
        else:
            assert sums is not None
            n = max(1.0, float(sums[2][li]))
            mean = sums[0][li] / n
            std = np.sqrt(np.maximum(sums[1][li] / n - mean * mean, 0))
        dims[layer] = (mean, std)
    columns = shards.manifest.columns
    source = "this pass"
    if stats is not None:
        source = "stats.json" if shards.manifest.stats is not None else "the stats sidecar"
    result = CacheReport(
        path=shards.path,
        layers=tuple(md.layers),
        norm_buckets={layer: every[li] for li, layer in enumerate(md.layers)},
        cls_buckets={layer: cls[li] for li, layer in enumerate(md.layers)} if md.cls_token else {},
        content_buckets={layer: every[li] - cls[li] for li, layer in enumerate(md.layers)} if md.cls_token else {},
        dims=dims,
        outliers={layer: outlier_dimensions(*dims[layer]) for layer in md.layers},
        dims_source=source,
        lengths=np.asarray(shards.columns["lengths"], np.int64) if "lengths" in columns else None,
        true_lengths=np.asarray(shards.columns["true_lengths"], np.int64) if "true_lengths" in columns else None,
        tokens_per_ex=md.tokens_per_ex,
        shard_nbytes=list(shards.manifest.shards.sizes),
    )
    result.figure = draw(result, title=f"{md.hash[:12]}  {md.family}:{md.ckpt}  {md.dtype} {tuple(md.shape)}")
    if out is not None:
        result.save(out)
    return result


def _drawn(buckets: npt.NDArray[np.int64], edges: npt.NDArray[np.float64]) -> npt.NDArray[np.int64]:
    """Bucket counts summed into the drawn bins ``edges``."""
    values = _edge(np.flatnonzero(buckets)).astype(np.float64)
    counts = buckets[buckets > 0]
    drawn, _ = np.histogram(values, bins=edges, weights=counts)
    return drawn.astype(np.int64)


def _drawn_edges(nonzero: list[npt.NDArray[np.int64]]) -> npt.NDArray[np.float64]:
    """Drawn bins made of whole buckets (the same number in each), at most `DRAWN_BINS`, over
    the buckets in use (down to a millionth of the largest norm): no bin holds one bucket more
    than its neighbour, so a smooth distribution draws smooth."""
    if not nonzero:
        return np.geomspace(1.0, 10.0, DRAWN_BINS + 1)
    first = min(int(np.flatnonzero(b)[0]) for b in nonzero)
    stop = max(int(np.flatnonzero(b)[-1]) for b in nonzero) + 1
    floor = max(float(_edge(stop)) * 1e-6, float(np.finfo(np.float32).tiny))
    first = max(first, int(np.float32(floor).view(np.uint32) >> 16))
    stride = max(1, -(-(stop - first) // DRAWN_BINS))
    return _edge(np.arange(first, stop + stride, stride)).astype(np.float64)


def draw(r: CacheReport, title: str = "") -> Any:
    """The figure of a report: a matplotlib Figure, one titled Axes per panel (no pyplot state)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator

    plain = FuncFormatter(lambda v, _: f"{v:g}")  # 5, 10, 20 on a log axis, not 5x10^0

    def log_norm_axis(ax: Any) -> None:
        narrow = edges[-1] < 10 * edges[0]  # under a decade: evenly spaced round numbers
        ax.xaxis.set_major_locator(MaxNLocator(nbins=8) if narrow else LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))

    panels = ["norms"] + [f"dims {layer}" for layer in r.layers]
    if r.cls_buckets:
        panels.append("cls")
    if r.lengths is not None:
        panels.append("lengths")
    panels.append("shards")
    cols = 2
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(12, 3.6 * rows), layout="constrained")
    fig.suptitle(title or str(r.path))
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    edges = _drawn_edges([b for b in r.norm_buckets.values() if b.any()])
    for ax, panel in zip(axes, panels, strict=False):
        if panel == "norms":
            for layer in r.layers:
                steps = ax.stairs(_drawn(r.norm_buckets[layer], edges), edges, label=f"layer {layer}")
                ax.axvline(r.median_norm(layer), linestyle=":", color=steps.get_edgecolor())
            ax.set(xscale="log", title="norms by layer", xlabel="vector norm", ylabel="vectors")
            log_norm_axis(ax)
            ax.legend()
        elif panel.startswith("dims "):
            layer = int(panel.split()[1])
            mean, std = r.dims[layer]
            ax.plot(mean, label="mean", linewidth=0.8)
            ax.plot(std, label="std", linewidth=0.8)
            marked = r.outliers[layer]
            if marked:
                ax.plot(marked, mean[marked], "rx", label="outlier dimensions")
                for dim in marked[:8]:
                    ax.annotate(str(dim), (dim, mean[dim]), fontsize=8, color="red")
            listed = ", ".join(map(str, marked[:8])) + (" ..." if len(marked) > 8 else "")
            ax.set(
                title=f"dimensions, layer {layer}" + (f" (outliers: {listed})" if marked else " (no outliers)"),
                xlabel=f"dimension (from {r.dims_source})",
                ylabel="value",
            )
            ax.legend()
        elif panel == "cls":
            for layer in r.layers:
                ax.stairs(_drawn(r.content_buckets[layer], edges), edges, label=f"content, layer {layer}")
                ax.stairs(_drawn(r.cls_buckets[layer], edges), edges, label=f"CLS, layer {layer}", linestyle="--")
            ax.set(xscale="log", yscale="log", title="CLS and content tokens", xlabel="vector norm", ylabel="vectors")
            log_norm_axis(ax)
            ax.legend()
        elif panel == "lengths":
            assert r.lengths is not None
            # Up to twice T: longer true lengths are counted in the last bin, so the kept ones stay readable.
            top = 2 * r.tokens_per_ex if r.true_lengths is not None else r.tokens_per_ex
            bins = np.arange(0, top + 2) - 0.5
            ax.hist(r.lengths, bins=bins, label="kept (lengths)")
            if r.true_lengths is not None:
                shown = np.minimum(r.true_lengths, top)
                ax.hist(shown, bins=bins, histtype="step", label=f"before truncation (true_lengths; >= {top} at {top})")
                ax.axvline(r.tokens_per_ex, color="red", linestyle=":")
            cut = (
                f", {r.truncated} of {len(r.lengths)} truncated to T={r.tokens_per_ex}"
                if r.truncated is not None
                else ""
            )
            ax.set(title=f"lengths and truncation{cut}", xlabel="tokens", ylabel="examples")
            ax.legend()
        elif panel == "shards":
            ax.bar(range(len(r.shard_nbytes)), r.shard_nbytes)
            ax.set(title=f"shard sizes ({len(r.shard_nbytes)} shards)", xlabel="shard", ylabel="file size")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: human_bytes(v)))
            ax.xaxis.get_major_locator().set_params(integer=True)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    return fig
