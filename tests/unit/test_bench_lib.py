"""benchmarks/benchlib.py: how much of a cache the page cache maps with huge pages."""

from __future__ import annotations

import mmap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from benchmarks import benchlib as bl


def test_mapped_huge_counts_the_shard_files_and_never_more_than_them(tmp_path: Path) -> None:
    sizes = {"acts000000.bin": 5 << 20, "acts000001.bin": 3 << 20, "acts000002.bin": 0}
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(np.arange(size, dtype=np.uint8).tobytes())
    (tmp_path / "labels.bin").write_bytes(b"\1" * (1 << 20))  # not a shard: not counted
    huge, total = bl.mapped_huge(tmp_path)
    assert total == sum(sizes.values())
    assert 0 <= huge <= total and huge % (2 << 20) == 0  # whole 2 MiB pages, if any
    note = bl.mapped_huge_note([tmp_path])
    assert f"{total / 1e9:.2f} GB" in note and "huge pages" in note


def test_smaps_field_of_a_mapping_found_by_its_start(tmp_path: Path) -> None:
    f = tmp_path / "acts000000.bin"
    f.write_bytes(b"\0" * (1 << 20))
    with open(f, "rb") as fh:
        m = mmap.mmap(fh.fileno(), 1 << 20, prot=mmap.PROT_READ)
    try:
        start = np.frombuffer(m, dtype=np.uint8).ctypes.data
        assert bl._smaps_kib(start, "Size") == 1024  # the mapping's own entry, in kB
        assert bl._smaps_kib(start, "NoSuchField") == 0
        assert bl._smaps_kib(1, "Size") == 0  # no mapping starts there
    finally:
        m.close()


def test_settle_memory_says_what_it_did_and_skips_what_it_may_not(monkeypatch: pytest.MonkeyPatch) -> None:
    written: list[str] = []

    def write_text(self: Path, text: str) -> int:
        if self.name == "compact_memory":
            raise PermissionError(13, "not root")
        written.append(f"{self}={text}")
        return len(text)

    monkeypatch.setattr("os.sync", lambda: None)
    monkeypatch.setattr(Path, "write_text", write_text)
    assert bl.settle_memory() == "dropped the clean page cache"
    assert written == ["/proc/sys/vm/drop_caches=1"]  # 1: the page cache only, never dentries and inodes
    monkeypatch.setattr(Path, "write_text", lambda self, text: (_ for _ in ()).throw(PermissionError(13, "no")))
    assert bl.settle_memory() == ""
    bl.SETTLED[:] = []
    assert "before they were written" not in bl.mapped_huge_note([])
    bl.SETTLED[:] = ["compacted free memory"]
    try:
        assert "(before they were written the suite compacted free memory)" in bl.mapped_huge_note([])
    finally:
        bl.SETTLED[:] = []


def test_in_threads_cpu_counts_the_threads_work_and_nothing_before_it() -> None:
    """The CPU seconds beside a timed run are its threads' (a limit's CPU s/GB once counted its
    set-up, the buffer it filled before the clock started, and came out at half the real cost)."""

    def spin(_: int) -> None:
        start = time.thread_time()
        while time.thread_time() - start < 0.05:
            pass

    def rest(_: int) -> None:
        time.sleep(0.05)

    spin(0)  # set-up before the call: not counted
    _, busy = bl.in_threads_cpu(2, spin)
    _, idle = bl.in_threads_cpu(2, rest)
    assert busy >= 0.1  # both threads' CPU, whatever the wall time was
    assert idle < 0.05 <= busy


class _Acts:
    def __init__(self, rows: int) -> None:
        self.rows = rows

    def numel(self) -> int:
        return self.rows * 4


class _Batch:
    def __init__(self, rows: int) -> None:
        self.acts = _Acts(rows)
        self.rows = rows

    def __len__(self) -> int:
        return self.rows


class _Loader:
    """An epoch of three batches of 10 rows x 4 values (2 bytes each), counting its epochs."""

    def __init__(self) -> None:
        self.shards = type("S", (), {"metadata": type("M", (), {"itemsize": 2})()})()
        self.epochs = 0
        self.closed = False

    def __iter__(self) -> Iterator[_Batch]:
        self.epochs += 1
        return iter([_Batch(10), _Batch(10), _Batch(10)])

    def close(self) -> None:
        self.closed = True


def test_epoch_rate_after_the_first_epoch_times_only_the_later_ones() -> None:
    from benchmarks.loaders import epoch_rate

    epoch_bytes = 3 * 10 * 4 * 2
    loader = _Loader()
    # 2.5 epochs' bytes wanted after the first, which is not counted: epochs 2, 3 and 4.
    sample = epoch_rate(lambda: loader, min_bytes=2.5 * epoch_bytes, after_first_epoch=True)
    assert loader.epochs == 4 and loader.closed
    assert sample.gbps > 0 and sample.first_epoch > 0

    plain = _Loader()
    sample = epoch_rate(lambda: plain, min_bytes=2.5 * epoch_bytes)
    assert np.isnan(sample.first_epoch)
    # From the new loader's first batch on: its first epoch counts (all but that batch).
    assert plain.epochs == 3 and plain.closed
