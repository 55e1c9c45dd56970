"""fileio.hashing: streaming copies and digests, of the whole and of every block."""

from __future__ import annotations

import array
import io
import itertools
from pathlib import Path

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

import saev_shards as ss
from saev_shards import fileio


def xxh(data: bytes) -> str:
    return xxhash.xxh3_128(data).hexdigest()


@given(
    data=st.binary(max_size=300),
    block_size=st.integers(1, 64),
    cuts=st.lists(st.integers(0, 300), max_size=6),
)
def test_block_hasher_matches_hashing_each_block_whatever_the_pieces(
    data: bytes, block_size: int, cuts: list[int]
) -> None:
    hasher = fileio.BlockHasher(block_size)
    bounds = [0, *sorted(min(c, len(data)) for c in cuts), len(data)]
    for start, end in itertools.pairwise(bounds):
        hasher.update(data[start:end])
    assert hasher.hexdigest() == xxh(data)
    assert hasher.block_hexdigests() == [xxh(data[i : i + block_size]) for i in range(0, len(data), block_size)]


def test_block_hasher_takes_any_buffer_and_without_a_block_size_hashes_the_whole() -> None:
    values = array.array("i", [1, 2, 3])
    hasher = fileio.BlockHasher()
    hasher.update(values)
    assert hasher.hexdigest() == xxh(values.tobytes())
    assert hasher.block_hexdigests() == []


@given(data=st.binary(max_size=5000), chunk=st.integers(1, 700))
def test_stream_copies_hashes_and_reports_every_byte(data: bytes, chunk: int) -> None:
    sink, seen = io.BytesIO(), list[int]()
    hasher = fileio.BlockHasher()
    n = fileio.stream(io.BytesIO(data), sink, hasher, seen.append, memoryview(bytearray(chunk)))
    assert n == len(data) == sum(seen)
    assert all(0 < piece <= chunk for piece in seen)
    assert sink.getvalue() == data and hasher.hexdigest() == xxh(data)


def test_write_all_finishes_short_writes() -> None:
    class Short(io.BytesIO):
        def write(self, b: object) -> int:
            return super().write(memoryview(b)[:2])  # type: ignore[arg-type]

    sink = Short()
    fileio.write_all(sink, memoryview(b"abcdefg"))
    assert sink.getvalue() == b"abcdefg"


def test_hash_file_gives_the_size_and_digest_and_can_refuse_a_link(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 1000)
    blocks = fileio.BlockHasher(300)
    assert fileio.hash_file(path, hasher=blocks) == (1000, xxh(b"x" * 1000))
    assert len(blocks.block_hexdigests()) == 4
    (tmp_path / "link").symlink_to(path)
    assert fileio.hash_file(tmp_path / "link") == (1000, xxh(b"x" * 1000))
    with pytest.raises(ss.NotRegularFileError, match="found a symbolic link"):
        fileio.hash_file(tmp_path / "link", regular_only=True)
