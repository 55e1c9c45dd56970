"""reader.manifest_checks: the files shards.json lists are checked before `open` returns, every
missing, short, unlisted or misshapen one named."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import saev_shards as ss

from ...support.caches import small_metadata, write_cache
from ...support.hostile import edit_json, writable


@pytest.fixture
def cache(root: Path) -> Path:
    md = small_metadata()
    write_cache(root, md, labels=True, lengths=None, text=True, stats=True)
    return writable(root / md.hash)


def test_wrong_number_of_shards(cache: Path) -> None:
    edit_json(cache / "shards.json", lambda d: {**d, "shards": d["shards"][:-1]})
    with pytest.raises(
        ss.InvalidCacheError, match="expected 5 shards for n_examples=23 and examples_per_shard=5, found 4"
    ):
        ss.open(cache)


def test_missing_shards_all_listed(cache: Path) -> None:
    (cache / "acts000001.bin").unlink()
    (cache / "acts000003.bin").unlink()
    with pytest.raises(ss.CacheNotFoundError) as info:
        ss.open(cache)
    assert len(info.value.problems) == 2
    assert f"{cache / 'acts000001.bin'}: missing" in str(info.value)
    assert f"{cache / 'acts000003.bin'}: missing" in str(info.value)


def test_truncated_shard(cache: Path) -> None:
    path = cache / "acts000002.bin"
    os.truncate(path, path.stat().st_size - 16)
    with pytest.raises(
        ss.FileSizeError, match=r"acts000002.bin: expected 800 bytes, found 784 \(file seems not fully written\?\)"
    ):
        ss.open(cache)


def test_shard_that_is_a_directory(cache: Path) -> None:
    (cache / "acts000002.bin").unlink()
    (cache / "acts000002.bin").mkdir()
    with pytest.raises(ss.ManifestError, match=r"acts000002\.bin: expected a regular file, found a directory"):
        ss.open(cache)


def test_unexpected_data_file(cache: Path) -> None:
    shutil.copy(cache / "acts000000.bin", cache / "acts000005.bin")
    (cache / "notes.txt").write_text("other files are allowed")
    with pytest.raises(ss.UnexpectedFileError, match=r"acts000005.bin: data file not listed in shards\.json"):
        ss.open(cache)


def test_labels_size_and_shape(cache: Path) -> None:
    os.truncate(cache / "labels.bin", 10)
    with pytest.raises(ss.FileSizeError, match=r"labels.bin: expected 92 bytes, found 10"):
        ss.open(cache)
    edit_json(cache / "shards.json", lambda d: {**d, "labels": {**d["labels"], "shape": [23, 5]}})
    with pytest.raises(ss.ManifestError, match=r"labels: expected shape \[23, 4\] uint8"):
        ss.open(cache)
