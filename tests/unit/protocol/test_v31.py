"""Protocol 3.1's files (protocol.md 2.2, 2.10): the scale files of a float8_e4m3 cache and
blocks.json, as written, as checked by `open`, read by `Shards.block_digests` and used by
`verify` to name a damaged block; their hostile forms raise documented errors."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

import saev_shards as ss
from saev_shards.protocol import v31
from saev_shards.protocol.common import BLOCK_SIZE

from ...support.caches import float_input, logical_tensor, small_metadata, tree_bytes, writable_copy, write_cache

#: The smallest block size a reader accepts: small test caches span several blocks.
SMALL_BLOCK = 64 << 10


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(v31.DIALECT, "block_size", SMALL_BLOCK)
    return SMALL_BLOCK


def big_metadata(**changes: Any) -> ss.Metadata:
    """Three shards of 20,000 vectors of 4 dims: float8 shards and scale files of 80,000 bytes
    (the last 40,000), two 64 KiB blocks each."""
    fields: dict[str, Any] = dict(
        d_model=4, patches_per_ex=99, cls_token=True, layers=(3, 5), n_examples=250, patches_per_shard=200 * 100
    )
    fields.update(changes)
    return small_metadata(**fields)


@pytest.fixture(scope="module")
def cache8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A published float8_e4m3 cache with every kind of file."""
    root = tmp_path_factory.mktemp("cache8")
    md = small_metadata(dtype="float8_e4m3")
    lengths = (1 + np.arange(md.n_examples) % md.tokens_per_ex).astype("int32")
    write_cache(root, md, labels=True, text=True, lengths=lengths, stats=True)
    return root / md.hash


@pytest.fixture
def copy8(cache8: Path, tmp_path: Path) -> Path:
    return writable_copy(cache8, tmp_path)


def edit_manifest(path: Path, fn: Callable[[dict[str, Any]], Any]) -> None:
    """Change shards.json in place (``fn`` changes the parsed object; what it returns is ignored)."""
    obj = json.loads((path / "shards.json").read_text())
    fn(obj)
    (path / "shards.json").write_text(json.dumps(obj))


def rewrite_blocks(path: Path, fn: Callable[[dict[str, Any]], Any], *, relist: bool = True) -> None:
    """Change blocks.json; with ``relist``, shards.json's entry follows (size and digest), so
    the new content reaches the schema checks."""
    obj = json.loads((path / "blocks.json").read_text())
    fn(obj)
    data = json.dumps(obj).encode()
    (path / "blocks.json").write_bytes(data)
    if relist:

        def listed(m: dict[str, Any]) -> None:
            m["blocks"] = {"name": "blocks.json", "nbytes": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data)}

        edit_manifest(path, listed)


# -- as written ------------------------------------------------------------------------------


def test_blocks_are_the_digests_of_every_block_of_every_file(tmp_path: Path, small_blocks: int) -> None:
    md = big_metadata(dtype="float8_e4m3")
    lengths = (1 + np.arange(md.n_examples) % md.tokens_per_ex).astype("int32")
    write_cache(tmp_path, md, labels=True, text=True, lengths=lengths, stats=True, batches=[3, 7])
    shards = ss.open(tmp_path / md.hash)
    assert shards.block_size == small_blocks
    listed = shards.manifest.blocked_files()
    assert {n for n, _, _ in listed} == set(os.listdir(shards.path)) - {"metadata.json", "shards.json", "blocks.json"}
    several = 0
    for name, nbytes, _ in listed:
        data = (shards.path / name).read_bytes()
        want = [xxhash.xxh3_128_hexdigest(data[i : i + small_blocks]) for i in range(0, nbytes, small_blocks)]
        assert shards.block_digests(name) == want, name
        several += len(want) > 1
    assert several == 4  # the full shards and their scale files: two blocks each
    with pytest.raises(ss.NameNotFoundError, match=r"no listed file 'blocks\.json'"):
        shards.block_digests("blocks.json")
    blocks = json.loads((shards.path / "blocks.json").read_text())
    assert list(blocks) == ["block_size", "files"] and blocks["block_size"] == small_blocks
    assert shards.verify() == sum(n for _, n, _ in shards.manifest.files())


