"""Protocol 2.1 as saev's own code writes it (protocol.md section 9): its caches read, and written byte for byte.

The golden caches under tests/data/saev-code-* were written by saev's ``ShardWriter``
(commit 3d73f1f); every later release must read them exactly. The expected bytes here are
computed independently of the library, from the facts of saev's code: metadata.json is
``orjson.dumps(fields, option=OPT_INDENT_2)`` of 13 keys in field order, the name the first
8 hex digits of the sha256 of the compact orjson of the same fields.
"""

from __future__ import annotations

import hashlib
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

import saev_shards as ss
from saev_shards import store
from saev_shards.errors import HashMismatchError, InvalidCacheError, MetadataError

from ...support.caches import tree_bytes

DATA = Path(__file__).resolve().parents[2] / "data"
PARTIAL = DATA / "saev-code-partial" / "saev" / "shards" / "e2f8cd3a"
EXACT = DATA / "saev-code-exact" / "saev" / "shards" / "3a3c1749"
SAEV_KEYS = (
    "family", "ckpt", "layers", "content_tokens_per_example", "cls_token", "d_model",
    "n_examples", "max_tokens_per_shard", "data", "dataset", "pixel_agg", "dtype", "protocol",
)  # fmt: skip


def saev_name(fields: dict[str, Any], digits: int = 8) -> str:
    """The directory name saev's code gives a cache: computed here, not by the library."""
    assert tuple(fields) == SAEV_KEYS
    return hashlib.sha256(orjson.dumps(fields)).hexdigest()[:digits]


def saev_fields(**over: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "family": "dinov2",
        "ckpt": "dinov2_vitb14/réseau",
        "layers": [-2, 5],
        "content_tokens_per_example": 3,
        "cls_token": True,
        "d_model": 4,
        "n_examples": 7,
        "max_tokens_per_shard": 24,  # 2 layers x 4 tokens: 3 examples per shard
        "data": "gASVCAAAAAAAAAB9lC4=",
        "dataset": "/data/images",
        "pixel_agg": "prefer-fg",
        "dtype": "float32",
        "protocol": "2.1",
    }
    fields.update(over)
    return fields


def metadata_of(fields: dict[str, Any]) -> ss.Metadata:
    """Our `Metadata` for saev's fields (its two renamed keys)."""
    ours = {k: v for k, v in fields.items() if k not in ("content_tokens_per_example", "max_tokens_per_shard")}
    ours["layers"] = tuple(fields["layers"])
    return ss.Metadata(
        **ours, patches_per_ex=fields["content_tokens_per_example"], patches_per_shard=fields["max_tokens_per_shard"]
    )


def build_saev_cache(root: Path, fields: dict[str, Any], acts: np.ndarray[Any, Any], labels: Any = None) -> Path:
    """A cache laid out as saev's writer lays one out, from its facts alone: every shard file
    full size (the last zero-padded), one more all-zero file listed with 0 examples when the
    examples fill the last shard exactly, labels.bin uint8 (N, P)."""
    folder = root / saev_name(fields)
    folder.mkdir(parents=True)
    n, n_layers, tokens, d_model = acts.shape
    eps = fields["max_tokens_per_shard"] // (n_layers * tokens)
    full = eps * n_layers * tokens * d_model * 4
    entries = []
    for k, start in enumerate(range(0, n, eps)):
        data = np.ascontiguousarray(acts[start : start + eps], dtype="<f4").tobytes()
        (folder / f"acts{k:06d}.bin").write_bytes(data + bytes(full - len(data)))
        entries.append({"name": f"acts{k:06d}.bin", "n_examples": min(eps, n - start)})
    if n % eps == 0:
        (folder / f"acts{len(entries):06d}.bin").write_bytes(bytes(full))
        entries.append({"name": f"acts{len(entries):06d}.bin", "n_examples": 0})
    (folder / "metadata.json").write_bytes(orjson.dumps(fields, option=orjson.OPT_INDENT_2))
    (folder / "shards.json").write_bytes(orjson.dumps(entries, option=orjson.OPT_INDENT_2))
    if labels is not None:
        (folder / "labels.bin").write_bytes(np.ascontiguousarray(labels, dtype=np.uint8).tobytes())
    return folder


def open_quiet(path: Path) -> ss.Shards:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ss.ProtocolWarning)
        return ss.open(path)


def test_the_protocol_warning_is_one_short_line_once_per_cache_per_process() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            ss.open(EXACT)
            ss.open(PARTIAL)
    messages = [str(w.message) for w in caught if issubclass(w.category, ss.ProtocolWarning)]
    assert sorted(messages) == sorted(
        f"{p.name}: protocol 2.1 cache (saev dialect), read by protocol.md section 9 (no checksums unless "
        "checksums.json)"
        for p in (EXACT, PARTIAL)
    )
    assert all(len(m) < 120 and "\n" not in m for m in messages)


