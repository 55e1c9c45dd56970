"""storage.remote: the offset arithmetic of remote reads (`RemoteFiles.preadv`), property-tested
against plain slicing of the file's bytes, per block and per whole file, with a server in
memory; and blocks taken from the block cache checked before use. How a block is fetched
again, stored and let go of: test_units.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from saev_shards.storage.blockcache import BlockCache
from saev_shards.storage.client import Client
from saev_shards.storage.remote import RemoteFiles

DATA = bytes((i * 7 + i // 251) % 256 for i in range(5000))


class MemoryClient(Client):
    """Serves ``data`` (under any name; or, a dict, each name's bytes) from memory, in pieces of
    ``piece`` bytes; ``damage`` flips a byte of the next ``n`` answers, ``cut`` drops (or,
    negative, adds) bytes at the end of the next one."""

    def __init__(self, data: bytes | dict[str, bytes], piece: int = 1000) -> None:
        super().__init__("s3://bucket/root")
        self.data = data
        self.piece = piece
        self.requests: list[tuple[int, int]] = []
        self.damage = 0
        self.cut = 0

    def stream(self, name: str, start: int, end: int, chunk: int = 0) -> Any:
        self.requests.append((start, end))
        data = self.data[name] if isinstance(self.data, dict) else self.data
        body = bytearray(data[start:end])
        if self.damage and body:
            self.damage -= 1
            body[0] ^= 1
        if self.cut:
            body = body[: len(body) - self.cut] if self.cut > 0 else body + b"x" * -self.cut
            self.cut = 0
        for i in range(0, len(body), self.piece):
            yield bytes(body[i : i + self.piece])


def remote_file(
    tmp_path: Path, block_size: int | None, bodies: dict[str, bytes] | None = None
) -> tuple[RemoteFiles, MemoryClient]:
    """A remote cache's files served from memory: ``f.bin`` holding `DATA`, or ``bodies``."""
    bodies = bodies or {"f.bin": DATA}
    files = RemoteFiles(
        "s3://bucket/root/" + "a" * 64,
        {name: (len(body), xxhash.xxh3_128_hexdigest(body)) for name, body in bodies.items()},
        BlockCache(tmp_path),
    )
    client = MemoryClient(bodies)
    files.client = client
    if block_size is not None:
        bs = block_size
        digests = {
            n: [xxhash.xxh3_128_hexdigest(b[i : i + bs]) for i in range(0, len(b), bs)] for n, b in bodies.items()
        }
        files.use_blocks(block_size, digests.get)
    return files, client


@given(
    block_size=st.none() | st.sampled_from([1, 7, 64, 1000, 4999, 5000, 8192]),
    offset=st.integers(0, len(DATA) + 10),
    sizes=st.lists(st.integers(0, 1500), min_size=1, max_size=4),
)
def test_preadv_equals_slicing(
    tmp_path_factory: pytest.TempPathFactory, block_size: int | None, offset: int, sizes: list[int]
) -> None:
    files, client = remote_file(tmp_path_factory.mktemp("bc"), block_size)
    views = [memoryview(bytearray(n)) for n in sizes]
    try:
        got = files.preadv(files.open("f.bin"), views, offset)
    finally:
        files.close_all()
    want = DATA[offset : offset + sum(sizes)]
    assert got == len(want)  # short only at the end of the file, as os.preadv
    assert b"".join(bytes(v) for v in views)[:got] == want
    if block_size is not None and got:  # only the blocks holding the bytes asked for, once per content
        first, last = offset // block_size, (offset + got - 1) // block_size
        blocks = [(i * block_size, min(len(DATA), (i + 1) * block_size)) for i in range(first, last + 1)]
        assert set(client.requests) <= set(blocks)
        assert len(client.requests) == len({DATA[a:b] for a, b in blocks})


def test_a_block_from_the_block_cache_is_checked_before_use(tmp_path: Path) -> None:
    """A new reader takes stored blocks from the block cache (no request), checked as read; a
    damaged entry is discarded and the block fetched again."""
    files, client = remote_file(tmp_path, 4096)
    assert bytes(files.read("f.bin")) == DATA
    files.close_all()
    again, client = remote_file(tmp_path, 4096)
    assert bytes(again.read("f.bin", 10, 5000)) == DATA[10:]
    assert client.requests == []
    again.close_all()
    path = again.cache.path(xxhash.xxh3_128_hexdigest(DATA[4096:]))
    path.chmod(0o644)
    path.write_bytes(b"x" + DATA[4097:])
    third, client = remote_file(tmp_path, 4096)
    assert bytes(third.read("f.bin", 4100, 4200)) == DATA[4100:4200]
    assert client.requests == [(4096, 5000)]
    third.close_all()
