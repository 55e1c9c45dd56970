"""What a person sees of a cache: the one-line ``repr`` of `Shards`, and the table a notebook
shows (`summary_rows`, `summary_html`); `Shards.report` draws its picture (`report`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..humanize import html_table, human_bytes

if TYPE_CHECKING:
    from .shards import Shards


def describe(shards: Shards) -> str:
    """`Shards.__repr__`: one line that says what the cache is and where."""
    md = shards.metadata
    n, l_, t, d = md.shape
    cls = "CLS + " if md.cls_token else ""
    extras = []
    if shards.manifest.labels is not None:
        extras.append("labels")
    extras += [f"column {c}" for c in shards.manifest.columns]
    extras += [f"text {t_}" for t_ in shards.manifest.text]
    if shards.manifest.stats is not None:
        extras.append("stats")
    read = f" (read as {shards.read_dtype})" if shards.read_dtype != md.dtype else ""
    return (
        f"<saev_shards.Shards {md.hash[:12]} {md.family}:{md.ckpt} shape=({n}, {l_}, {t}, {d}) "
        f"{md.dtype}{read} layers={list(md.layers)}"
        + (f" ({len(md.sites)} sites)" if md.sites is not None else "")
        + f" tokens={cls}{md.patches_per_ex} "
        f"shards={shards.n_shards}x{md.examples_per_shard} {human_bytes(md.nbytes + md.scales_nbytes)} "
        f"protocol={md.protocol}" + (f" [{', '.join(extras)}]" if extras else "") + f" at {shards.location}>"
    )


def summary_rows(shards: Shards) -> list[tuple[str, str]]:
    """What a notebook shows of this cache (`_repr_html_`): one ``(name, value)`` per line."""
    md = shards.metadata
    n, l_, t, d = md.shape
    columns = ", ".join(f"{name} {entry.dtype} {tuple(entry.shape)}" for name, entry in shards.manifest.columns.items())
    rows = [
        ("cache", md.hash),
        ("model", f"{md.family} {md.ckpt}"),
        ("dataset", md.dataset or "-"),
        ("shape", f"({n:,}, {l_}, {t}, {d})  examples x layers x tokens x d_model"),
        ("dtype", md.dtype + (f" (read as {shards.read_dtype})" if shards.read_dtype != md.dtype else "")),
    ]
    if md.sites is None:
        rows.append(("layers", ", ".join(map(str, md.layers)) + "  (block outputs)"))
    else:
        rows += [(f"layer {layer}", str(site)) for layer, site in zip(md.layers, md.sites, strict=True)]
    rows += [
        ("tokens", f"{t} per example" + (f" (CLS + {md.patches_per_ex})" if md.cls_token else "")),
        ("shards", f"{shards.n_shards:,} x {md.examples_per_shard:,} examples"),
        ("bytes", human_bytes(md.nbytes + md.scales_nbytes)),
        ("labels", "labels.bin" if shards.manifest.labels is not None else "-"),
        ("columns", columns or "-"),
        ("text", ", ".join(shards.manifest.text) or "-"),
        ("stats", "stats.json" if shards.manifest.stats is not None else "-"),
        ("protocol", md.protocol),
        ("location", shards.location),
    ]
    return rows


def summary_html(shards: Shards) -> str:
    """A short table of the cache, for a notebook (``shards.report()`` draws its picture)."""
    md = shards.metadata
    return html_table(
        f"saev_shards.Shards {md.hash[:12]}",
        summary_rows(shards),
        "shards.report() draws its picture (one pass over the cache); shards[i] reads example i",
    )