@pytest.mark.parametrize("path", [PARTIAL, EXACT])
def test_golden_saev_caches_read_exactly(path: Path) -> None:
    fields = orjson.loads((path / "metadata.json").read_bytes())
    assert tuple(fields) == SAEV_KEYS
    assert path.name == saev_name(fields)
    warned = r"^[0-9a-f]{8}: protocol 2\.1 cache \(saev dialect\), read by protocol\.md section 9"
    with pytest.warns(ss.ProtocolWarning, match=warned):
        shards = ss.open(path)
    md = shards.metadata
    assert md == metadata_of(fields)
    assert (md.dialect, md.pixel_agg, md.hash) == ("saev", fields["pixel_agg"], path.name)
    assert md.to_bytes() == (path / "metadata.json").read_bytes()
    assert md.data == fields["data"]  # base64 of a pickle: never decoded
    expected = np.load(path.parents[2] / "expected.npz")
    np.testing.assert_array_equal(shards[:], expected["acts"])
    for e in range(len(shards)):
        for i, layer in enumerate(md.layers):
            np.testing.assert_array_equal(shards.example(e, layer), expected["acts"][e, i])
    if "labels" in expected:
        assert shards.labels is not None
        np.testing.assert_array_equal(shards.labels, expected["labels"])
    else:
        assert shards.labels is None
    with pytest.warns(UserWarning, match="no recorded checksum"):
        shards.verify()


def test_golden_exact_cache_lists_the_trailing_empty_shard() -> None:
    shards = open_quiet(EXACT)
    assert shards.n_shards == 3
    assert [e.name for e in shards.manifest.empty_shards] == ["acts000003.bin"]
    assert (EXACT / "acts000003.bin").read_bytes() == bytes(shards.metadata.examples_per_shard * 4 * 4 * 8)


@pytest.mark.parametrize("path", [PARTIAL, EXACT])
def test_writer_writes_what_saev_wrote(tmp_path: Path, path: Path) -> None:
    """The fixtures' configurations and arrays, written by us: every file of saev's, byte for
    byte, and our checksums.json sidecar beside them (saev opens files by name only)."""
    md = metadata_of(orjson.loads((path / "metadata.json").read_bytes()))
    expected = np.load(path.parents[2] / "expected.npz")
    root = tmp_path / "saev" / "shards"
    labels = "labels" in expected
    with ss.ShardWriter(root, md, labels=labels) as w:
        w.write(expected["acts"], labels=expected["labels"] if labels else None)
    ours = tree_bytes(root / path.name)
    assert set(ours) == {*tree_bytes(path), "checksums.json"}
    assert {k: v for k, v in ours.items() if k != "checksums.json"} == tree_bytes(path)
    shards = open_quiet(root / path.name)
    assert shards.verify() > 0  # every file, the empty shard too, has a digest


@pytest.mark.parametrize("n_examples", [7, 6, 0])  # a partial last shard; an exact fill; empty
def test_caches_built_from_the_facts_read_every_value(tmp_path: Path, n_examples: int) -> None:
    fields = saev_fields(n_examples=n_examples)
    rng = np.random.default_rng(n_examples)
    acts = rng.standard_normal((n_examples, 2, 4, 4)).astype(np.float32)
    labels = rng.integers(0, 256, (n_examples, 3), dtype=np.uint8)
    has_labels = n_examples > 0  # saev cannot memmap an empty labels.bin; we write none
    folder = build_saev_cache(tmp_path / "saev" / "shards", fields, acts, labels if has_labels else None)
    shards = open_quiet(folder)
    md = shards.metadata
    assert md.layers == (-2, 5)
    assert md.ckpt == "dinov2_vitb14/réseau"
    assert (md.patches_per_ex, md.patches_per_shard, md.pixel_agg) == (3, 24, "prefer-fg")
    assert shards.shape == (n_examples, 2, 4, 4)
    np.testing.assert_array_equal(shards[:], acts)
    for e in range(n_examples):
        np.testing.assert_array_equal(shards.example(e, -2), acts[e, 0])
        np.testing.assert_array_equal(shards.example(e, 5), acts[e, 1])
    if has_labels:
        assert shards.labels is not None
        np.testing.assert_array_equal(shards.labels, labels)
    # What we write for the same configuration is what saev wrote, name and bytes.
    root = tmp_path / "ours" / "saev" / "shards"
    with ss.ShardWriter(root, md, labels=has_labels) as w:
        w.write(acts, labels=labels if has_labels else None)
    ours = tree_bytes(root / folder.name)
    assert ours.pop("checksums.json")
    assert ours == tree_bytes(folder)


