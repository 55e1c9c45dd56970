"""Caches in object stores, against a real S3-compatible server (moto, in a process of its own)
and an HTTP server honouring Range requests, both on 127.0.0.1 and started here; faults are
injected by a proxy in front of them (tests/support/remote_servers.py).

Shown: a remote cache reads exactly as its local copy (indexing, loaders, rank shares,
resume); a half-uploaded cache is invisible and a killed push resumes; every fault ends in a
retry or a clear error, never in wrong data; block digests catch a flipped byte in a remote
object; two processes share one block cache; each refusal of the server has its own line
and exit code.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import saev_shards as ss
from saev_shards import store
from saev_shards.cli import main
from saev_shards.errors import (
    CacheNotFoundError,
    ChecksumMismatchError,
    MissingDependencyError,
    RemoteAccessDeniedError,
    RemoteBucketError,
    RemoteCredentialsError,
    RemoteRegionError,
    UnknownCacheError,
)
from saev_shards.protocol.common import FLOAT8, PROTOCOL_30
from saev_shards.remote.blockcache import BlockCache
from saev_shards.remote.client import Client

from ..support.caches import small_metadata, write_cache
from ..support.remote_servers import (
    Faults,
    create_bucket,
    fault_proxy,
    free_port,
    moto_server,
    range_server,
    s3_environment,
)
from ..unit.reader.test_indexing import keys, outcome

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def moto_port() -> Iterator[int]:
    with moto_server() as port:
        yield port


@dataclasses.dataclass
class S3:
    root: str  # s3://<bucket>/shards
    faults: Faults
    env: dict[str, str]
    server: str  # moto itself, without the proxy


@pytest.fixture
def s3(moto_port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3]:
    """A fresh bucket behind a fault-injecting proxy, the AWS variables pointing at it, and an
    empty block cache."""
    with fault_proxy(moto_port) as (endpoint, faults):
        env = {**s3_environment(endpoint, tmp_path / "block-cache"), "SAEV_SHARDS_REMOTE_RETRIES": "3"}
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("AWS_PROFILE", raising=False)
        bucket = f"saev-{uuid.uuid4().hex[:12]}"
        server = f"http://127.0.0.1:{moto_port}"
        create_bucket(server, bucket)
        yield S3(f"s3://{bucket}/shards", faults, env, server)


#: The protocol before blocks.json: its caches are read remotely per whole file.
WHOLE_FILE_PROTOCOL = PROTOCOL_30


@pytest.fixture
def local(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[ss.Shards, Any]:
    """A local cache with labels, a lengths column, text and statistics (23 examples, 5 shards),
    in the protocol this library writes (a test may ask for another, or "float8", with ``indirect``)."""
    root = tmp_path / "shards"
    root.mkdir()
    param = getattr(request, "param", ss.PROTOCOL)
    md = small_metadata(dtype="float8_e4m3") if param == "float8" else small_metadata(protocol=param)
    lengths = np.arange(md.n_examples) % md.tokens_per_ex + 1
    logical = write_cache(root, md, labels=True, lengths=lengths, text=True, stats=True)
    return ss.open(root / md.hash), logical


def pushed(s3: S3, local: tuple[ss.Shards, Any]) -> ss.Shards:
    report = store.push(local[0].path, s3.root)
    assert report.url == f"{s3.root}/{local[0].metadata.hash}" and report.verified_bytes > 0
    return ss.open(report.url)


def fresh_block_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / f"block-cache-{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv("SAEV_SHARDS_BLOCK_CACHE", str(folder))
    return folder


# --------------------------------------------------------------------------------------
# reads


@pytest.mark.parametrize("local", [ss.PROTOCOL, WHOLE_FILE_PROTOCOL], indirect=True)
def test_remote_cache_reads_as_its_local_copy(s3: S3, local: tuple[ss.Shards, Any]) -> None:
    shards, logical = local
    remote = pushed(s3, local)
    assert remote.url == f"{s3.root}/{shards.metadata.hash}" and remote.location == remote.url
    assert remote.metadata == shards.metadata and remote.manifest == shards.manifest
    np.testing.assert_array_equal(remote[:], logical)
    np.testing.assert_array_equal(remote.example(7, 11), shards.example(7, 11))
    np.testing.assert_array_equal(remote.get(22, 6, 3), shards.get(22, 6, 3))
    np.testing.assert_array_equal(remote.read_range(3, 17), shards.read_range(3, 17))
    np.testing.assert_array_equal(remote.read_example(9, 1), shards.read_example(9, 1))
    args = ([1, 5, 22, 5], [0, 1, 0, 1], [2, 3, 4, 0])
    np.testing.assert_array_equal(remote.read_vectors(*args), shards.read_vectors(*args))
    assert remote.labels is not None and shards.labels is not None
    np.testing.assert_array_equal(remote.labels, shards.labels)
    np.testing.assert_array_equal(remote.columns["lengths"], shards.columns["lengths"])
    assert list(remote.text["prompt"]) == list(shards.text["prompt"]) and remote.text["prompt"][-1] == "example 22: é"
    assert remote.stats is not None and shards.stats is not None
    np.testing.assert_array_equal(remote.stats["mean"], shards.stats["mean"])
    # Views of memory maps locally, copies remotely: writing to one never reaches the cache.
    view = remote.example(7, 11)
    view[...] = 0
    np.testing.assert_array_equal(remote.example(7, 11), shards.example(7, 11))
    assert remote.verify() == sum(n for _, n, _ in shards.manifest.files())
    assert "s3://" in repr(remote)
    per_block = shards.metadata.protocol != WHOLE_FILE_PROTOCOL
    assert store.summary(remote)["remote_verification"] == ("per block" if per_block else "per file")


def test_a_float8_cache_reads_remotely_with_its_scales(s3: S3, tmp_path: Path) -> None:
    root = tmp_path / "f8"
    root.mkdir()
    md = small_metadata(dtype="float8_e4m3")
    write_cache(root, md)
    shards = ss.open(root / md.hash)
    remote = ss.open(store.push(shards.path, s3.root).url)
    np.testing.assert_array_equal(remote[:], shards[:])  # dequantized with the scales, read remotely
    np.testing.assert_array_equal(remote.raw[2:9].view(np.uint8), shards.raw[2:9].view(np.uint8))
    assert remote.scales is not None and shards.scales is not None
    np.testing.assert_array_equal(remote.scales[:, 1], shards.scales[:, 1])
    np.testing.assert_array_equal(remote.with_dtype("float32")[[4, 0, 22]], shards.with_dtype("float32")[[4, 0, 22]])


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_remote_indexing_matches_numpy(data: st.DataObject) -> None:
    remote, logical = _REMOTE[0]
    key = data.draw(keys(logical.shape))
    expected = outcome(logical, key)
    got = outcome(remote, key)
    assert got[0] == expected[0], f"key {key!r}"
    if expected[0] == "ok":
        assert got[1].shape == expected[1].shape, f"key {key!r}"
        np.testing.assert_array_equal(got[1], expected[1])


_REMOTE: list[tuple[ss.Shards, Any]] = []


@pytest.fixture(autouse=True)
def _remote_for_hypothesis(request: pytest.FixtureRequest) -> None:
    if request.function.__name__ == "test_remote_indexing_matches_numpy":
        s3_, local_ = request.getfixturevalue("s3"), request.getfixturevalue("local")
        _REMOTE[:] = [(pushed(s3_, local_), local_[1])]


def batches(loader: Any, n: int | None = None) -> list[tuple[Any, ...]]:
    out = []
    for i, b in enumerate(loader):
        if n is not None and i >= n:
            break
        out.append((b.acts.clone(), b.examples.clone(), b.tokens.clone(), b.layers.clone()))
    return out


def same(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> bool:
    return len(a) == len(b) and all(
        all(torch.equal(x, y) for x, y in zip(p, q, strict=True)) for p, q in zip(a, b, strict=True)
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"order": "shuffled"},
        {"order": "ordered"},
        {"order": "shuffled", "stack_layers": True, "out_dtype": "float32"},
        {"order": "shuffled", "device": "cpu"},
        {"order": "shuffled", "rank": 1, "world_size": 2, "drop_last": True},
    ],
)
def test_loaders_give_the_same_batches_from_remote_and_local(
    s3: S3, local: tuple[ss.Shards, Any], kwargs: dict[str, Any]
) -> None:
    from saev_shards.loaders import TokenLoader

    shards, _ = local
    remote = pushed(s3, local)
    mix = {} if kwargs.get("stack_layers") else {"mix_layers": True}
    common = {"batch_size": 7, "layers": [6, 11], "buffer_bytes": 1200, "block_bytes": 400, "seed": 3, **mix, **kwargs}
    want = batches(TokenLoader(shards, **common))
    got = batches(TokenLoader(remote, **common))
    assert want and same(got, want)
    # Exact resume: a state taken after 2 batches from the remote cache continues as the local run does.
    loader = TokenLoader(remote, **common)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    del it
    resumed = TokenLoader(remote, **common)
    resumed.load_state_dict(state)
    assert same(batches(resumed), want[2:])


@pytest.mark.parametrize("local", [ss.PROTOCOL, WHOLE_FILE_PROTOCOL, "float8"], indirect=True)
def test_a_warm_block_cache_is_read_in_place_with_the_same_batches(
    s3: S3, local: tuple[ss.Shards, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first epoch reads into buffers (blocks not stored yet); once every block is in the
    block cache the loader maps them in place (a float8 cache's scale files too), in this
    process and in a newly opened cache, whose entries are taken on their seals (not hashed
    again), with the batches of the local cache."""
    from saev_shards.loaders import ShuffledLoader, mapped
    from saev_shards.storage import blockcache

    monkeypatch.setattr(mapped, "MIN_SHARD_BYTES", 1)  # the small test shards are mapped too
    folder = fresh_block_cache(tmp_path, monkeypatch)
    shards, _ = local
    remote = pushed(s3, local)
    common: dict[str, Any] = {"batch_size": 7, "layers": [6, 11], "mix_layers": True, "buffer_bytes": 1200, "seed": 3}
    local_loader = ShuffledLoader(shards, **common)
    want, want_next, want_third = batches(local_loader), batches(local_loader), batches(local_loader)
    loader = ShuffledLoader(remote, **common)

    def in_place(loader: Any) -> bool:
        return loader._spares.map is not None

    assert same(batches(loader), want) and not in_place(loader)  # cold: read into buffers
    remote.files.flush()  # type: ignore[attr-defined]
    assert same(batches(loader), want_next) and in_place(loader)  # warm: in place
    # Every entry trimmed away: the map keeps the files it maps, and reads them still.
    assert BlockCache(folder).trim(target=0.0) > 0 and BlockCache(folder).entries() == []
    s3.faults.clear()
    assert same(batches(loader), want_third) and s3.faults.count("/acts") == 0
    refill = ss.open(remote.location)
    refill[:]
    refill.files.flush()  # type: ignore[attr-defined]

    def never(fd: int, nbytes: int) -> str:
        raise AssertionError("a sealed entry was hashed again")

    monkeypatch.setattr(blockcache, "digest_of", never)
    for _, _, entry in BlockCache(folder).entries():
        entry.read_bytes()  # in the page cache (stored with O_DIRECT): every window is read in place
    warm = ss.open(remote.location)
    loader = ShuffledLoader(warm, **common)
    assert same(batches(loader), want) and in_place(loader)
    if warm.metadata.dtype != FLOAT8:  # (whose scales are read through the units)
        # Windows read in place ask the storage for none of their blocks: none opened, no fetch thread started.
        files: Any = warm.files
        acts = {u.key for shard in warm.manifest.shards for u in files.units(shard.name, 0, shard.nbytes)}
        assert not acts & set(files._held) and files._pool is None
    # Exact resume in place: a state taken after 2 batches continues as the local run does.
    loader = ShuffledLoader(ss.open(remote.location), **common)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    del it
    resumed = ShuffledLoader(ss.open(remote.location), **common)
    resumed.load_state_dict(state)
    assert same(batches(resumed), want[2:]) and in_place(resumed)


