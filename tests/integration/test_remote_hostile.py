"""Remote reads, the block cache, push and pull against hostile servers and a hostile node,
on 127.0.0.1 only (tests/support/remote_servers.py: an HTTP server honouring Range requests,
moto's S3 server, a proxy injecting faults).

Shown, each case ending in correct data or a documented `ShardsError` within a bound:

* the block cache never removes or writes anything outside its own folder: a link at the
  name of ``blocks/``, ``tmp/``, ``roots/`` or a folder of ``blocks/`` is never followed, and
  an entry that is a FIFO, a link or a folder is discarded (never opened so as to block) and
  its block fetched again;
* a full disk (a real tmpfs) serves from memory with one warning; ``$SAEV_SHARDS_BLOCK_CACHE_BYTES``
  of 0 is no disk cache, and a value that is not a size is a `BlockCacheError` naming it;
* URL segments ``.`` and ``..`` are refused before any local folder is made from them;
* the block cache is private (0700 folders, 0600 files, 0400 entries), another user's folder is
  refused, and a folder shared with a group on purpose (setgid, 2770) is used as such;
* a body longer than announced is read no further than one byte past the size expected
  (reads per block and per whole file, `verify`, `pull`), and a body dripped in is given up
  after ``$SAEV_SHARDS_REMOTE_TIMEOUT`` with one request, not four;
* `push` checks the objects it keeps before the commit point, replaces those of the right
  size with other bytes, and reads back what it uploads before publishing: a second push
  repairs a damaged remote copy.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

import saev_shards as ss
from saev_shards import store
from saev_shards.cli import main
from saev_shards.errors import (
    BlockCacheError,
    CacheNotFoundError,
    CacheRefError,
    ChecksumMismatchError,
    FileSizeError,
    RemoteError,
    RemoteTimeoutError,
)
from saev_shards.protocol.common import PROTOCOL_30
from saev_shards.remote.blockcache import BlockCache
from saev_shards.remote.client import Client

from ..support.caches import small_metadata, write_cache
from ..support.faults import NOBODY, fill, run_child, small_filesystem
from ..support.hostile import time_bound
from ..support.remote_servers import Faults, create_bucket, fault_proxy, moto_server, range_server, s3_environment

#: The time allowed a remote unit of up to 16 MiB, in these tests (the default is 30 s).
TIMEOUT = "1"
#: Bytes the server may have pushed into the connection past a body before the client hung
#: up (socket buffers): far below the 256 MiB it offers.
SENT_BOUND = 48 << 20


@pytest.fixture
def block_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "block-cache"
    monkeypatch.setenv("SAEV_SHARDS_BLOCK_CACHE", str(folder))
    monkeypatch.delenv("SAEV_SHARDS_BLOCK_CACHE_BYTES", raising=False)
    monkeypatch.setenv("SAEV_SHARDS_REMOTE_RETRIES", "2")
    monkeypatch.setattr("saev_shards.storage.units.VERIFY_BACKOFF", 0.01)
    return folder


@dataclasses.dataclass
class Served:
    """A local cache served over HTTP: its URL, the server's faults, the cache and its values."""

    url: str
    faults: Faults
    local: ss.Shards
    logical: Any


@pytest.fixture(params=[ss.PROTOCOL, PROTOCOL_30], ids=["per-block", "per-file"])
def served(request: pytest.FixtureRequest, tmp_path: Path, block_cache: Path) -> Iterator[Served]:
    """A small cache (23 examples, 5 shards of 800 bytes) on an HTTP server, read per block
    (protocol 3.1, blocks.json) or per whole file (protocol 3.0)."""
    root = tmp_path / "shards"
    root.mkdir()
    md = small_metadata(protocol=request.param)
    logical = write_cache(root, md, labels=True, text=True, stats=True)
    with range_server(root) as (base, faults):
        yield Served(f"{base}/{md.hash}", faults, ss.open(root / md.hash), logical)


