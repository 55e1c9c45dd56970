"""shuffle.source: the source columns with one value per token position, carried into the
shuffled cache beside each chosen token; what the scatter pass asks the disk for."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import saev_shards as ss
from saev_shards.selection import SelectionSpec, parse_selection
from saev_shards.shuffle.source import SourceReader, per_token_columns

from ...support.caches import small_metadata, write_cache


def test_only_columns_of_one_value_per_token_position_are_carried(root: Path) -> None:
    md = small_metadata(n_examples=4)  # 5 tokens per example
    columns = {"lengths": ("int32", ()), "token_ids": ("int64", (5,)), "window": ("int16", (4,))}
    with ss.ShardWriter(root, md, durable=False, columns=columns) as w:
        w.write(
            np.zeros(md.shape, np.float32),
            columns={
                "lengths": np.full(4, 5, np.int32),
                "token_ids": np.zeros((4, 5), np.int64),
                "window": np.zeros((4, 4), np.int16),
            },
        )
    assert per_token_columns(ss.open(root / md.hash)) == {"token_ids": np.dtype("<i8")}


def test_one_layer_of_large_slices_reads_only_its_slices_hinted_first(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proper subset of the layers with slices of 16 KiB and more is read slice by slice after
    a POSIX_FADV_WILLNEED hint of those slices: the disk is asked for the chosen layers' bytes
    and no more (whole examples were read below 128 KiB before)."""
    md = small_metadata(layers=(2, 6, 11), d_model=2048, n_examples=7, patches_per_shard=45)  # 20 KiB slices
    logical = write_cache(root, md)
    shards = ss.open(root / md.hash)
    selection = parse_selection(shards, SelectionSpec(layers=(2, 6)), ss.ShuffleError)
    reader = SourceReader(shards, selection)
    assert not reader.whole and reader.hint
    assert reader.slice_runs == [(0, 0, 2)]  # layers 2 and 6 are neighbours: one read per example
    hints: list[tuple[int, int]] = []
    real_advise = os.posix_fadvise

    def advise(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            hints.append((offset, length))
        real_advise(fd, offset, length, advice)

    read: list[int] = []
    real_preadv = shards.files.preadv

    def preadv(fd: int, views: list[memoryview], offset: int) -> int:
        n = real_preadv(fd, views, offset)
        read.append(n)
        return n

    monkeypatch.setattr(os, "posix_fadvise", advise)
    monkeypatch.setattr(shards.files, "preadv", preadv)
    buffer = np.empty(md.n_examples * reader.example_nbytes, np.uint8)
    acts = reader.acts(0, md.n_examples, buffer)
    slice_nbytes = md.tokens_per_ex * md.d_model * 2
    assert sum(read) == md.n_examples * 2 * slice_nbytes  # the chosen layers' bytes, nothing else
    assert sorted(hints) == sorted(
        ((i % md.examples_per_shard) * 3 * slice_nbytes, 2 * slice_nbytes) for i in range(md.n_examples)
    )
    assert md.n_shards > 1
    np.testing.assert_array_equal(acts.astype(np.float32), logical[:, :2].astype(np.float16).astype(np.float32))


@pytest.mark.parametrize(("layers", "d_model", "whole"), [((11,), 2048, False), ((11,), 512, True), (None, 2048, True)])
def test_whole_examples_where_slices_would_not_pay(root: Path, layers: Any, d_model: int, whole: bool) -> None:
    """Slices under 16 KiB (5 KiB here), or every layer chosen: whole examples, one sequential read."""
    md = small_metadata(d_model=d_model, n_examples=3)
    write_cache(root, md)
    shards = ss.open(root / md.hash)
    reader = SourceReader(shards, parse_selection(shards, SelectionSpec(layers=layers), ss.ShuffleError))
    assert reader.whole == whole
    assert reader.hint == (not whole)
