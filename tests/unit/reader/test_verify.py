"""reader.verify: `Shards.verify` reads every file again and names each one whose digest differs."""

from __future__ import annotations

from pathlib import Path

import pytest

import saev_shards as ss

from ...support.caches import small_metadata, write_cache
from ...support.hostile import writable


@pytest.fixture
def cache(root: Path) -> Path:
    md = small_metadata()
    write_cache(root, md, labels=True, lengths=None, text=True, stats=True)
    return writable(root / md.hash)


def test_modified_shard_fails_verify(cache: Path) -> None:
    path = cache / "acts000004.bin"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    shards = ss.open(cache)  # sizes are right: open does not read contents
    with pytest.raises(ss.ChecksumMismatchError, match=r"acts000004.bin: xxh3_128 expected [0-9a-f]{32}, found"):
        shards.verify()


def test_modified_text_and_labels_fail_verify(cache: Path) -> None:
    for name in ("labels.bin", "text.prompt.jsonl"):
        data = bytearray((cache / name).read_bytes())
        data[0] ^= 2
        (cache / name).write_bytes(bytes(data))
    with pytest.raises(ss.ChecksumMismatchError) as info:
        ss.open(cache).verify()
    assert len(info.value.problems) == 2