def unit_key(served: Served, name: str) -> str:
    """The block cache key of the (only) unit of file ``name``."""
    digests = served.local.block_digests(name)
    if digests is not None:
        return digests[0]
    return f"file-{next(d for f, _, d in served.local.manifest.files() if f == name)}"


def outside_files(tmp_path: Path) -> dict[Path, bytes]:
    """A folder outside the block cache with old files (older than any stale limit) and one
    named like an entry folder: what a trim through a link would delete."""
    outside = tmp_path / "outside"
    (outside / "ab").mkdir(parents=True)
    files = {outside / "precious.bin": b"keep me" * 100, outside / "ab" / ("0" * 30 + "ab"): b"x" * 5000}
    for path, data in files.items():
        path.write_bytes(data)
        os.utime(path, (1, 1))  # 1970: older than any stale limit, the least recently used
    return files


def assert_intact(files: dict[Path, bytes]) -> None:
    for path, data in files.items():
        assert path.is_file() and path.read_bytes() == data, f"{path} was changed through a link"


# --------------------------------------------------------------------------------------
# the block cache: never outside its folder


@pytest.mark.parametrize("linked", ["blocks", "tmp", "roots", "blocks/xx"])
def test_links_inside_the_block_cache_are_never_followed(
    served: Served, block_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, linked: str
) -> None:
    files = outside_files(tmp_path)
    outside = tmp_path / "outside"
    key = unit_key(served, "acts000002.bin")
    name = linked.replace("xx", key[-2:])
    (block_cache / name).parent.mkdir(parents=True, exist_ok=True)
    os.chmod(block_cache, 0o700)
    (block_cache / name).symlink_to(outside, target_is_directory=True)
    monkeypatch.setattr("saev_shards.storage.blockcache.STALE_SECONDS", 0)  # every old temporary file is stale
    cache = BlockCache(block_cache, limit=1)  # every trim removes every entry
    cache.trim(target=0.0)
    assert_intact(files)
    remote = ss.open(served.url)
    np.testing.assert_array_equal(remote[:], served.logical)
    remote.files.flush()  # type: ignore[attr-defined]
    assert cache.trim(target=0.0) >= 0
    assert_intact(files)
    assert sorted(p.name for p in outside.rglob("*")) == sorted(["ab", *(p.name for p in files)])
    # The link itself was replaced by a real folder, inside the cache.
    assert (block_cache / name).is_dir() and not (block_cache / name).is_symlink()


@pytest.mark.parametrize("kind", ["fifo", "link", "folder", "file"])
def test_an_entry_that_is_not_a_regular_file_is_discarded_and_fetched_again(
    served: Served, block_cache: Path, tmp_path: Path, kind: str
) -> None:
    key = unit_key(served, "acts000002.bin")
    cache = BlockCache(block_cache)
    entry = cache.path(key)
    entry.parent.mkdir(parents=True)
    os.chmod(block_cache, 0o700)
    target = tmp_path / "elsewhere.bin"
    target.write_bytes((served.local.path / "acts000002.bin").read_bytes())  # the right bytes, outside
    if kind == "fifo":
        os.mkfifo(entry)
    elif kind == "link":
        entry.symlink_to(target)
    elif kind == "folder":
        (entry / "inside").mkdir(parents=True)
    else:
        entry.write_bytes(b"\0" * 800)  # a regular file of the right size and other bytes
    with time_bound(20, f"reading through a {kind} entry"):  # a FIFO opened plainly blocks forever
        remote = ss.open(served.url)
        np.testing.assert_array_equal(remote[10:15], served.logical[10:15])
        remote.files.flush()  # type: ignore[attr-defined]
    assert served.faults.count("acts000002.bin") == 1  # fetched again
    st = os.lstat(entry)
    assert stat.S_ISREG(st.st_mode) and xxhash.xxh3_128_hexdigest(entry.read_bytes()) == key.removeprefix("file-")
    assert target.read_bytes() == (served.local.path / "acts000002.bin").read_bytes()  # never touched


