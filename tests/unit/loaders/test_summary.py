"""loaders.summary: what a loader shows of itself, one ``(name, value)`` row per line: the cache,
the batches' shape and dtype, the layers, the tokens, an epoch's size, the order, the token
masks when set, the threads."""

from __future__ import annotations

from pathlib import Path

from saev_shards import loaders
from saev_shards.loaders.summary import summary_rows

from .test_masks import BOS, masked_cache


def test_a_plain_loaders_rows(tmp_path: Path) -> None:
    shards, _ = masked_cache(tmp_path)
    md = shards.metadata
    loader = loaders.TokenLoader(shards, batch_size=8, layers=[md.layers[1]], seed=7, read_threads=2, gather_threads=3)
    rows = dict(summary_rows(loader))
    assert list(rows) == ["cache", "batches", "layers", "tokens", "per epoch", "order", "threads"]
    assert rows["cache"] == f"{md.hash[:12]} at {shards.location}"
    assert rows["batches"] == f"(8, {md.d_model}) {md.dtype}"
    assert rows["layers"] == str(md.layers[1])
    assert rows["per epoch"] == f"{len(loader):,} batches, {loader.n_tokens:,} rows on rank 0 of 1"
    assert rows["order"] == "shuffled, seed 7"
    assert rows["threads"] == "2 reading, 3 gathering"


def test_stacked_ordered_masked_rows(tmp_path: Path) -> None:
    shards, _ = masked_cache(tmp_path)
    md = shards.metadata
    loader = loaders.OrderedLoader(
        shards, batch_size=4, stack_layers=True, drop_last=True, exclude_token_ids=[BOS, 7], out_dtype="float32"
    )
    rows = dict(summary_rows(loader))
    assert rows["batches"] == f"(4, {md.n_layers}, {md.d_model}) float32"
    assert rows["layers"] == ", ".join(map(str, md.layers))
    assert rows["per epoch"].endswith(" (drop_last)")
    assert rows["order"] == "(example, layer, token)"
    assert rows["exclude_token_ids"] == f"7, {BOS}" or rows["exclude_token_ids"] == f"{BOS}, 7"
    assert "max_norm_multiple" not in rows
    assert list(rows)[-1] == "threads"