def test_remote_reads_go_through_the_block_cache(
    s3: S3, local: tuple[ss.Shards, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = fresh_block_cache(tmp_path, monkeypatch)
    remote = pushed(s3, local)
    s3.faults.clear()
    remote[:]
    remote.files.flush()  # type: ignore[attr-defined]  # units are written to the block cache in the background
    fetched = s3.faults.count("/acts")
    assert fetched == remote.n_shards  # one ranged request per unit (here: per whole file, protocol 3.0)
    again = ss.open(remote.location)  # a new reader (another process would do the same) reads the entries
    np.testing.assert_array_equal(again[:], local[1])
    assert s3.faults.count("/acts") == fetched
    cache = BlockCache(folder)
    assert cache.usage() >= sum(s.nbytes for s in local[0].manifest.shards)  # every shard, whole
    # An entry damaged on local disk is found on reuse, discarded and fetched again.
    entry = next(p for _, _, p in cache.entries() if p.stat().st_size == local[0].manifest.shards[0].nbytes)
    entry.chmod(0o644)
    data = bytearray(entry.read_bytes())
    data[3] ^= 0xFF
    entry.write_bytes(bytes(data))
    np.testing.assert_array_equal(ss.open(remote.location)[:], local[1])
    assert s3.faults.count("/acts") == fetched + 1


def test_block_cache_stays_within_its_limit(tmp_path: Path) -> None:
    cache = BlockCache(tmp_path / "bc", limit=10_000)
    blobs = {f"{i:032x}": bytes([i]) * 3000 for i in range(8)}
    for key, blob in blobs.items():
        fd = cache.insert(key, blob)
        assert fd is not None
        os.close(fd)
    assert cache.usage() <= 10_000
    newest = f"{7:032x}"
    assert cache.path(newest).exists()  # the least recently used went first


# --------------------------------------------------------------------------------------
# faults: a retry or a clear error, never wrong data


@pytest.mark.parametrize("local", [ss.PROTOCOL, WHOLE_FILE_PROTOCOL], indirect=True)
@pytest.mark.parametrize("kind", ["drop", "truncate", "slowdown", "error500", "short", "corrupt"])
def test_a_fault_while_reading_is_retried(
    s3: S3, local: tuple[ss.Shards, Any], kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    remote_url = pushed(s3, local).location
    fresh_block_cache(tmp_path, monkeypatch)
    remote = ss.open(remote_url)
    s3.faults.clear()
    s3.faults.add(kind, "acts000002.bin")
    np.testing.assert_array_equal(remote[10:15], local[1][10:15])
    assert s3.faults.fired == [(kind, s3.faults.fired[0][1])]
    assert s3.faults.count("acts000002.bin") == 2  # the fault, then one good answer
    # Transport faults are retried by the client, damaged bodies by the verification.
    assert remote.files.refetched == (1 if kind in ("short", "corrupt") else 0)  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["corrupt", "short", "slowdown"])
def test_a_fault_that_persists_is_a_clear_error(
    s3: S3, local: tuple[ss.Shards, Any], kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    remote_url = pushed(s3, local).location
    fresh_block_cache(tmp_path, monkeypatch)
    monkeypatch.setenv("SAEV_SHARDS_REMOTE_RETRIES", "1")
    monkeypatch.setattr("saev_shards.storage.units.VERIFY_BACKOFF", 0.01)
    remote = ss.open(remote_url)
    s3.faults.add(kind, "acts000002.bin", times=-1)
    expected: type[Exception] = ChecksumMismatchError if kind != "slowdown" else ss.errors.RemoteError
    # verify names the blocks of the cache's own blocks.json (one 16 MiB block per small file here)
    with pytest.raises(expected) as err:
        remote[12]
    assert "acts000002.bin" in str(err.value) and "\n" not in str(err.value)
    np.testing.assert_array_equal(remote[3], local[1][3])  # other files still read


def test_a_flipped_byte_in_a_remote_object_is_caught(s3: S3, local: tuple[ss.Shards, Any]) -> None:
    remote = pushed(s3, local)
    damaged = bytearray((local[0].path / "acts000001.bin").read_bytes())
    damaged[17] ^= 0x01
    Client(remote.location).put("acts000001.bin", bytes(damaged))  # the object itself, at rest
    reopened = ss.open(remote.location)
    np.testing.assert_array_equal(reopened[0:5], local[1][0:5])
    with pytest.raises(ChecksumMismatchError, match=r"acts000001\.bin.*does not match the manifest"):
        reopened[6]
    with pytest.raises(ChecksumMismatchError, match=r"acts000001\.bin: xxh3_128 expected"):
        reopened.verify()
    assert main(["verify", remote.location]) == 1


def test_http_server_with_range_requests(
    local: tuple[ss.Shards, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards, logical = local
    fresh_block_cache(tmp_path, monkeypatch)
    with range_server(shards.path.parent) as (base, faults):
        url = f"{base}/{shards.metadata.hash}"
        remote = ss.open(url)
        faults.add("corrupt", "acts000003.bin")
        faults.add("drop", "acts000001.bin")
        np.testing.assert_array_equal(remote[:], logical)
        assert {k for k, _ in faults.fired} == {"corrupt", "drop"}
        assert remote.verify() > 0
        with pytest.raises(CacheNotFoundError, match="no cache at http://"):
            ss.open(f"{base}/{'0' * 64}")


def test_reads_are_verified_per_block_where_the_manifest_has_block_digests(
    s3: S3, local: tuple[ss.Shards, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The per-block path of the storage (protocol 3.1's blocks.json), with 64-byte blocks:
    only the blocks a read touches are requested, and a damaged block is named."""
    import xxhash

    url = pushed(s3, local).location
    fresh_block_cache(tmp_path, monkeypatch)
    monkeypatch.setattr("saev_shards.storage.units.VERIFY_BACKOFF", 0.01)
    remote = ss.open(url)
    size = 64
    data = {name: (local[0].path / name).read_bytes() for name, _, _ in local[0].manifest.files()}
    digests = {
        name: [xxhash.xxh3_128_hexdigest(blob[i : i + size]) for i in range(0, len(blob), size)]
        for name, blob in data.items()
    }
    remote.files.use_blocks(size, digests.get)  # type: ignore[attr-defined]
    s3.faults.clear()
    np.testing.assert_array_equal(remote.read_vectors([7], [1], [2])[0], local[1][7, 1, 2])  # 16 bytes
    assert s3.faults.count("acts000001.bin") == 1  # one block of 64 bytes requested, not the file
    s3.faults.add("corrupt", "acts000001.bin")
    np.testing.assert_array_equal(remote[6], local[1][6])
    assert remote.files.refetched == 1  # type: ignore[attr-defined]
    damaged = bytearray(data["acts000003.bin"])
    damaged[200] ^= 0x10  # block 3 of that file (example 16: bytes 160-319)
    Client(url).put("acts000003.bin", bytes(damaged))
    np.testing.assert_array_equal(remote[15], local[1][15])  # bytes 0-159: blocks 0 to 2, intact
    with pytest.raises(ChecksumMismatchError, match=r"acts000003\.bin: block 3 \(bytes 192-255\) does not match"):
        remote[16]
    with pytest.raises(
        ChecksumMismatchError, match=r"acts000003\.bin: xxh3_128 expected .*; block 0 \(bytes 0-\d+\) differs"
    ):
        remote.verify()


# --------------------------------------------------------------------------------------
# push, pull, listing


def test_a_half_uploaded_cache_is_invisible_and_push_resumes(
    s3: S3, local: tuple[ss.Shards, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    shards, logical = local
    s3.faults.add("denied", "acts000003.bin", method="PUT")
    with pytest.raises(RemoteAccessDeniedError):
        store.push(shards.path, s3.root)
    url = f"{s3.root}/{shards.metadata.hash}"
    [entry] = store.list_remote(s3.root)
    assert not entry.published and entry.nbytes > 0
    with pytest.raises(CacheNotFoundError):
        ss.open(url)
    with pytest.raises(UnknownCacheError):
        store.resolve_remote(f"{s3.root}/{shards.metadata.hash[:8]}")
    assert main(["ls", s3.root]) == 0
    assert "unpublished (an upload in progress, or interrupted)" in capsys.readouterr().out
    s3.faults.clear()
    report = store.push(shards.path, s3.root)
    assert report.kept_files >= 1 and report.uploaded_files < len(shards.manifest.files())
    np.testing.assert_array_equal(ss.open(url)[:], logical)
    assert store.push(shards.path, s3.root).already_pushed
    puts = [p for m, p in s3.faults.requests if m == "PUT"]
    assert puts[-1].endswith("/shards.json")  # the commit point goes last


def test_a_killed_push_resumes(s3: S3, local: tuple[ss.Shards, Any]) -> None:
    shards, logical = local
    script = textwrap.dedent(
        f"""
        import os, signal
        from saev_shards import fileio, store
        count = [0]
        def hook(name, index):
            if name == "pushed-file":
                count[0] += 1
                if count[0] == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
        fileio.fault_hook = hook
        store.push({str(shards.path)!r}, {s3.root!r})
        """
    )
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ}, timeout=120, check=False)
    assert done.returncode == -9
    url = f"{s3.root}/{shards.metadata.hash}"
    with pytest.raises(CacheNotFoundError):
        ss.open(url)
    report = store.push(shards.path, s3.root)
    assert report.kept_files >= 2
    np.testing.assert_array_equal(ss.open(url)[:], logical)


def test_a_damaged_local_file_is_never_published(s3: S3, local: tuple[ss.Shards, Any]) -> None:
    shards, _ = local
    path = shards.path / "acts000002.bin"
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[0] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError, match=r"acts000002\.bin.*was not published"):
        store.push(shards.path, s3.root)
    assert "acts000002.bin" not in Client(f"{s3.root}/{shards.metadata.hash}").list_objects()


def test_cli_push_pull_ls_info_verify_resolve(
    s3: S3, local: tuple[ss.Shards, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shards, logical = local
    h = shards.metadata.hash
    assert main(["push", str(shards.path), s3.root]) == 0
    out = capsys.readouterr()
    assert out.out == f"{s3.root}/{h}\n" and "every digest matches" in out.err
    assert main(["ls", s3.root]) == 0
    assert h[:12] in capsys.readouterr().out
    assert main(["info", f"{s3.root}/{h[:6]}"]) == 0
    info = capsys.readouterr().out
    assert f"{s3.root}/{h}" in info and "every block checked against its digest" in info
    assert main(["verify", f"{s3.root}/{h}"]) == 0
    assert capsys.readouterr().out.startswith(f"ok {s3.root}/{h}")
    assert main(["resolve", h[:6], "--root", str(tmp_path / "none"), "--root", s3.root]) == 0
    assert capsys.readouterr().out == f"{s3.root}/{h}\n"
    dest = tmp_path / "pulled"
    assert main(["pull", f"{s3.root}/{h[:6]}", "--to", str(dest)]) == 0
    assert capsys.readouterr().out == f"{dest / h}\n"
    copy = ss.open(dest / h)
    np.testing.assert_array_equal(copy[:], logical)
    assert copy.verify() > 0 and copy.stats is not None
    assert main(["pull", f"{s3.root}/{h}", "--to", str(dest)]) == 0
    assert "already here" in capsys.readouterr().err


def test_rm_of_a_url_removes_the_remote_cache_manifest_first(
    s3: S3, local: tuple[ss.Shards, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rm s3://...` removes the remote cache (it was taken for a local path, "no such file"):
    listed with its size, asked, shards.json deleted first (protocol.md 6.1), then the rest."""
    shards, _ = local
    h = shards.metadata.hash
    pushed(s3, local)
    url = f"{s3.root}/{h}"
    assert main(["rm", f"{s3.root}/{h[:6]}", "--dry-run"]) == 0
    listed = capsys.readouterr().out
    assert listed.startswith("would remove 1 cache, ") and url in listed and "other machines are not seen" in listed
    assert Client(s3.root).list_objects(f"{h}/")  # nothing removed by a dry run
    deletes: list[str] = []
    real_delete = Client.delete

    def delete(client: Client, name: str) -> None:
        deletes.append(name)
        real_delete(client, name)

    monkeypatch.setattr(Client, "delete", delete)
    assert main(["rm", url, "--yes"]) == 0
    assert capsys.readouterr().out.endswith(f"removed {url}\n")
    assert deletes[0] == f"{h}/shards.json" and f"{h}/metadata.json" in deletes, deletes
    assert Client(s3.root).list_objects(f"{h}/") == {}
    assert shards.path.is_dir()  # the local cache of the same hash is untouched
    assert main(["rm", url, "--yes"]) == 3  # nothing left: not found
    assert "no cache at" in capsys.readouterr().err


def test_ls_above_a_shards_root_names_the_roots_below(
    s3: S3, local: tuple[ss.Shards, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    pushed(s3, local)
    bucket = s3.root.rsplit("/", 1)[0]  # s3://<bucket>, the folder above s3://<bucket>/shards
    assert main(["ls", bucket]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{bucket}: 0 caches") and f"saev-shards ls {s3.root}\n" in out, out


def test_statistics_computed_later_for_a_remote_cache_live_in_its_root(
    s3: S3, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "plain"
    root.mkdir()
    md = small_metadata()
    write_cache(root, md)  # no stats.json
    url = store.push(root / md.hash, s3.root).url
    assert ss.open(url).stats is None
    assert main(["stats", url]) == 0
    assert capsys.readouterr().out == f"{s3.root}/.stats/{md.hash}.json\n"
    stats = ss.open(url).stats  # a new reader finds the sidecar in the root and checks it
    assert stats is not None and stats["count"].tolist() == [23 * 5, 23 * 5]
    dest = tmp_path / "pulled"
    store.pull(url, dest)
    assert ss.open(dest / md.hash).stats is not None  # pull carries it, as stage does


def test_hash_prefixes_find_caches_in_remote_roots(
    s3: S3, local: tuple[ss.Shards, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards, logical = local
    pushed(s3, local)
    monkeypatch.setenv("SAEV_SHARDS_ROOT", f"{tmp_path / 'empty'}:{s3.root}")
    assert store.remote_roots() == [s3.root]
    opened = ss.open(shards.metadata.hash[:7])
    assert opened.url == f"{s3.root}/{shards.metadata.hash}"
    np.testing.assert_array_equal(opened[4], logical[4])


# --------------------------------------------------------------------------------------
# refusals: one line, one exit code each


@pytest.mark.parametrize(
    ("fault", "error", "code", "words"),
    [
        ("denied", RemoteAccessDeniedError, 4, "access denied"),
        ("region", RemoteRegionError, 1, "AWS_REGION"),
        ("nocreds", RemoteCredentialsError, 2, "credentials rejected"),
    ],
)
def test_refusals_have_one_line_and_their_own_exit_code(
    s3: S3,
    local: tuple[ss.Shards, Any],
    capsys: pytest.CaptureFixture[str],
    fault: str,
    error: type,
    code: int,
    words: str,
) -> None:
    remote = pushed(s3, local)
    s3.faults.add(fault, "metadata.json", times=-1)
    with pytest.raises(error):
        ss.open(remote.location)
    assert main(["info", remote.location]) == code
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_a_missing_bucket_and_missing_credentials(
    s3: S3, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(RemoteBucketError):
        ss.open(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/shards/{'a' * 64}")
    assert main(["ls", f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/shards"]) == 3
    assert "no such bucket" in capsys.readouterr().err
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("SAEV_SHARDS_REMOTE_RETRIES", "0")
    assert main(["ls", s3.root]) == 2
    err = capsys.readouterr().err
    assert "no credentials found" in err and err.count("\n") == 1


def test_without_the_remote_extra_one_clear_line(
    s3: S3, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "obstore", None)
    with pytest.raises(MissingDependencyError, match=r"needs obstore.*pip install .*\[remote\]"):
        ss.open(f"{s3.root}/{'a' * 64}")
    assert main(["ls", s3.root]) == 2
    assert "[remote]" in capsys.readouterr().err


# --------------------------------------------------------------------------------------
# one block cache, several processes

_READER = """
import sys, numpy as np, saev_shards as ss
remote = ss.open(sys.argv[1])
order = np.random.default_rng(int(sys.argv[2])).permutation(remote.n_examples)
out = np.stack([remote[int(e)] for e in order])
np.save(sys.argv[3], out[np.argsort(order)])
"""


def test_two_processes_share_one_block_cache(
    s3: S3, local: tuple[ss.Shards, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    remote = pushed(s3, local)
    folder = fresh_block_cache(tmp_path, monkeypatch)
    shard = local[0].manifest.shards[0].nbytes
    env = {**os.environ, "SAEV_SHARDS_BLOCK_CACHE": str(folder), "SAEV_SHARDS_BLOCK_CACHE_BYTES": str(3 * shard)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _READER, remote.location, str(seed), str(tmp_path / f"out{seed}.npy")], env=env
        )
        for seed in range(2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    for seed in range(2):
        np.testing.assert_array_equal(np.load(tmp_path / f"out{seed}.npy"), local[1])
    cache = BlockCache(folder, limit=3 * shard)
    assert cache.usage() <= 3 * shard + 2 * shard  # the limit, plus what each inserted since its last trim
    for _, size, path in cache.entries():  # every entry left is whole and verifies
        assert size in {s.nbytes for s in local[0].manifest.shards} | {n for _, n, _ in local[0].manifest.other_files()}
        assert path.parent.parent == folder / "blocks"
    assert not list((folder / "tmp").glob("*")) if (folder / "tmp").exists() else True


def test_the_push_pull_commands_run_as_written(s3: S3, local: tuple[ss.Shards, Any], tmp_path: Path) -> None:
    """docs/remote.md's "From a local cache to a bucket and back" block, run by bash against the
    test server (the install line is what built this environment; the AWS variables point at
    the server)."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "remote.md").read_text()
    block = page.split("## From a local cache to a bucket and back\n", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if not line.startswith(("pip install", "#"))]
    create_bucket(s3.server, "my-bucket")
    env = {
        **os.environ,
        "HASH": local[0].metadata.hash[:8],
        "SAEV_SHARDS_ROOT": str(local[0].path.parent),
        "TMPDIR": str(tmp_path),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", "\n".join(lines)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "(23, 2, 5, 8)" in done.stdout
    assert (tmp_path / "saev" / "shards" / local[0].metadata.hash).is_dir()
    # docs/remote.md's first block, as written but for the hash prefix (the cache is in my-bucket now)
    text = (Path(__file__).resolve().parents[2] / "docs" / "remote.md").read_text()
    source = text.split("```python\n", 1)[1].split("```", 1)[0].replace("/3f2a", "/" + local[0].metadata.hash[:6])
    namespace: dict[str, Any] = {}
    exec(compile(source, "docs/remote.md", "exec"), namespace)  # the docs' own code
    assert namespace["shards"].url == f"s3://my-bucket/saev/shards/{local[0].metadata.hash}"


def test_the_local_test_server_recipe_runs_as_written(local: tuple[ss.Shards, Any], tmp_path: Path) -> None:
    """docs/remote.md's moto recipe, run by bash as written (its own server, on a free port
    instead of 5000; the pip line is what built this environment): a bucket, a push, the
    listings, and `ls` above the root naming it."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "remote.md").read_text()
    block = text.split("## A test server on this machine (moto)\n", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    port = str(free_port())
    lines = [line.replace("5000", port) for line in block.splitlines() if not line.startswith("pip install")]
    h = local[0].metadata.hash
    script = "\n".join(lines).replace("3f2a", h[:8])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SAEV_"))}
    env.update(
        SAEV_SHARDS_ROOT=str(local[0].path.parent),
        SAEV_SHARDS_BLOCK_CACHE=str(tmp_path / "block-cache"),
        AWS_EC2_METADATA_DISABLED="true",
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    )
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert out.startswith(f"s3://my-bucket/shards/{h}\n"), out
    assert "s3://my-bucket/shards: 1 cache" in out and "(23, 2, 5, 8)" in out, out
    assert "s3://my-bucket: 0 caches" in out and "saev-shards ls s3://my-bucket/shards" in out, out
