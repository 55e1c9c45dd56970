"""One picture of a cache, to see at a glance whether it is sane (`saev-shards report`, `Shards.report`).

The panels, each where the cache has what it needs:

* **norms by layer**: the distribution of vector norms of every layer (log scale), with
  its median marked and written on its line (vectors of norm 0, which a log scale cannot
  place, are counted in a note; a cache without a finite vector says so);
* **dimensions, layer L** (one per layer): the mean and the standard deviation of every
  dimension; *outlier dimensions* ("massive activations") are marked and listed: those
  whose root mean square ``sqrt(mean^2 + var)`` exceeds `OUTLIER_MULTIPLE` times the median
  root mean square of the layer's dimensions;
* **CLS and content tokens** (caches with a CLS token): the norms of the two kinds apart;
* **lengths and truncation** (a ``lengths`` column; ``true_lengths`` too for a dump): how
  long the examples are, and how many were cut to ``T``;
* **shard sizes**: the bytes of every shard file, where they differ (a cache of equal
  shards says its count and size in the title instead).

Layers are named as the cache names them: ``layer 3``, or for a cache of sites (protocol
3.2) the module and whether input or output. Each layer keeps one colour in every panel,
and legends sit beside the axes, off the data. In a notebook a report shows itself: the
picture and a table of its numbers (`CacheReport._repr_html_`, `_repr_png_`).

Everything comes from one sequential pass over the cache with bounded memory (the norms of
`norms.vector_blocks`, counted in fixed histograms; the per-dimension sums
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

from ..errors import ShardsError
from ..humanize import human_bytes
from ..optional import require
from .norms import vector_blocks

if TYPE_CHECKING:
    from ..protocol.metadata import Metadata
    from .shards import Shards

#: A dimension is an outlier when its root mean square exceeds this many times the layer's median.
OUTLIER_MULTIPLE = 10.0
#: Histogram buckets: float32 norms by their high 16 bits (sign, exponent, 7 bits of mantissa:
#: 0.8% wide), which keeps memory fixed whatever the cache's size.
_BUCKETS = 1 << 16
#: Bins of a drawn norm distribution (log-spaced between the smallest and largest norm).
DRAWN_BINS = 80


@dataclasses.dataclass(repr=False)
class CacheReport:
    """What `report` computed, and the figure drawn from it (``figure`` is a matplotlib Figure).

    In a notebook it shows the picture and a table of its numbers; ``repr`` is one line.
    """

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
    #: Layer value -> how people call it: "layer 3", or a site's module and end (protocol 3.2).
    labels: dict[int, str] = dataclasses.field(default_factory=dict)
    #: The title of the picture: the cache's hash, model, dtype and shape.
    title: str = ""

    def label(self, layer: int) -> str:
        """``"layer 3"``, or ``"encoder.layer.3.intermediate (input)"`` in a cache of sites."""
        return self.labels.get(layer, f"layer {layer}")

    def zero_norms(self, layer: int) -> int:
        """Vectors of ``layer`` whose norm is 0 (below float32's smallest normal: the first bucket)."""
        return int(self.norm_buckets[layer][0])

    def __repr__(self) -> str:
        medians = ", ".join(f"{self.label(layer)} {self.median_norm(layer):.4g}" for layer in self.layers[:4])
        more = f", ... ({len(self.layers)} layers)" if len(self.layers) > 4 else ""
        return f"<CacheReport of {self.path.name[:12]}: median norms {medians}{more}>"

    def _repr_png_(self) -> bytes:
        """The picture, for a notebook (IPython's display protocol)."""
        return self.png()

    def _repr_html_(self) -> str:
        """The picture and the table of its numbers, for a notebook."""
        return self.html(page=False)

    def png(self, dpi: int = 100) -> bytes:
        """The figure as PNG bytes."""
        buffer = io.BytesIO()
        self.figure.savefig(buffer, format="png", dpi=dpi)
        return buffer.getvalue()

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

    def html(self, *, page: bool = True) -> str:
        """The picture (inline PNG) and the table of its numbers: a whole page, or with
        ``page=False`` the fragment a notebook shows."""
        picture = base64.b64encode(self.png()).decode("ascii")
        named = any(self.label(layer) != f"layer {layer}" for layer in self.layers)
        rows = "".join(
            f"<tr><td>{layer}</td>"
            + (f"<td>{html.escape(self.label(layer))}</td>" if named else "")
            + f"<td>{int(self.norm_buckets[layer].sum()):,}</td><td>{self.median_norm(layer):.4g}</td>"
            f"<td>{html.escape(', '.join(map(str, self.outliers[layer])) or 'none')}</td></tr>"
            for layer in self.layers
        )
        name = html.escape(str(self.path))
        head = "<tr><th>layer</th>" + ("<th>site</th>" if named else "") + "<th>vectors</th><th>median norm</th>"
        table = (
            f"<table>{head}<th>outlier dimensions (RMS above {OUTLIER_MULTIPLE:g} x the median)</th></tr>{rows}</table>"
        )
        lines = []
        if self.truncated is not None and self.lengths is not None:
            lines.append(f"{self.truncated:,} of {len(self.lengths):,} examples truncated to T={self.tokens_per_ex}")
        lines.append(f"{len(self.shard_nbytes):,} shards, {human_bytes(sum(self.shard_nbytes))}; per-dimension "
                     f"numbers from {self.dims_source}")  # fmt: skip
        notes = "".join(f"<p>{html.escape(line)}</p>" for line in lines)
        img = f"<img src='data:image/png;base64,{picture}' alt='report of {name}' style='max-width:100%'>"
        if not page:
            return f"<div><b>{html.escape(self.title or name)}</b><br>{img}{table}{notes}</div>"
        return f"<!doctype html><meta charset='utf-8'><title>{name}</title><h1>{name}</h1>{img}{table}{notes}\n"


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
    labels, prefix = site_labels(md)
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
        labels=labels,
        title=f"{md.hash[:12]}  {md.family}:{md.ckpt}  {md.dtype} {tuple(md.shape)}"
        + (f"  (sites: modules named after {prefix!r})" if prefix else ""),
    )
    result.figure = draw(result, title=result.title)
    if out is not None:
        result.save(out)
    return result


