"""writer.direct: the O_DIRECT sequential file shards are written through writes exactly the
bytes given, and falls back to buffered writes where O_DIRECT is refused."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import saev_shards as ss
from saev_shards.writer import direct as direct_module

from ...support.caches import small_metadata, write_cache


@given(chunks=st.lists(st.integers(0, 20_000), max_size=12), direct=st.booleans())
@settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])  # the block size is constant
def test_sequential_file_writes_exact_bytes(monkeypatch_block: None, chunks: list[int], direct: bool) -> None:
    """O_DIRECT blocks, short remainders and the buffered tail add up to exactly the bytes given."""
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parents[2]) as tmp:
        path = Path(tmp) / "f.bin"
        rng = np.random.default_rng(len(chunks))
        data = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in chunks]
        f = direct_module.SequentialFile(path, direct=direct)
        for d in data:
            f.write(memoryview(d))
        f.close(durable=False)
        assert path.read_bytes() == b"".join(data)


@pytest.fixture
def monkeypatch_block() -> Iterator[None]:
    saved = direct_module.DIRECT_BLOCK
    direct_module.DIRECT_BLOCK = 8192  # two alignment units, so every path is hit with small data
    yield
    direct_module.DIRECT_BLOCK = saved


def test_large_shards_go_through_o_direct(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 20 MB shard (one 16 MiB block, an aligned rest, an unaligned tail) and a 10 MB one."""
    md = small_metadata(d_model=1000, n_examples=1500, patches_per_shard=10_000)
    assert md.shard_nbytes(0) == 20_000_000 > direct_module.DIRECT_BLOCK
    opened_direct = []
    real_open = os.open

    def spy(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:
            opened_direct.append(Path(path).name)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    logical = write_cache(root, md, batches=[7, 300])
    assert opened_direct == ["acts000000.bin"]
    np.testing.assert_array_equal(ss.open(root / md.hash)[:], logical)


def test_falls_back_when_o_direct_is_refused(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    md = small_metadata(d_model=1000, n_examples=1000, patches_per_shard=10_000)
    real_open = os.open

    def refuse(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported here")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    logical = write_cache(root, md, batches=[64])
    np.testing.assert_array_equal(ss.open(root / md.hash)[:], logical)