def test_written_metadata_and_name_match_the_formula(tmp_path: Path) -> None:
    fields = saev_fields()
    md = metadata_of(fields)
    assert md.hash == saev_name(fields)
    assert md.to_bytes() == orjson.dumps(fields, option=orjson.OPT_INDENT_2)
    assert "réseau".encode() in md.to_bytes()  # raw UTF-8, not \\u escapes
    root = tmp_path / "saev" / "shards"
    with ss.ShardWriter(root, md) as w:
        w.write(np.zeros(md.shape, np.float32))
    assert (root / saev_name(fields) / "metadata.json").read_bytes() == orjson.dumps(fields, option=orjson.OPT_INDENT_2)


def test_protocol_2_1_defaults_to_saev_code() -> None:
    fields = saev_fields()
    del fields["pixel_agg"]
    md = metadata_of({**fields, "pixel_agg": "majority"})
    plain = ss.Metadata(
        family="dinov2",
        ckpt=fields["ckpt"],
        layers=(-2, 5),
        patches_per_ex=3,
        cls_token=True,
        d_model=4,
        n_examples=7,
        patches_per_shard=24,
        data=fields["data"],
        dataset="/data/images",
        dtype="float32",
        protocol="2.1",
    )
    assert (plain.dialect, plain.pixel_agg) == ("saev", "majority")
    assert plain == md


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"family": "vit-x"}, "family: saev reads only"),
        ({"data": {"name": "x"}}, "data: expected a string"),
        ({"dtype": "float16"}, "dtype: expected one of"),
        ({"pixel_agg": "mean"}, "pixel_agg: expected one of"),
        ({"dataset": "/data//images/"}, "dataset: saev stores a path"),
    ],
)
def test_what_saev_would_reject_is_refused(tmp_path: Path, change: dict[str, Any], match: str) -> None:
    with pytest.raises(MetadataError, match=match):
        md = metadata_of(saev_fields(**change))
        ss.ShardWriter(tmp_path / "saev" / "shards", md)


def test_a_root_saev_does_not_look_in_is_warned(tmp_path: Path) -> None:
    md = metadata_of(saev_fields())
    with pytest.warns(ss.ProtocolWarning, match=r"ending in saev/shards"):
        w = ss.ShardWriter(tmp_path / "elsewhere", md)
    w.abort()


def test_renamed_or_edited_saev_caches_are_errors(tmp_path: Path) -> None:
    renamed = tmp_path / "saev" / "shards" / "e2f8cd3b"
    shutil.copytree(PARTIAL, renamed)
    with pytest.raises(HashMismatchError, match="e2f8cd3b"), warnings.catch_warnings():
        warnings.simplefilter("ignore", ss.ProtocolWarning)
        ss.open(renamed)
    edited = tmp_path / "edited" / PARTIAL.name
    shutil.copytree(PARTIAL, edited)
    md_path = edited / "metadata.json"
    md_path.chmod(0o644)
    md_path.write_bytes(md_path.read_bytes().replace(b'"majority"', b'"prefer-fg"'))
    with pytest.raises(HashMismatchError), warnings.catch_warnings():
        warnings.simplefilter("ignore", ss.ProtocolWarning)
        ss.open(edited)
    extra = tmp_path / "extra" / PARTIAL.name
    shutil.copytree(PARTIAL, extra)
    (extra / "metadata.json").chmod(0o644)
    (extra / "metadata.json").write_bytes(md_path.read_bytes()[:-2] + b',\n  "note": 1\n}')
    with pytest.raises(InvalidCacheError, match="unknown keys"), warnings.catch_warnings():
        warnings.simplefilter("ignore", ss.ProtocolWarning)
        ss.open(extra)


def test_older_64_digit_names_read(tmp_path: Path) -> None:
    fields = saev_fields()
    acts = np.arange(7 * 2 * 4 * 4, dtype=np.float32).reshape(7, 2, 4, 4)
    folder = build_saev_cache(tmp_path / "saev" / "shards", fields, acts)
    long = folder.with_name(saev_name(fields, 64))
    folder.rename(long)
    shards = open_quiet(long)
    assert (shards.metadata.dialect, shards.metadata.hash) == ("saev-64", long.name)
    np.testing.assert_array_equal(shards[:], acts)


def test_store_resolves_8_digit_names_by_prefix(tmp_path: Path) -> None:
    root = tmp_path / "saev" / "shards"
    root.mkdir(parents=True)
    shutil.copytree(PARTIAL, root / PARTIAL.name)
    shutil.copytree(EXACT, root / EXACT.name)
    assert store.resolve("e2f8", roots=root) == root / PARTIAL.name
    assert store.resolve(EXACT.name, roots=root) == root / EXACT.name
    assert [c.path.name for c in store.list_caches(root)] == sorted([PARTIAL.name, EXACT.name])


def test_replace_of_the_protocol_takes_its_default_dialect() -> None:
    md = metadata_of(saev_fields())
    v3 = md.replace(protocol="3.0", data={"name": "x"})
    assert (v3.dialect, v3.pixel_agg, len(v3.hash)) == ("3.0", None, 64)
    back = v3.replace(protocol="2.1", data=md.data, pixel_agg="prefer-fg")
    assert back == md and back.hash == md.hash