def test_the_writer_uses_16_mib_blocks_and_3_0_caches_have_none(tmp_path: Path) -> None:
    md = small_metadata()
    write_cache(tmp_path, md)
    assert ss.open(tmp_path / md.hash).block_size == BLOCK_SIZE == 16 << 20
    md30 = small_metadata(protocol="3.0")
    write_cache(tmp_path, md30)
    old = ss.open(tmp_path / md30.hash)
    assert old.block_size is None and old.block_digests("acts000000.bin") is None
    assert "blocks" not in json.loads((old.path / "shards.json").read_text())
    assert not (old.path / "blocks.json").exists()


def test_resume_writes_the_same_blocks(tmp_path: Path, small_blocks: int) -> None:
    """Sealed shards keep their block digests across a stop; a resumed write ends byte-identical."""
    md = big_metadata(dtype="float8_e4m3")
    write_cache(tmp_path / "clean", md, stats=True)
    clean = tree_bytes(tmp_path / "clean" / md.hash)
    source = float_input(md, logical_tensor(md))
    w = ss.ShardWriter(tmp_path / "resumed", md, stats=True, durable=False)
    w.write(source[:230])  # shards 0 and 1 sealed, shard 2 partly written
    w.abort()
    with ss.ShardWriter(tmp_path / "resumed", md, stats=True, durable=False, resume=True) as w:
        assert w.next_example == 200
        w.write(source[200:])
    assert tree_bytes(tmp_path / "resumed" / md.hash) == clean


# -- open ------------------------------------------------------------------------------------


def test_a_truncated_scale_file_is_caught_by_open(copy8: Path) -> None:
    path = copy8 / "scales000002.bin"
    data = path.read_bytes()
    path.write_bytes(data[:-1])
    with pytest.raises(ss.FileSizeError, match=rf"{path}: expected {len(data)} bytes, found {len(data) - 1}"):
        ss.open(copy8)
    path.write_bytes(data + b"\0")
    with pytest.raises(ss.FileSizeError, match=rf"{path}: expected {len(data)} bytes, found {len(data) + 1}"):
        ss.open(copy8)
    path.unlink()
    with pytest.raises(ss.CacheNotFoundError, match=rf"{path}: missing"):
        ss.open(copy8)


def test_a_scale_file_that_is_a_symlink_is_refused(copy8: Path) -> None:
    path = copy8 / "scales000001.bin"
    os.replace(path, copy8 / "elsewhere")
    os.symlink(copy8 / "elsewhere", path)
    with pytest.raises(ss.ManifestError, match="expected a regular file, found a symbolic link"):
        ss.open(copy8)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m.__setitem__("scales", None), r"scales: expected an array with one file entry per shard"),
        (lambda m: m["scales"].pop(), r"scales: expected 5 entries \(one per shard\), found 4"),
        (
            lambda m: m["scales"][1].__setitem__("name", "scales000009.bin"),
            r"scales\[1\]: expected name 'scales000001.bin'",
        ),
        (
            lambda m: m["scales"][1].__setitem__("name", "acts000001.bin"),
            r"scales\[1\]: expected name 'scales000001.bin'",
        ),
        (lambda m: m["scales"][4].__setitem__("nbytes", 1), r"scales000004.bin: expected nbytes=120, found 1"),
        (lambda m: m["scales"][0].__setitem__("xxh3_128", "x"), r"scales\[0\]\.xxh3_128: expected 32 lower-case hex"),
        (lambda m: m["scales"][0].__setitem__("extra", 1), r"scales\[0\]: unknown keys \['extra'\]"),
        (lambda m: m.pop("scales"), r"top level: missing keys \['scales'\]"),
        (lambda m: m.pop("blocks"), r"top level: missing keys \['blocks'\]"),
        (lambda m: m.__setitem__("blocks", None), r"blocks: expected an object, found null"),
        (lambda m: m["blocks"].__setitem__("name", "../blocks.json"), r"blocks\.name: expected name 'blocks\.json'"),
    ],
)
def test_hostile_scale_and_block_entries_are_manifest_errors(copy8: Path, change: Any, message: str) -> None:
    edit_manifest(copy8, change)
    with pytest.raises(ss.InvalidCacheError, match=message) as info:
        ss.open(copy8)
    assert any(p.kind is ss.ManifestError and re.search(message, p.message) for p in info.value.problems)


