"""shuffle.scratch: the layout of a run's pieces, and a run's record kept only while its run
file matches it; the buffers both passes carve from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from saev_shards.shuffle import scratch

LAYOUT = scratch.RowLayout(
    (
        scratch.Field("acts", np.dtype("<f2"), (2, 8)),
        scratch.Field("source_example", np.dtype("<i8")),
        scratch.Field("label", np.dtype("|u1")),
    )
)


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=8))
def test_pieces_are_laid_out_back_to_back_in_aligned_regions(counts: list[int]) -> None:
    assert LAYOUT.row_nbytes == 2 * 8 * 2 + 8 + 1
    offsets = LAYOUT.piece_offsets(counts)
    assert offsets[0] == 0 and len(offsets) == len(counts) + 1
    for n, a, b in zip(counts, offsets[:-1], offsets[1:], strict=True):
        assert b - a == LAYOUT.piece_nbytes(n)
        regions = LAYOUT.regions(n)
        assert [f.name for f, _, _ in regions] == ["acts", "source_example", "label"]
        for (f, offset, nbytes), (_, following, _) in zip(regions, [*regions[1:], (None, b - a, 0)], strict=True):
            assert nbytes == n * f.row_nbytes
            assert offset % scratch.REGION_ALIGN == 0 and offset + nbytes <= following


def test_a_record_is_kept_only_while_its_run_file_matches(tmp_path: Path) -> None:
    counts = (3, 0, 5)
    nbytes = int(LAYOUT.piece_offsets(counts)[-1])
    record = scratch.RunRecord(2, 10, 20, counts, ("0" * 32,) * 3, nbytes)
    scratch.write_record(tmp_path, record, durable=False)
    assert scratch.load_record(tmp_path, 2, 3, LAYOUT) is None  # no run file yet
    (tmp_path / scratch.run_file(2)).write_bytes(b"\0" * nbytes)
    assert scratch.load_record(tmp_path, 2, 3, LAYOUT) == record
    assert scratch.load_record(tmp_path, 2, 4, LAYOUT) is None  # cut for another number of buckets
    (tmp_path / scratch.run_file(2)).write_bytes(b"\0" * (nbytes - 1))
    assert scratch.load_record(tmp_path, 2, 3, LAYOUT) is None  # a short run file
    (tmp_path / scratch.run_record_file(2)).write_bytes(b"{not json")
    assert scratch.load_record(tmp_path, 2, 3, LAYOUT) is None
    assert (scratch.run_file(2), scratch.run_record_file(2)) == ("run000002.bin", "run000002.json")


def test_buffers_are_carved_page_aligned_and_reused_by_the_next_pass() -> None:
    buffers = scratch.Buffers()
    try:
        first = buffers.carve([10, 5000, 4096])
        addresses = [np.frombuffer(v, np.uint8).ctypes.data for v in first]
        assert [v.nbytes for v in first] == [10, 5000, 4096]
        assert all(a % 4096 == 0 for a in addresses) and addresses[1] - addresses[0] == 4096
        assert addresses[2] - addresses[1] == 8192  # none overlapping
        for i, v in enumerate(first):
            np.frombuffer(v, np.uint8)[:] = i + 1
        del v
        base = addresses[0]
        del first
        second = buffers.carve([8192])  # fits: the same pages, the rest given back
        assert np.frombuffer(second[0], np.uint8).ctypes.data == base
        del second
        third = buffers.carve([1 << 20])  # more than the mapping holds: a new one
        assert np.frombuffer(third[0], np.uint8).nbytes == 1 << 20
        np.frombuffer(third[0], np.uint8)[:] = 7
        del third
    finally:
        buffers.close()
