"""fileio.direct: writes that bypass the page cache where they can hold exactly the bytes."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

import saev_shards as ss
from saev_shards import fileio


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 3 * 4096 + 17])
@pytest.mark.parametrize("offset", [0, 4096, 100])
@pytest.mark.parametrize("aligned", [True, False])
def test_pwrite_direct_writes_exactly_the_bytes(tmp_path: Path, nbytes: int, offset: int, aligned: bool) -> None:
    """Whole blocks through O_DIRECT where it applies (page-aligned memory, aligned offset), the
    rest buffered, a refused request (unaligned memory: EINVAL) all buffered: the file holds
    exactly the bytes either way."""
    data = bytes((i * 31 + 7) % 251 for i in range(nbytes))
    buffer = fileio.aligned_buffer(nbytes + 1)
    start = 0 if aligned else 1
    buffer[start : start + nbytes] = data
    view = memoryview(buffer)[start : start + nbytes]
    path = tmp_path / "f"
    path.write_bytes(b"\xff" * (offset + nbytes + 10))
    fd = os.open(path, os.O_RDWR)
    direct = fileio.open_direct(path)
    try:
        went_direct = fileio.pwrite_direct(direct, fd, view, offset)
    finally:
        for f in (fd, direct):
            if f is not None:
                os.close(f)
    del view
    assert path.read_bytes() == b"\xff" * offset + data + b"\xff" * 10
    if went_direct:
        assert aligned and offset % fileio.DIRECT_ALIGN == 0 and nbytes >= fileio.DIRECT_ALIGN


def test_pread_exact_fills_the_view_through_short_reads_and_names_a_short_file(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(range(100)))
    fd = os.open(path, os.O_RDONLY)
    try:

        def short_reads(fd: int, views: list[memoryview], offset: int) -> int:
            return os.preadv(fd, [views[0][:3]], offset)  # at most 3 bytes a call

        out = bytearray(10)
        fileio.pread_exact(fd, memoryview(out), 50, short_reads)
        assert bytes(out) == bytes(range(50, 60))
        with pytest.raises(ss.FileSizeError, match="unexpected end of file at byte 100"):
            fileio.pread_exact(fd, memoryview(bytearray(10)), 95)
    finally:
        os.close(fd)


def test_pwrite_all_writes_every_byte_at_the_offset(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"." * 8)
    fd = os.open(path, os.O_RDWR)
    try:
        fileio.pwrite_all(fd, memoryview(b"abc"), 2)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"..abc..."


def test_aligned_buffer_is_page_aligned_and_at_least_one_block() -> None:
    small = fileio.aligned_buffer(1)
    assert len(small) == fileio.DIRECT_ALIGN
    big = fileio.aligned_buffer(fileio.HUGE_PAGE + 1)
    assert len(big) == fileio.HUGE_PAGE + 1
    for buffer in (small, big):
        assert ctypes.addressof(ctypes.c_char.from_buffer(buffer)) % fileio.DIRECT_ALIGN == 0
        buffer.close()