def test_scales_in_a_cache_of_another_dtype_are_refused(tmp_path: Path) -> None:
    md = small_metadata()
    write_cache(tmp_path, md)
    copy = writable_copy(tmp_path / md.hash, tmp_path / "copy")
    edit_manifest(copy, lambda m: m.__setitem__("scales", []))
    with pytest.raises(
        ss.ManifestError, match=r"scales: expected null \(dtype float16 has no scale files\), found \[\]"
    ):
        ss.open(copy)


def test_unlisted_scale_files_and_blocks_json_are_unexpected_in_3_1_only(copy8: Path, tmp_path: Path) -> None:
    (copy8 / "scales000007.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ss.UnexpectedFileError, match=r"scales000007\.bin: data file not listed in shards\.json"):
        ss.open(copy8)
    os.unlink(copy8 / "scales000007.bin")
    md30 = small_metadata(protocol="3.0")
    write_cache(tmp_path, md30)
    old = writable_copy(tmp_path / md30.hash, tmp_path / "old")
    (old / "blocks.json").write_text("{}")
    (old / "scales000000.bin").write_bytes(b"")
    ss.open(old)  # names 3.0 gives no meaning: other files, which a cache may hold


def test_a_blocks_json_larger_than_its_cap_is_refused_before_reading(copy8: Path) -> None:
    sizes = [n for _, n, _ in ss.open(copy8).manifest.blocked_files()]
    cap = ss.protocol.common.blocks_max_bytes(sizes)
    edit_manifest(copy8, lambda m: m["blocks"].__setitem__("nbytes", cap + 1))
    with pytest.raises(ss.ManifestError, match=rf"blocks\.nbytes: expected at most {cap:,} bytes"):
        ss.open(copy8)


# -- blocks.json: read on first use, checked ------------------------------------------------


def block_problem(path: Path) -> str:
    shards = ss.open(path)
    with pytest.raises(ss.ManifestError) as info:
        shards.block_digests("acts000000.bin")
    with pytest.raises(ss.InvalidCacheError) as verified:
        shards.verify()
    assert any(p.kind is ss.ManifestError for p in verified.value.problems)
    return str(info.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: b.__setitem__("block_size", 1000), r"block_size: expected a power of two in \[65536, 1073741824\]"),
        (lambda b: b.__setitem__("block_size", 32768), r"block_size: expected a power of two"),
        (lambda b: b.__setitem__("block_size", 2**31), r"block_size: expected a power of two"),
        (lambda b: b.__setitem__("block_size", True), r"block_size: expected a power of two .* found bool"),
        (lambda b: b.__setitem__("block_size", 16777216.0), r"block_size: expected a power of two .* found float"),
        (lambda b: b["files"].pop("scales000001.bin"), r"files: missing lists for \['scales000001\.bin'\]"),
        (lambda b: b["files"].__setitem__("acts000099.bin", []), r"lists for files shards\.json does not list"),
        (lambda b: b["files"].__setitem__("acts000000.bin", []), r"files\.acts000000\.bin: expected 1 digests"),
        (lambda b: b["files"]["labels.bin"].append("0" * 32), r"files\.labels\.bin: expected 1 digests"),
        (lambda b: b["files"].__setitem__("stats.json", ["X" * 32]), r"files\.stats\.json: expected 1 digests of 32"),
        (lambda b: b["files"].__setitem__("stats.json", [1]), r"files\.stats\.json: expected 1 digests of 32"),
        (lambda b: b.__setitem__("files", []), r"files: expected an object, found array"),
        (lambda b: b.pop("files"), r"top level: missing keys \['files'\]"),
        (lambda b: b.__setitem__("extra", 1), r"top level: unknown keys \['extra'\]"),
    ],
)
def test_hostile_blocks_json_is_a_manifest_error_when_read(copy8: Path, change: Any, message: str) -> None:
    rewrite_blocks(copy8, change)
    problem = block_problem(copy8)
    assert re.search(message, problem), problem


