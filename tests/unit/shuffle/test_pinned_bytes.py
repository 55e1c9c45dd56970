"""The shuffle's output bytes, pinned: digests of whole shuffled caches of small sources, recorded
with the shuffle as it was before its read paths changed (runs read without readahead, runs
sealed in a thread of their own, chosen layers read slice by slice). Every case is cut into
several runs and buckets by a tiny memory budget (or by ``n_buckets``), so the scatter, the
sealing and the write pass all take more than one step; a change of any byte of any output
file changes its digest."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import saev_shards as ss
from saev_shards.shuffle import plan_shuffle, run_plan, source

from ...support.caches import small_metadata, tree_bytes, write_cache

#: name: (metadata changes, how the source is written, shuffle keywords, digest of the output).
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any], str]] = {
    "all-layers-labels-lengths": (
        {},
        {"labels": True, "lengths": True},
        {"tokens": "all", "memory_bytes": 12 << 10, "n_buckets": 5},
        "9b8418b6a9b5ad59a0dc33aad7f907f55fbe25f2d2f46461562e04849af05efe",
    ),
    "one-of-three-layers": (
        {"layers": (2, 6, 11), "d_model": 64},
        {},
        {"layers": 11, "memory_bytes": 24 << 10},
        "fbdbd1fb61e9721a6f7ccc086256d6f33e5d0acf1302332e58f92183a6c7dd3c",
    ),
    "two-of-three-layers-float32": (
        {"layers": (2, 6, 11), "d_model": 64},
        {"labels": True},
        {"layers": (11, 2), "dtype": "float32", "n_buckets": 7, "examples_per_chunk": 4},
        "fc6785d2b0646d803f58f09365fac22db574b429dec0f6b250fbc71426e37ad3",
    ),
    "float8-one-layer-to-float16": (
        {"dtype": "float8_e4m3", "d_model": 64},
        {"lengths": True},
        {"layers": 6, "dtype": "float16", "memory_bytes": 24 << 10, "n_buckets": 6},
        "50fbf559ec06d8af6c80c0a48baa21df0f6d5087d1d46196267e6a7b111fbdbb",
    ),
    "bfloat16-to-float8-two-workers": (
        {"dtype": "bfloat16", "d_model": 32},
        {},
        {"dtype": "float8_e4m3", "workers": 2, "memory_bytes": 48 << 10},
        "80c0979fd0dbc12705cded12f9a2c9344b803da35287a2feb7c53c3d92eb7c57",
    ),
}


def digest(path: Path) -> str:
    """sha256 over every file under ``path``: its relative name and the sha256 of its bytes."""
    h = hashlib.sha256()
    for name, data in tree_bytes(path).items():
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()


@pytest.mark.parametrize("slices", [False, True], ids=["as-chosen", "slice-reads"])
@pytest.mark.parametrize("name", list(CASES))
def test_output_bytes_are_the_pinned_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, slices: bool
) -> None:
    """``slice-reads``: a proper subset of the layers is read slice by slice, hinted, whatever
    the slices' size (these are far under `source.MIN_HINTED_SLICE`)."""
    if slices:
        monkeypatch.setattr(source, "MIN_HINTED_SLICE", 1)
    md_changes, how, keywords, expected = CASES[name]
    md = small_metadata(**md_changes)
    lengths = np.array([i % 6 for i in range(md.n_examples)]) if how.get("lengths") else None
    write_cache(tmp_path, md, lengths=lengths, labels=bool(how.get("labels")))
    plan = plan_shuffle(ss.open(tmp_path / md.hash), tmp_path / "out", seed=5, **keywords)
    assert plan.n_chunks >= 5 and plan.n_buckets >= 4  # several runs, each cut into several pieces
    chosen = plan.selection.layers
    assert source.SourceReader(plan.source, plan.selection).whole == (not slices or len(chosen) == md.n_layers)
    out = run_plan(plan, durable=False)
    assert digest(out.path) == expected
    out.close()
