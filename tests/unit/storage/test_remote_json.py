"""storage.remote_json: the JSON files of a remote cache kept on this node, in a folder of the
block cache laid out like a shards root: fetched atomically, left alone when they already hold
the server's bytes, forgotten when the server has none, and kept in memory when the block
cache cannot take them."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from saev_shards.errors import CacheRefError, JSONFileError
from saev_shards.storage.blockcache import BlockCache, _Unwritable, root_id
from saev_shards.storage.client import Client
from saev_shards.storage.folders import memory_folder
from saev_shards.storage.remote_json import fetch_json, forget_json, in_block_cache_or_memory, local_folder

URL = "s3://bucket/root/" + "c" * 64


class Objects(Client):
    """Whole objects from memory (``objects``: name -> bytes), as `Client.get_bytes` gives them."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        super().__init__(URL)
        self.objects = objects

    def get_bytes(self, name: str, max_bytes: int) -> bytes:
        if name not in self.objects:
            raise FileNotFoundError(name)
        data = self.objects[name]
        if len(data) > max_bytes:
            raise JSONFileError(f"{name}: too large")
        return data


def test_the_local_folder_is_laid_out_like_a_shards_root(tmp_path: Path) -> None:
    cache = BlockCache(tmp_path, limit=1 << 20)
    folder = local_folder(cache, URL + "/")
    assert folder == tmp_path / "roots" / root_id("s3://bucket/root") / ("c" * 64)
    assert folder.is_dir() and (folder.parent / ".stats").is_dir()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    in_memory = local_folder(BlockCache(tmp_path / "off", limit=0), URL)
    assert in_memory == memory_folder() / "roots" / root_id("s3://bucket/root") / ("c" * 64) and in_memory.is_dir()
    assert not (tmp_path / "off").exists()


@pytest.mark.parametrize(
    ("url", "words"),
    [("s3://bucket", "found a bucket or server alone"), ("s3://bucket/root/..", "names a folder above")],
)
def test_a_url_that_names_no_cache_is_refused(tmp_path: Path, url: str, words: str) -> None:
    with pytest.raises(CacheRefError, match=words):
        local_folder(BlockCache(tmp_path, limit=1 << 20), url)
    assert not (tmp_path / "roots").exists()


def test_a_json_file_is_fetched_kept_and_forgotten(tmp_path: Path) -> None:
    objects = {"metadata.json": b'{"a": 1}'}
    server = Objects(objects)
    assert fetch_json(server, tmp_path, "metadata.json", 100)
    path = tmp_path / "metadata.json"
    assert path.read_bytes() == b'{"a": 1}' and stat.S_IMODE(path.stat().st_mode) == 0o600
    inode = path.stat().st_ino
    assert fetch_json(server, tmp_path, "metadata.json", 100)
    assert path.stat().st_ino == inode  # the same bytes: the file another reader may hold is left in place
    objects["metadata.json"] = b'{"a": 2}'
    assert fetch_json(server, tmp_path, "metadata.json", 100, mode=0o640)
    assert path.read_bytes() == b'{"a": 2}' and stat.S_IMODE(path.stat().st_mode) == 0o640
    del objects["metadata.json"]
    assert not fetch_json(server, tmp_path, "metadata.json", 100)
    assert not path.exists()  # no copy of what the server no longer has
    forget_json(tmp_path, "metadata.json")  # gone already: nothing to do
    forget_json(tmp_path / "missing", "metadata.json")


def test_a_json_file_larger_than_its_cap_is_refused(tmp_path: Path) -> None:
    with pytest.raises(JSONFileError):
        fetch_json(Objects({"shards.json": b"x" * 10}), tmp_path, "shards.json", 9)
    assert os.listdir(tmp_path) == []


def test_a_link_at_the_files_name_is_replaced_never_followed(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "blocks.json").symlink_to(target)
    assert fetch_json(Objects({"blocks.json": b"{}"}), tmp_path / "f", "blocks.json", 10)
    assert (tmp_path / "f" / "blocks.json").read_bytes() == b"{}" and not (tmp_path / "f" / "blocks.json").is_symlink()
    assert target.read_bytes() == b"keep"


def test_a_folder_that_cannot_be_written_is_said_so(tmp_path: Path) -> None:
    with pytest.raises(_Unwritable):
        fetch_json(Objects({"a.json": b"{}"}), tmp_path / "missing", "a.json", 10)


def test_files_go_to_memory_when_the_block_cache_cannot_take_them(tmp_path: Path) -> None:
    cache = BlockCache(tmp_path, limit=1 << 20)
    tries: list[bool] = []

    def attempt(memory: bool) -> str:
        tries.append(memory)
        if not memory:
            raise _Unwritable(OSError(errno.ENOSPC, "No space left on device"))
        return "in memory"

    with pytest.warns(UserWarning, match="disk is full"):
        assert in_block_cache_or_memory(cache, attempt) == "in memory"
    assert tries == [False, True] and cache.paused

    def never(memory: bool) -> str:
        raise _Unwritable(OSError(errno.EROFS, "Read-only file system"))

    with pytest.raises(OSError, match="Read-only"), pytest.warns(UserWarning, match="cannot write to the block cache"):
        in_block_cache_or_memory(BlockCache(tmp_path / "b", limit=1 << 20), never)
    assert in_block_cache_or_memory(cache, lambda memory: memory) is False