def test_blocks_json_must_be_what_shards_json_lists(copy8: Path) -> None:
    listed = json.loads((copy8 / "shards.json").read_text())["blocks"]
    data = (copy8 / "blocks.json").read_bytes()
    (copy8 / "blocks.json").write_bytes(data.replace(b'"labels.bin": ["', b'"labels.bin": ["0', 1)[: len(data)])
    shards = ss.open(copy8)  # the same size, other bytes: open cannot tell
    with pytest.raises(ss.ManifestError, match=rf"blocks.json: xxh3_128 expected {listed['xxh3_128']} \(shards.json\)"):
        shards.block_digests("labels.bin")
    with pytest.raises(ss.ChecksumMismatchError, match=r"blocks\.json: xxh3_128 expected"):
        shards.verify()


def test_blocks_json_that_is_not_json_is_a_manifest_error(copy8: Path) -> None:
    data = b'{"block_size": NaN, "files": {}}'
    (copy8 / "blocks.json").write_bytes(data)

    def listed(m: dict[str, Any]) -> None:
        m["blocks"] = {"name": "blocks.json", "nbytes": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data)}

    edit_manifest(copy8, listed)
    with pytest.raises(ss.ManifestError, match="not valid JSON"):
        ss.open(copy8).block_digests("labels.bin")


# -- verify names the damaged block ----------------------------------------------------------


@pytest.fixture
def big8(tmp_path: Path, small_blocks: int) -> Iterator[Path]:
    md = big_metadata(dtype="float8_e4m3")
    write_cache(tmp_path / "root", md, stats=True)
    yield writable_copy(tmp_path / "root" / md.hash, tmp_path / "copy")


def flip(path: Path, *positions: int) -> None:
    data = bytearray(path.read_bytes())
    for pos in positions:
        data[pos] ^= 0x10
    path.write_bytes(bytes(data))


def test_corruption_of_a_scale_file_is_caught_by_verify_naming_its_block(big8: Path) -> None:
    path = big8 / "scales000001.bin"
    size = path.stat().st_size
    assert size > SMALL_BLOCK
    flip(path, SMALL_BLOCK + 5)  # in block 1
    shards = ss.open(big8)  # same size: open cannot tell
    with pytest.raises(ss.ChecksumMismatchError) as info:
        shards.verify()
    [problem] = info.value.problems
    assert problem.message.startswith(f"{path}: xxh3_128 expected ")
    assert problem.message.endswith(f"; block 1 (bytes {SMALL_BLOCK}-{size - 1}) differs")


def test_verify_names_every_damaged_block_of_a_shard(big8: Path) -> None:
    path = big8 / "acts000000.bin"
    size = path.stat().st_size
    flip(path, 0, SMALL_BLOCK + 1)
    with pytest.raises(ss.ChecksumMismatchError) as info:
        ss.open(big8).verify()
    [problem] = info.value.problems
    assert problem.message.endswith(
        f"; blocks 0 (bytes 0-{SMALL_BLOCK - 1}), 1 (bytes {SMALL_BLOCK}-{size - 1}) differ"
    )


def test_a_damaged_blocks_json_is_named_and_the_data_still_checked(big8: Path) -> None:
    flip(big8 / "blocks.json", 40)
    flip(big8 / "acts000001.bin", 3)
    with pytest.raises(ss.InvalidCacheError) as info:
        ss.open(big8).verify()
    damaged = sorted(p.message.split(": ")[0] for p in info.value.problems)
    assert damaged == [str(big8 / "acts000001.bin"), str(big8 / "blocks.json")]
    assert all("block " not in p.message for p in info.value.problems)  # no trusted digests to name blocks by
