"""A catalogue of malformed caches: one test per error kind, and a fuzz test."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import saev_shards as ss

from ..support.caches import small_metadata, write_cache
from ..support.hostile import edit_json, writable


@pytest.fixture
def cache(root: Path) -> Path:
    md = small_metadata()
    write_cache(root, md, labels=True, lengths=None, text=True, stats=True)
    return writable(root / md.hash)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ss.CacheNotFoundError, match="no cache at") as info:
        ss.open(tmp_path / "nope")
    assert isinstance(info.value, FileNotFoundError)
    assert isinstance(info.value, ValueError)


def test_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ss.CacheNotFoundError, match="is not a directory"):
        ss.open(tmp_path / "file")


def test_missing_metadata(cache: Path) -> None:
    (cache / "metadata.json").unlink()
    with pytest.raises(ss.CacheNotFoundError, match=r"metadata\.json: missing"):
        ss.open(cache)


def test_metadata_not_json(cache: Path) -> None:
    (cache / "metadata.json").write_text("{nope")
    with pytest.raises(ss.MetadataFileError, match="not valid JSON"):
        ss.open(cache)


def test_metadata_nan_and_duplicates_rejected(cache: Path) -> None:
    (cache / "metadata.json").write_text('{"a": 1, "a": 2}')
    with pytest.raises(ss.MetadataFileError, match="duplicate key 'a'"):
        ss.open(cache)
    (cache / "metadata.json").write_text('{"a": NaN}')
    with pytest.raises(ss.MetadataFileError, match="NaN and Infinity are not JSON numbers"):
        ss.open(cache)


def test_metadata_keys_and_types(cache: Path) -> None:
    def damage(d: dict[str, Any]) -> dict[str, Any]:
        d["extra"] = True
        del d["ckpt"]
        d["d_model"] = "8"
        return d

    edit_json(cache / "metadata.json", damage)
    with pytest.raises(ss.MetadataFileError) as info:
        ss.open(cache)
    message = str(info.value)
    assert "missing keys ['ckpt']" in message
    assert "unknown keys ['extra']" in message
    assert "d_model: expected an integer, found string '8'" in message
    assert str(cache / "metadata.json") in message


def test_unknown_protocol_version(cache: Path) -> None:
    edit_json(cache / "metadata.json", lambda d: {**d, "protocol": "9.0"})
    refused = r"unsupported protocol version '9\.0'; this library reads '3\.2', '3\.1', '3\.0', '2\.1'"
    with pytest.raises(ss.ProtocolVersionError, match=refused):
        ss.open(cache)


def test_hash_mismatch(cache: Path) -> None:
    edit_json(cache / "metadata.json", lambda d: {**d, "ckpt": "other"})
    with pytest.raises(ss.HashMismatchError, match=r"directory name is not the hash of its metadata\.json"):
        ss.open(cache)
    renamed = cache.parent / "my-cache"
    cache.rename(renamed)
    with pytest.raises(ss.HashMismatchError, match="not a 64-digit hash"):
        ss.open(renamed)
    assert ss.open(renamed, check_hash=False).metadata.ckpt == "other"


def test_missing_manifest(cache: Path) -> None:
    (cache / "shards.json").unlink()
    with pytest.raises(ss.CacheNotFoundError, match=r"shards\.json: missing"):
        ss.open(cache)


def test_manifest_not_json(cache: Path) -> None:
    (cache / "shards.json").write_text("[")
    with pytest.raises(ss.ManifestError, match="not valid JSON"):
        ss.open(cache)


def test_manifest_wrong_structure(cache: Path) -> None:
    edit_json(cache / "shards.json", lambda d: d["shards"])  # a 2.1-style array in a 3.0 cache
    with pytest.raises(ss.ManifestError, match="top level: expected an object, found array"):
        ss.open(cache)


def test_manifest_bad_entries(cache: Path) -> None:
    def damage(d: dict[str, Any]) -> dict[str, Any]:
        d["shards"][0]["name"] = "../../etc/passwd"
        d["shards"][1]["n_examples"] = 4
        d["shards"][2]["xxh3_128"] = "zz"
        d["shards"][3]["nbytes"] = -1
        del d["shards"][4]["nbytes"]
        return d

    edit_json(cache / "shards.json", damage)
    with pytest.raises(ss.ManifestError) as info:
        ss.open(cache)
    message = str(info.value)
    assert "shards[2].xxh3_128: expected 32 lower-case hex digits" in message
    assert "shards[3].nbytes: expected an integer >= 0, found int -1" in message
    assert "shards[4]: missing keys ['nbytes']" in message


def test_manifest_names_and_counts(cache: Path) -> None:
    def damage(d: dict[str, Any]) -> dict[str, Any]:
        d["shards"][0]["name"] = "../../etc/passwd"
        d["shards"][1]["n_examples"] = 4
        return d

    edit_json(cache / "shards.json", damage)
    with pytest.raises(ss.InvalidCacheError) as info:
        ss.open(cache)
    message = str(info.value)
    assert (
        "expected name 'acts000000.bin', found '../../etc/passwd' (shard names are plain acts<06d>.bin, no paths)"
        in message
    )
    assert "acts000001.bin: expected n_examples=5, found 4" in message
    # acts000000.bin is no longer listed, so it is reported too.
    assert "acts000000.bin: data file not listed in shards.json" in message


def test_several_kinds_are_grouped(cache: Path) -> None:
    (cache / "acts000000.bin").unlink()
    os.truncate(cache / "acts000003.bin", 3)
    shutil.copy(cache / "acts000001.bin", cache / "acts000007.bin")
    with pytest.raises(ss.InvalidCacheError) as info:
        ss.open(cache)
    assert type(info.value) is ss.InvalidCacheError
    kinds = [p.kind for p in info.value.problems]
    assert kinds == [ss.CacheNotFoundError, ss.UnexpectedFileError, ss.FileSizeError]
    message = str(info.value)
    assert message.startswith(f"{cache}: 3 problems\n  missing (1):\n    - {cache / 'acts000000.bin'}: missing")
    assert "  unexpected file (1):" in message
    assert "  size (1):" in message


def test_problems_do_not_escape_as_other_errors(cache: Path) -> None:
    edit_json(cache / "shards.json", lambda d: {**d, "columns": [], "text": {"Bad": {}}, "stats": 3})
    with pytest.raises(ss.ManifestError) as info:
        ss.open(cache)
    message = str(info.value)
    assert "columns: expected an object, found array" in message
    assert "text: bad field name 'Bad'" in message
    assert "stats: expected an object, found int" in message


json_leaf = st.none() | st.booleans() | st.integers(-3, 2**40) | st.text(max_size=20) | st.floats(allow_nan=False)


json_value = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


def _set(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    obj[path[0]] = _set(obj[path[0]], path[1:], value)
    return obj


@pytest.fixture(scope="module")
def pristine() -> Any:
    with tempfile.TemporaryDirectory() as tmp:
        md = small_metadata()
        write_cache(Path(tmp), md, labels=True, text=True, stats=True)
        yield writable(Path(tmp) / md.hash)


@given(
    which=st.sampled_from(["metadata.json", "shards.json"]),
    choice=st.integers(0, 10_000),
    value=json_value,
    flip=st.none() | st.tuples(st.integers(0, 10_000), st.integers(1, 255)),
)
def test_fuzz_either_opens_or_raises_documented_errors(
    pristine: Path, which: str, choice: int, value: Any, flip: tuple[int, int] | None
) -> None:
    """Any damage to the JSON files: open() succeeds or raises a ShardsError, never anything else."""
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / pristine.name
        shutil.copytree(pristine, cache)
        path = cache / which
        if flip is None:
            obj = json.loads(path.read_text())
            paths = _paths(obj)
            obj = _set(obj, paths[choice % len(paths)], value)
            path.write_text(json.dumps(obj))
        else:
            data = bytearray(path.read_bytes())
            data[flip[0] % len(data)] ^= flip[1]
            path.write_bytes(bytes(data))
        try:
            shards = ss.open(cache)
        except ss.ShardsError:
            return
        assert shards.n_examples >= 0