def site_labels(md: Metadata) -> tuple[dict[int, str], str]:
    """Layer value -> its label, and the dotted prefix every label leaves out: in a cache of
    sites whose modules share leading parts (``encoder.layer.``), the rest of each name and
    its end (``3.intermediate (input)``), so legends stay short; else `Metadata.describe_layer`."""
    labels = {layer: md.describe_layer(layer) for layer in md.layers}
    if md.sites is None or len(md.sites) < 2:
        return labels, ""
    parts = [site.module.split(".") for site in md.sites]
    keep = min(len(p) for p in parts) - 1  # every label keeps at least its last part
    common = 0
    while common < keep and len({p[common] for p in parts}) == 1:
        common += 1
    if common == 0:
        return labels, ""
    prefix = ".".join(parts[0][:common]) + "."
    return {
        layer: f"{site.module[len(prefix) :]} ({site.io})" for layer, site in zip(md.layers, md.sites, strict=True)
    }, prefix


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
    first = min(max(first, int(np.float32(floor).view(np.uint32) >> 16)), stop - 1)
    stride = max(1, -(-(stop - first) // DRAWN_BINS))
    return _edge(np.arange(first, stop + stride, stride)).astype(np.float64)


def _positive(buckets: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """The buckets of positive norms: bucket 0 (norm 0, and norms below float32's smallest
    normal) has no place on a log scale."""
    out = buckets.copy()
    out[0] = 0
    return out


#: Where every legend goes: beside its axes, off the data.
_LEGEND = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "fontsize": "small", "frameon": False}


def _nothing(ax: Any, text: str) -> None:
    """Say in an empty panel what it would have shown."""
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", wrap=True, color="0.35")
    ax.set_xticks([])
    ax.set_yticks([])


def draw(r: CacheReport, title: str = "") -> Any:
    """The figure of a report: a matplotlib Figure, one titled Axes per panel (no pyplot state)."""
    from matplotlib.figure import Figure

    panels = _Panels(r)
    names = ["norms"] + [f"dims {layer}" for layer in r.layers]
    if r.cls_buckets:
        names.append("cls")
    if r.lengths is not None:
        names.append("lengths")
    sizes = r.shard_nbytes
    if len(set(sizes)) > 1:  # equal shards say nothing a line of the title cannot
        names.append("shards")
    cols = 2
    rows = -(-len(names) // cols)
    fig = Figure(figsize=(13, 3.6 * rows), layout="constrained")
    shards_line = (
        "no shards"
        if not sizes
        else f"{len(sizes)} shard{'s' * (len(sizes) > 1)} of {human_bytes(sizes[0])}"
        if len(set(sizes)) == 1
        else f"{len(sizes)} shards, {human_bytes(sum(sizes))}"
    )
    fig.suptitle(f"{title or r.path}\n{shards_line}", fontsize="medium")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, name in zip(axes, names, strict=False):
        if name.startswith("dims "):
            panels.dims(ax, int(name.split(" ", 1)[1]))
        else:
            getattr(panels, name)(ax)
    for ax in axes[len(names) :]:
        ax.set_visible(False)
    return fig


class _Panels:
    """The panels of `draw`, one method each, over what they share: one colour per layer and
    the histogram edges of the norms."""

    def __init__(self, r: CacheReport) -> None:
        from matplotlib.ticker import FuncFormatter

        self.r = r
        self.plain = FuncFormatter(lambda v, _: f"{v:g}")  # 5, 10, 20 on a log axis, not 5x10^0
        self.colour = {layer: f"C{i % 10}" for i, layer in enumerate(r.layers)}  # one colour per layer, every panel
        self.positive = {layer: _positive(r.norm_buckets[layer]) for layer in r.layers}
        self.edges = _drawn_edges([b for b in self.positive.values() if b.any()])
        self.zeros = sum(r.zero_norms(layer) for layer in r.layers)
        self.drawn = sum(int(b.sum()) for b in self.positive.values())

    def log_norm_axis(self, ax: Any) -> None:
        from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator

        edges = self.edges
        narrow = edges[-1] < 10 * edges[0]  # under a decade: evenly spaced round numbers
        ax.xaxis.set_major_locator(MaxNLocator(nbins=8) if narrow else LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(self.plain)
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))

    def no_norms(self, ax: Any) -> None:
        if self.zeros:
            _nothing(ax, f"all {self.zeros:,} vectors are zero (norm 0): nothing to draw on a log scale")
        else:
            _nothing(ax, "no finite vectors to draw (every vector holds inf or NaN, or the cache is empty)")

    def norms(self, ax: Any) -> None:
        r, edges = self.r, self.edges
        if not self.drawn:
            ax.set_title("norms by layer")
            self.no_norms(ax)
            return
        ax.set_title("norms by layer", pad=22)  # room for the medians' values above the axes
        ranks = {layer: i for i, layer in enumerate(sorted(r.layers, key=r.median_norm))}
        for layer in r.layers:
            c = self.colour[layer]
            median = r.median_norm(layer)
            on_scale = median > 0  # NaN (no vector) and 0 (mostly zeros) have no place on a log scale
            label = r.label(layer) + (f", median {median:.3g}" if on_scale else "")
            ax.stairs(_drawn(self.positive[layer], edges), edges, label=label, color=c)
            if on_scale:
                ax.axvline(median, linestyle=":", color=c)
                ax.annotate(
                    f"{median:.3g}", xy=(median, 1.0), xycoords=ax.get_xaxis_transform(),
                    xytext=(0, 2 + 8 * (ranks[layer] % 2)), textcoords="offset points", ha="center", va="bottom",
                    fontsize="x-small", color=c,
                )  # fmt: skip
        note = f" ({self.zeros:,} vectors of norm 0 not drawn)" if self.zeros else ""
        ax.set(xscale="log", xlabel=f"vector norm{note}", ylabel="vectors")
        self.log_norm_axis(ax)
        ax.legend(**_LEGEND)

    def dims(self, ax: Any, layer: int) -> None:
        r = self.r
        mean, std = r.dims[layer]
        marked = r.outliers[layer]
        listed = ", ".join(map(str, marked[:8])) + (" ..." if len(marked) > 8 else "")
        found = f"(outliers: {listed})" if marked else "(no outliers)"
        name = f"dimensions, {r.label(layer)}"
        ax.set_title(f"{name}\n{found}" if len(name) + len(found) > 48 else f"{name} {found}")
        style = {"linewidth": 0.8, "marker": "o" if len(mean) <= 32 else None, "markersize": 3}
        ax.plot(mean, label="mean", color=self.colour[layer], **style)
        ax.plot(std, label="std", color="0.45", **style)
        if marked:
            ax.plot(marked, mean[marked], "rx", label="outlier dimensions")
            for dim in marked[:8]:
                ax.annotate(str(dim), (dim, mean[dim]), fontsize=8, color="red")
        ax.set(xlabel=f"dimension (from {r.dims_source})", ylabel="value")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(**_LEGEND)

    def cls(self, ax: Any) -> None:
        r, edges = self.r, self.edges
        ax.set_title("CLS and content tokens")
        if not self.drawn:
            self.no_norms(ax)
            return
        for layer in r.layers:
            c = self.colour[layer]
            ax.stairs(_drawn(_positive(r.content_buckets[layer]), edges), edges, color=c,
                      label=f"content, {r.label(layer)}")  # fmt: skip
            ax.stairs(_drawn(_positive(r.cls_buckets[layer]), edges), edges, color=c, linestyle="--",
                      label=f"CLS, {r.label(layer)}")  # fmt: skip
        ax.set(xscale="log", yscale="log", xlabel="vector norm", ylabel="vectors")
        self.log_norm_axis(ax)
        ax.legend(**_LEGEND)

    def lengths(self, ax: Any) -> None:
        r = self.r
        assert r.lengths is not None
        # Up to twice T: longer true lengths are counted in the last bin, so the kept ones stay readable.
        top = 2 * r.tokens_per_ex if r.true_lengths is not None else r.tokens_per_ex
        bins = np.arange(0, top + 2) - 0.5
        ax.hist(r.lengths, bins=bins, label="kept (lengths)")
        if r.true_lengths is not None:
            shown = np.minimum(r.true_lengths, top)
            ax.hist(shown, bins=bins, histtype="step", label=f"before truncation\n(true_lengths; >= {top} at {top})")
            ax.axvline(r.tokens_per_ex, color="red", linestyle=":", label=f"T = {r.tokens_per_ex}")
        cut = f", {r.truncated} of {len(r.lengths)} truncated to T={r.tokens_per_ex}" if r.truncated is not None else ""
        ax.set(title=f"lengths and truncation{cut}", xlabel="tokens", ylabel="examples")
        ax.legend(**_LEGEND)

    def shards(self, ax: Any) -> None:
        from matplotlib.ticker import FuncFormatter

        sizes = self.r.shard_nbytes
        ax.bar(range(len(sizes)), sizes)
        ax.set(title=f"shard sizes ({len(sizes)} shards)", xlabel="shard", ylabel="file size")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: human_bytes(v)))
        ax.xaxis.get_major_locator().set_params(integer=True)
