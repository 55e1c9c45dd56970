"""How a loader shows itself: one ``(name, value)`` row per line, for its repr and a notebook."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .token_loader import TokenLoader


def summary_rows(loader: TokenLoader) -> list[tuple[str, str]]:
    """What a notebook shows of ``loader`` (`TokenLoader._repr_html_`): one ``(name, value)`` per line."""
    md = loader.shards.metadata
    sel = loader.selection
    per_row = f"{len(loader.layers)}, " if loader.stack_layers else ""
    if loader.sites is not None:
        chosen = ("sites", ", ".join(map(str, loader.sites)))
    elif md.sites is not None:
        chosen = ("layers", ", ".join(f"{v} ({md.site_of(v)})" for v in loader.layers))
    else:
        chosen = ("layers", ", ".join(map(str, loader.layers)))
    device = f" on {loader.device}" if loader.device is not None else ""
    ordered = getattr(loader.order, "sequential", False)
    epoch = f"{len(loader):,} batches, {loader.n_tokens:,} rows on rank {loader.rank} of {loader.world_size}"
    rows = [
        ("cache", f"{md.hash[:12]} at {loader.shards.location}"),
        ("batches", f"({loader.batch_size}, {per_row}{md.d_model}) {loader.out_dtype}{device}"),
        chosen,
        ("tokens", sel.tokens + (", padding skipped" if sel.length_filter else "")),
        ("per epoch", epoch + (" (drop_last)" if loader.drop_last else "")),
        ("order", "(example, layer, token)" if ordered else f"shuffled, seed {loader.seed}"),
    ]
    if len(sel.exclude_token_ids):
        rows.append(("exclude_token_ids", ", ".join(map(str, sel.exclude_token_ids.tolist()))))
    if sel.norm_filter is not None:
        rows.append(("max_norm_multiple", f"{sel.norm_filter.multiple:g}"))
    rows.append(("threads", f"{loader.read_threads} reading, {loader.gather_threads} gathering"))
    return rows