def test_trim_keeps_to_the_cache_with_a_linked_trim_lock(tmp_path: Path) -> None:
    """trim.lock a link to a file outside: never opened through it (the link is replaced)."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"do not truncate")
    folder = tmp_path / "bc"
    folder.mkdir(mode=0o700)
    (folder / "trim.lock").symlink_to(victim)
    cache = BlockCache(folder, limit=10_000)  # no trim while inserting
    fd = cache.insert("0" * 32, b"x" * 100)
    assert fd is not None
    os.close(fd)
    assert cache.trim(target=0.0) == 100
    assert victim.read_bytes() == b"do not truncate" and not (folder / "trim.lock").is_symlink()


# --------------------------------------------------------------------------------------
# full disks, the size limit, URLs


def test_a_full_disk_serves_from_memory_with_one_warning(served: Served, tmp_path: Path, monkeypatch: Any) -> None:
    with small_filesystem(tmp_path / "disk", size_mib=1) as disk:
        folder = disk / "block-cache"
        monkeypatch.setenv("SAEV_SHARDS_BLOCK_CACHE", str(folder))
        filler = fill(disk)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            remote = ss.open(served.url)
            np.testing.assert_array_equal(remote[:], served.logical)
            remote.files.flush()  # type: ignore[attr-defined]
            np.testing.assert_array_equal(ss.open(served.url)[3:9], served.logical[3:9])
            assert remote.stats is not None and remote.verify() > 0
        messages = [str(w.message) for w in caught]
        assert len(messages) == 1 and "disk is full" in messages[0] and str(folder) in messages[0], messages
        assert remote.path.is_dir() and not remote.path.is_relative_to(disk)  # its JSON files: in memory
        assert BlockCache(folder).usage() == 0
        filler.unlink()  # space again: entries are kept again (by a new process, or after the pause)
        monkeypatch.setattr("saev_shards.storage.blockcache.FULL_PAUSE", 0.0)
        again = ss.open(served.url)
        np.testing.assert_array_equal(again[:], served.logical)
        again.files.flush()  # type: ignore[attr-defined]
        assert again.path.is_relative_to(folder) and BlockCache(folder).usage() > 0


@pytest.mark.parametrize("value", ["0", "-5", "lots", "1.5", "64 GB", "1e9", " 64M "])
def test_the_block_cache_size_variable(
    served: Served, block_cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    monkeypatch.setenv("SAEV_SHARDS_BLOCK_CACHE_BYTES", value)
    if value in ("0", "64 GB", " 64M "):
        remote = ss.open(served.url)
        np.testing.assert_array_equal(remote[:], served.logical)
        remote.files.flush()  # type: ignore[attr-defined]
        if value == "0":  # no disk cache: nothing written under its folder, every read from the server
            assert not block_cache.exists()
            before = served.faults.count("acts000001.bin")
            np.testing.assert_array_equal(ss.open(served.url)[5], served.logical[5])
            assert served.faults.count("acts000001.bin") == before + 1
        else:
            assert BlockCache(block_cache).usage() > 0
        return
    with pytest.raises(BlockCacheError, match=r"\$SAEV_SHARDS_BLOCK_CACHE_BYTES: expected a size in bytes") as err:
        ss.open(served.url)
    assert "\n" not in str(err.value)
    assert main(["info", served.url]) == 2
    out = capsys.readouterr().err
    assert "SAEV_SHARDS_BLOCK_CACHE_BYTES" in out and out.count("\n") == 1
    assert not block_cache.exists()


@pytest.mark.parametrize("tail", ["..", ".", "%2e%2e", ".%2E", "%2e", "../..", "x/../..", "\x00", ""])
def test_dot_segments_are_refused_before_any_local_path(
    served: Served, block_cache: Path, capsys: pytest.CaptureFixture[str], tail: str
) -> None:
    base = served.url.rsplit("/", 1)[0]
    url = f"{base}/{served.local.metadata.hash}/{tail}" if tail else base.split("/", 3)[0] + "//" + base.split("/")[2]
    with pytest.raises(CacheRefError):
        ss.open(url)
    assert not block_cache.exists()  # nothing made from the URL, not even the cache's folder
    assert served.faults.requests == []  # nor was the server asked
    if "\x00" not in tail:
        assert main(["info", url]) == 3
        assert capsys.readouterr().err.count("\n") == 1
        assert not block_cache.exists()


# --------------------------------------------------------------------------------------
# who can read the block cache


def modes(folder: Path) -> dict[str, set[int]]:
    found: dict[str, set[int]] = {"folders": set(), "files": set(), "entries": set()}
    for path in [folder, *folder.rglob("*")]:
        st = os.lstat(path)
        kind = "folders" if stat.S_ISDIR(st.st_mode) else "entries" if "blocks" in path.parts else "files"
        found[kind].add(stat.S_IMODE(st.st_mode))
    return found


def test_the_block_cache_is_private_to_its_owner(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = Path(tempfile.mkdtemp(prefix="saev-bc-", dir="/tmp"))  # /tmp: every user may pass through
    os.chmod(shared, 0o755)
    block_cache = shared / "block-cache"
    monkeypatch.setenv("SAEV_SHARDS_BLOCK_CACHE", str(block_cache))
    old = os.umask(0o022)  # the usual umask: 0755 folders and 0644 files unless asked otherwise
    try:
        remote = ss.open(served.url)
        np.testing.assert_array_equal(remote[:], served.logical)
        remote.files.flush()  # type: ignore[attr-defined]
        assert modes(block_cache) == {"folders": {0o700}, "files": {0o600}, "entries": {0o400}}
        if os.geteuid() == 0:  # another user cannot look inside
            entry = next(p for p in block_cache.rglob("*") if p.is_file() and "blocks" in p.parts)
            outcome = run_child(entry.read_bytes, as_nobody=True)
            assert outcome.kind == "PermissionError", outcome
            outcome = run_child(os.listdir, block_cache, as_nobody=True)
            assert outcome.kind == "PermissionError", outcome
        # A folder of an earlier version (0755) is made private on first use.
        os.chmod(block_cache, 0o755)
        ss.open(served.url)[0]
        assert stat.S_IMODE(os.stat(block_cache).st_mode) == 0o700
    finally:
        os.umask(old)
        shutil.rmtree(shared, ignore_errors=True)


def test_another_users_block_cache_is_refused(
    served: Served, block_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    block_cache.mkdir(mode=0o755)
    os.chown(block_cache, NOBODY, NOBODY)
    with pytest.raises(BlockCacheError, match=r"belongs to user .*65534.*not to you.*SAEV_SHARDS_BLOCK_CACHE"):
        ss.open(served.url)
    assert main(["info", served.url]) == 2
    assert "not to you" in capsys.readouterr().err
    assert list(block_cache.iterdir()) == []  # nothing written into it
    # Shared with a group on purpose, but open to everyone too: refused as well.
    os.chmod(block_cache, 0o2777)
    with pytest.raises(BlockCacheError, match="open to every user too"):
        ss.open(served.url)


def test_a_block_cache_shared_with_a_group_on_purpose(served: Served, block_cache: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    block_cache.mkdir()
    os.chown(block_cache, NOBODY, os.getegid())  # another user's folder, of a group this user is in
    os.chmod(block_cache, 0o2770)  # install -d -m 2770 -g GROUP DIR
    remote = ss.open(served.url)
    np.testing.assert_array_equal(remote[:], served.logical)
    remote.files.flush()  # type: ignore[attr-defined]
    found = modes(block_cache)
    assert found == {"folders": {0o2770}, "files": {0o660}, "entries": {0o440}}, found
    assert {os.lstat(p).st_gid for p in block_cache.rglob("*")} == {os.getegid()}  # the group's, for its members


# --------------------------------------------------------------------------------------
# bodies longer than announced, bodies dripped in


@pytest.mark.parametrize("how", ["read", "verify", "pull"])
def test_a_body_longer_than_asked_for_is_read_one_byte_past_its_size(served: Served, tmp_path: Path, how: str) -> None:
    """The server answers the 800-byte acts000002.bin with 256 MiB more, announced."""
    remote = ss.open(served.url)
    served.faults.add("long", "acts000002.bin", times=-1)
    expected: type[Exception]
    if how == "read":
        with pytest.raises(ChecksumMismatchError, match=r"acts000002\.bin: .*801 bytes came instead of 800"):
            remote[12]
        np.testing.assert_array_equal(remote[3], served.logical[3])  # other files still read
    elif how == "verify":
        with pytest.raises(FileSizeError, match=r"acts000002\.bin: expected 800 bytes, found 801"):
            remote.verify()
    else:
        expected = FileSizeError
        with pytest.raises(expected, match=r"acts000002\.bin: expected 800 bytes, found more"):
            store.pull(served.url, tmp_path / "pulled")
        assert not (tmp_path / "pulled" / served.local.metadata.hash).exists()  # nothing published
        leftover = tmp_path / "pulled" / f".copying-{served.local.metadata.hash}" / "acts000002.bin"
        assert not leftover.exists() or leftover.stat().st_size <= 801
    assert 0 < served.faults.extra_sent < SENT_BOUND * served.faults.count("acts000002.bin")


@pytest.mark.parametrize("how", ["read", "verify", "pull"])
def test_a_body_dripped_in_is_given_up_after_the_timeout(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """acts000002.bin comes one byte every 0.25 s (200 s for its 800 bytes): with
    ``SAEV_SHARDS_REMOTE_TIMEOUT=1`` it is given up after one request, not four."""
    monkeypatch.setenv("SAEV_SHARDS_REMOTE_TIMEOUT", TIMEOUT)
    remote = ss.open(served.url)
    served.faults.add("drip", "acts000002.bin", times=-1)
    with time_bound(60, f"{how} of a dripped body"), pytest.raises(RemoteTimeoutError) as err:
        if how == "read":
            remote[12]
        elif how == "verify":
            remote.verify()
        else:
            store.pull(served.url, tmp_path / "pulled")
    text = str(err.value)
    assert "acts000002.bin" in text and "SAEV_SHARDS_REMOTE_TIMEOUT" in text and "\n" not in text
    assert served.faults.count("acts000002.bin") == 1
    if how == "read":
        assert "block 0" in text or "the whole file" in text
        np.testing.assert_array_equal(remote[3], served.logical[3])
    served.faults.clear()
    np.testing.assert_array_equal(ss.open(served.url)[12], served.logical[12])  # and read once it answers


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan", "inf"])
def test_the_remote_timeout_variable(
    served: Served, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    monkeypatch.setenv("SAEV_SHARDS_REMOTE_TIMEOUT", value)
    with pytest.raises(RemoteError, match=r"\$SAEV_SHARDS_REMOTE_TIMEOUT: expected a number of seconds > 0"):
        ss.open(served.url)
    assert main(["info", served.url]) == 4
    assert capsys.readouterr().err.count("\n") == 1


# --------------------------------------------------------------------------------------
# push: what is kept is checked before the commit point


@pytest.fixture(scope="module")
def moto_port() -> Iterator[int]:
    with moto_server() as port:
        yield port


@dataclasses.dataclass
class Bucket:
    root: str
    faults: Faults


@pytest.fixture
def bucket(moto_port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block_cache: Path) -> Iterator[Bucket]:
    with fault_proxy(moto_port) as (endpoint, faults):
        for key, value in s3_environment(endpoint, block_cache).items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("AWS_PROFILE", raising=False)
        name = f"saev-{uuid.uuid4().hex[:12]}"
        create_bucket(f"http://127.0.0.1:{moto_port}", name)
        yield Bucket(f"s3://{name}/shards", faults)


@pytest.fixture
def local(tmp_path: Path) -> tuple[ss.Shards, Any]:
    root = tmp_path / "shards"
    root.mkdir()
    md = small_metadata()
    logical = write_cache(root, md, labels=True, text=True, stats=True)
    return ss.open(root / md.hash), logical


def other_bytes(path: Path) -> bytes:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    return bytes(data)


def test_a_second_push_repairs_a_damaged_remote_copy(bucket: Bucket, local: tuple[ss.Shards, Any]) -> None:
    shards, logical = local
    url = store.push(shards.path, bucket.root).url
    Client(url).put("acts000003.bin", other_bytes(shards.path / "acts000003.bin"))  # damaged at rest
    with pytest.raises(ChecksumMismatchError):
        ss.open(url)[16]
    bucket.faults.clear()
    report = store.push(shards.path, bucket.root)
    assert report.replaced == ["acts000003.bin"] and report.uploaded_files == 1 and not report.already_pushed
    puts = [p for m, p in bucket.faults.requests if m == "PUT"]
    assert puts[0].endswith("/acts000003.bin") and puts[-1].endswith("/shards.json")
    # Unpublished (shards.json deleted: obstore's bulk delete) before the repair was uploaded.
    kinds = [(m, p.rsplit("/", 1)[-1]) for m, p in bucket.faults.requests]
    assert kinds.index(("POST", f"{bucket.root.split('/')[2]}?delete")) < kinds.index(("PUT", "acts000003.bin"))
    np.testing.assert_array_equal(ss.open(url)[:], logical)
    assert ss.open(url).verify() > 0
    assert store.push(shards.path, bucket.root).already_pushed  # and now it is whole


def test_an_object_of_an_earlier_upload_is_checked_before_the_commit_point(
    bucket: Bucket, local: tuple[ss.Shards, Any]
) -> None:
    """A broken earlier upload (or someone else's object) of the right size: replaced, and
    only then is shards.json written."""
    shards, logical = local
    url = f"{bucket.root}/{shards.metadata.hash}"
    Client(url).put("acts000001.bin", other_bytes(shards.path / "acts000001.bin"))
    report = store.push(shards.path, bucket.root, verify=False)
    assert report.replaced == ["acts000001.bin"] and report.verified_bytes == 800
    order = [p.rsplit("/", 1)[-1] for m, p in bucket.faults.requests if m == "PUT"]
    assert order.index("acts000001.bin") < order.index("shards.json") == len(order) - 1
    np.testing.assert_array_equal(ss.open(url)[:], logical)


def test_what_push_uploads_is_read_back_before_it_is_published(
    bucket: Bucket, local: tuple[ss.Shards, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    shards, logical = local
    url = f"{bucket.root}/{shards.metadata.hash}"
    bucket.faults.add("corrupt", "acts000004.bin", times=-1)  # the server gives back other bytes
    with pytest.raises(ChecksumMismatchError, match=r"acts000004\.bin: xxh3_128 expected .* was not published"):
        store.push(shards.path, bucket.root)
    with pytest.raises(CacheNotFoundError):
        ss.open(url)
    assert main(["push", str(shards.path), bucket.root]) == 1
    capsys.readouterr()
    bucket.faults.clear()
    assert main(["push", str(shards.path), bucket.root]) == 0
    assert "already there" in capsys.readouterr().err
    np.testing.assert_array_equal(ss.open(url)[:], logical)


def test_push_on_the_command_line_names_what_it_replaced(
    bucket: Bucket, local: tuple[ss.Shards, Any], tmp_path: Path
) -> None:
    shards, _ = local
    url = store.push(shards.path, bucket.root).url
    Client(url).put("labels.bin", other_bytes(shards.path / "labels.bin"))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-m", "saev_shards", "push", str(shards.path), bucket.root],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "replaced 1 that held other bytes (labels.bin)" in done.stderr and done.stdout == f"{url}\n"
