"""Committed caches every release must read exactly (protocol 3.0, 3.1 and 3.2); protocol 2.1
compatibility both ways; what a reader of 3.0 alone does with a 3.1 cache, and one of 3.1
alone with a 3.2 cache."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

import saev_shards as ss
from saev_shards.codecs import float8
from saev_shards.protocol import common as protocol_common
from saev_shards.protocol import versions

from ..data.make_golden import (
    GOLDEN_31,
    GOLDEN_LENGTHS,
    GOLDEN_PROMPTS,
    GOLDEN_SITES,
    SEED_KEYS,
    golden_labels,
    golden_metadata,
    golden_values,
    write_golden_3,
)
from ..support.caches import tree_bytes

DATA = Path(__file__).resolve().parents[1] / "data"
GOLDEN = DATA / "golden-3.0" / "6a3eb6d07f6e3ebcd423f2620ccc9e17d4f43c478399e257a6eb75866f2fbfca"
LEGACY_PADDED = DATA / "legacy-2.1-padded" / "fb84eba39764104ae9ba777948776a92b73ee6f3be6f93eb960d77c5c2633c17"
LEGACY_DIVISIBLE = DATA / "legacy-2.1-divisible" / "e33b9113e4e58f3c1d9c2148df565e64317b9cf2679fc0c86e6d3c5ee0728061"

# xxh3_128 of every committed file of the 3.0 golden cache: its exact bytes.
GOLDEN_DIGESTS = {
    "acts000000.bin": "148f331d391b056d2c84a6be348d91cf",
    "acts000001.bin": "635039b5ae48817c11ef12e90094b5e8",
    "acts000002.bin": "aac44c51da53c850f6f2bed9085bf0fb",
    "column.lengths.bin": "ee4042a237873ae8a176a80b50f8e36f",
    "labels.bin": "c1706b7907a117117990e4d0622ca366",
    "stats.json": "a5a4ba912c916faacdd213ecb60cd0e4",
    "text.prompt.jsonl": "96a95b57d990f2a4f6413b9a6e3d91d0",
    "metadata.json": "a751663e60e7557d2b4bdf6891286e8b",
    "shards.json": "d1ae545988c32ca9c1131cbaa3c21de0",
}


# The protocol 3.1 golden caches: the same data, in float16 and in float8_e4m3.
GOLDEN_31_PATHS = {
    "float16": DATA / "golden-3.1" / "14e089dbb546e43421bedc07de5316e104b609364ed0ec07c6b339075d0f553f",
    "float8_e4m3": DATA / "golden-3.1" / "a7640d62bd5d63f6b770c8e3081b26ebda4972b4329a729abb60e356584aa123",
}
GOLDEN_31_DIGESTS = {
    "float16": {
        # The data files are those of the 3.0 cache, byte for byte.
        **{k: v for k, v in GOLDEN_DIGESTS.items() if k not in ("metadata.json", "shards.json")},
        "blocks.json": "f10af1ff5dac70d3ec09fa2744cf5b4b",
        "metadata.json": "7c570761c8ab0322ae1bf7fa4b261d64",
        "shards.json": "76570a76060d3c103070cbd461ae9c34",
    },
    "float8_e4m3": {
        "acts000000.bin": "489ac29519d374fb3d0524195abf35fd",
        "acts000001.bin": "ba85184de45f98c391d945a0a0841275",
        "acts000002.bin": "acb0eeaf9871bf96db3da3ec20b72fef",
        "blocks.json": "2657bb84bfaf9699ab41d65dc20c10f5",
        "column.lengths.bin": "ee4042a237873ae8a176a80b50f8e36f",
        "labels.bin": "c1706b7907a117117990e4d0622ca366",
        "metadata.json": "042258da36db6641de8777afc3cecdf2",
        "scales000000.bin": "e2a06f040e7b3f1478f89928653cb2ca",
        "scales000001.bin": "d4fa10e54631f6f3dcb9433caba739ff",
        "scales000002.bin": "61dd5d56080add2cc212ef06f103d299",
        "shards.json": "984ee9af52bb081ba81d22c65214d53e",
        "stats.json": "b91b9fec7207abdae7c1ff5acb5a2fd2",
        "text.prompt.jsonl": "96a95b57d990f2a4f6413b9a6e3d91d0",
    },
}

# The protocol 3.2 golden cache: the 3.1 float16 cache's data, its slots an MLP's input and output.
GOLDEN_32 = DATA / "golden-3.2" / "8ed90f8d3d5705cc09f03d06eb87df20a5b3a54c43ab9eca61fccd2fb8ea90ba"
GOLDEN_32_DIGESTS = {
    # Every file but metadata.json is the 3.1 float16 cache's, byte for byte.
    **{k: v for k, v in GOLDEN_31_DIGESTS["float16"].items() if k != "metadata.json"},
    "metadata.json": "c2aa6521286b59863d7c47b8af9ab7dd",
}


def test_golden_bytes_are_pinned() -> None:
    for name, digest in GOLDEN_DIGESTS.items():
        assert xxhash.xxh3_128_hexdigest((GOLDEN / name).read_bytes()) == digest, name
    assert GOLDEN.name == golden_metadata().hash


def test_golden_reads_exactly() -> None:
    shards = ss.open(GOLDEN)
    md = golden_metadata()
    assert shards.metadata == md
    expected = golden_values(*md.shape).astype(np.float16)
    np.testing.assert_array_equal(shards[:], expected)
    assert shards.get(3, 2, 1).tolist() == [-53.0, 53.25, -53.5, 53.75]  # example 3, layer value 2 = index 1
    assert shards.locate(3, 2, 1) == (1, (1 * 2 * 3 + 1 * 3 + 1) * 4 * 2)
    assert shards.labels is not None
    np.testing.assert_array_equal(shards.labels, golden_labels(5, 2))
    assert shards.lengths is not None
    assert shards.lengths.tolist() == GOLDEN_LENGTHS
    assert list(shards.text("prompt")) == GOLDEN_PROMPTS
    stats = shards.stats
    assert stats is not None
    assert stats["count"].tolist() == [sum(GOLDEN_LENGTHS)] * 2
    listed = [n for n in GOLDEN_DIGESTS if n not in ("metadata.json", "shards.json")]
    assert shards.verify() == sum(os.path.getsize(GOLDEN / n) for n in listed)


def test_writer_still_writes_the_golden_bytes(tmp_path: Path) -> None:
    assert tree_bytes(write_golden_3(tmp_path)) == tree_bytes(GOLDEN)


def reference_read(path: Path) -> tuple[dict[str, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """What the saev reference reader does with a 2.1 cache: a strict Metadata(**dict), a strict
    Shard(**entry) per shards.json entry, and a memmap of every shard at full shard shape."""
    md = json.loads((path / "metadata.json").read_text())
    assert tuple(md) == SEED_KEYS or set(md) == set(SEED_KEYS)
    assert md["dtype"] == "float32"
    assert md["protocol"] == "2.1"
    entries = json.loads((path / "shards.json").read_text())
    assert all(set(e) == {"name", "n_examples"} for e in entries)
    n_layers, tokens = len(md["layers"]), md["patches_per_ex"] + int(md["cls_token"])
    eps = md["patches_per_shard"] // n_layers // tokens
    shape = (eps, n_layers, tokens, md["d_model"])
    parts = []
    for e in entries:
        acts = np.memmap(path / e["name"], mode="c", dtype=np.float32, shape=shape)
        parts.append(np.array(acts[: e["n_examples"]]))
    labels = np.memmap(path / "labels.bin", mode="r", dtype=np.uint8, shape=(md["n_examples"], md["patches_per_ex"]))
    return md, np.concatenate(parts), np.array(labels)


@pytest.mark.parametrize("path", [LEGACY_PADDED, LEGACY_DIVISIBLE])
def test_reads_reference_caches(path: Path) -> None:
    with pytest.warns(ss.ProtocolWarning, match=r"protocol 2\.1 cache"):
        shards = ss.open(path)
    md, values, labels = reference_read(path)
    assert shards.dtype == "float32"
    assert shards.metadata.data == md["data"]  # opaque base64 string: never unpickled
    np.testing.assert_array_equal(shards[:], values)
    np.testing.assert_array_equal(shards[:], golden_values(*shards.shape))
    assert shards.labels is not None
    np.testing.assert_array_equal(shards.labels, labels)
    with pytest.warns(UserWarning, match="no recorded checksum"):
        shards.verify()


def test_reference_reader_reads_our_float32_caches(tmp_path: Path) -> None:
    """Our protocol 2.1 caches (saev's code dialect) hold the same data bytes as the document
    dialect's reference caches, which still open with their own 64-digit names."""
    for n_examples, reference in ((5, LEGACY_PADDED),):
        fields = {**json.loads((reference / "metadata.json").read_text()), "layers": (3, 7)}
        spec = ss.Metadata(**fields, dialect="saev-spec")
        assert spec.hash == reference.name
        legacy = spec.replace(dialect="saev", pixel_agg="majority")
        assert len(legacy.hash) == 8
        values = golden_values(*legacy.shape)
        root = tmp_path / "saev" / "shards"
        with ss.ShardWriter(root, legacy, labels=True) as w:
            w.write(values, labels=golden_labels(n_examples, legacy.patches_per_ex))
        ours = root / legacy.hash
        saev_md = json.loads((ours / "metadata.json").read_text())
        assert saev_md["content_tokens_per_example"] == fields["patches_per_ex"]
        assert saev_md["max_tokens_per_shard"] == fields["patches_per_shard"]
        for name in ("acts000000.bin", "acts000001.bin", "acts000002.bin", "labels.bin"):
            assert (ours / name).read_bytes() == (reference / name).read_bytes(), name
        assert json.loads((ours / "shards.json").read_text()) == json.loads((reference / "shards.json").read_text())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ss.ProtocolWarning)
            shards = ss.open(ours)
        np.testing.assert_array_equal(shards[:], values)
        assert shards.manifest.shards[0].xxh3_128 is not None  # our checksums.json sidecar
        shards.verify()


# -- protocol 3.1 ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", GOLDEN_31)
def test_golden_31_bytes_are_pinned(dtype: str) -> None:
    path = GOLDEN_31_PATHS[dtype]
    assert sorted(p.name for p in path.iterdir()) == sorted(GOLDEN_31_DIGESTS[dtype])
    for name, digest in GOLDEN_31_DIGESTS[dtype].items():
        assert xxhash.xxh3_128_hexdigest((path / name).read_bytes()) == digest, name
    assert path.name == golden_metadata("3.1", dtype).hash


@pytest.mark.parametrize("dtype", GOLDEN_31)
def test_writer_still_writes_the_golden_31_bytes(tmp_path: Path, dtype: str) -> None:
    assert tree_bytes(write_golden_3(tmp_path, "3.1", dtype)) == tree_bytes(GOLDEN_31_PATHS[dtype])


def test_golden_31_float16_reads_exactly() -> None:
    shards = ss.open(GOLDEN_31_PATHS["float16"])
    md = shards.metadata
    assert (md.protocol, md.dialect, md.dtype) == ("3.1", "3.1", "float16")
    assert shards.manifest.scales is None
    np.testing.assert_array_equal(shards[:], golden_values(*md.shape).astype(np.float16))
    assert shards.block_size == 16 << 20
    for name, digest in GOLDEN_31_DIGESTS["float16"].items():
        if name not in ("metadata.json", "shards.json", "blocks.json"):
            assert shards.block_digests(name) == [digest]  # one block each: the whole file
    shards.verify()


def test_golden_31_float8_reads_by_the_rule() -> None:
    """The committed float8_e4m3 bytes are the rule of protocol.md 5 applied to the golden values,
    and every read path gives them back dequantized: values times their vector's scale."""
    shards = ss.open(GOLDEN_31_PATHS["float8_e4m3"])
    md = shards.metadata
    values = golden_values(*md.shape)
    assert shards.read_dtype == "float16"
    q, s = float8.quantize_numpy(values)
    assert shards.scales is not None
    np.testing.assert_array_equal(shards.raw[:].view(np.uint8), q.view(np.uint8))
    np.testing.assert_array_equal(shards.scales[:], s)
    # Each scale is max|x| / 448 of its vector, rounded to float32, at byte offset_in_vectors * 4.
    np.testing.assert_array_equal(s, (np.abs(values).max(axis=-1) / np.float32(448)).astype(np.float32))
    for k in range(shards.n_shards):
        file = np.fromfile(shards.scale_path(k), dtype="<f4")
        np.testing.assert_array_equal(file, s[k * 2 : k * 2 + 2].reshape(-1))
    wide = q.astype(np.float32) * s[..., None]
    np.testing.assert_array_equal(shards.with_dtype("float32")[:], wide)
    np.testing.assert_array_equal(shards[:], wide.astype(np.float16))
    assert (np.abs(wide - values) <= float8.error_bound(values, s)).all()
    assert shards.get(3, 2, 1, dtype="float32").tolist() == wide[3, 1, 1].tolist()
    assert shards.labels is not None and shards.lengths is not None
    assert shards.lengths.tolist() == GOLDEN_LENGTHS
    stats = shards.stats
    assert stats is not None  # of the dequantized values, padding excluded
    valid = np.arange(md.tokens_per_ex)[None, :] < np.array(GOLDEN_LENGTHS)[:, None]
    for li in range(md.n_layers):
        np.testing.assert_allclose(stats["mean"][li], wide[:, li][valid].astype(np.float64).mean(axis=0), rtol=1e-6)
    listed = [n for n in GOLDEN_31_DIGESTS["float8_e4m3"] if n not in ("metadata.json", "shards.json")]
    assert shards.verify() == sum(os.path.getsize(GOLDEN_31_PATHS["float8_e4m3"] / n) for n in listed)


def test_golden_30_is_still_read_and_written_as_30() -> None:
    """3.0 stays a version this library reads and writes byte-identically (the 3.0 tests above),
    with no blocks and no scales."""
    shards = ss.open(GOLDEN)
    assert (shards.metadata.protocol, shards.block_size, shards.manifest.blocks) == ("3.0", None, None)
    assert shards.block_digests("acts000000.bin") is None
    assert golden_metadata().protocol == "3.0" and ss.PROTOCOL == "3.1"


@pytest.mark.parametrize("dtype", GOLDEN_31)
def test_a_reader_of_3_0_alone_refuses_3_1_by_its_version(monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    """This library with 3.1 taken out of its version table, as the releases before 3.1 were:
    the 3.1 caches are refused by their version, never read."""
    only_30 = ("3.0", *protocol_common.SAEV_CODE_PROTOCOLS)
    monkeypatch.setattr(versions, "SUPPORTED_PROTOCOLS", only_30)
    with pytest.raises(
        ss.ProtocolVersionError, match=r"unsupported protocol version '3\.1'; this library reads '3\.0'"
    ):
        ss.open(GOLDEN_31_PATHS[dtype])
    assert json.loads((GOLDEN_31_PATHS[dtype] / "metadata.json").read_text())["protocol"] == "3.1"
    ss.open(GOLDEN)  # 3.0 still opens


# -- protocol 3.2 ---------------------------------------------------------------------------


def test_golden_32_bytes_are_pinned() -> None:
    assert sorted(p.name for p in GOLDEN_32.iterdir()) == sorted(GOLDEN_32_DIGESTS)
    for name, digest in GOLDEN_32_DIGESTS.items():
        assert xxhash.xxh3_128_hexdigest((GOLDEN_32 / name).read_bytes()) == digest, name
    assert GOLDEN_32.name == golden_metadata("3.2", "float16", GOLDEN_SITES).hash


def test_writer_still_writes_the_golden_32_bytes(tmp_path: Path) -> None:
    assert tree_bytes(write_golden_3(tmp_path, "3.2", "float16", GOLDEN_SITES)) == tree_bytes(GOLDEN_32)


def test_golden_32_reads_its_sites() -> None:
    shards = ss.open(GOLDEN_32)
    md = shards.metadata
    assert (md.protocol, md.dialect, md.layers) == ("3.2", "3.2", (9, 2))
    assert md.sites == (ss.Site("blocks.1.mlp", "input"), ss.Site("blocks.1.mlp", "output"))
    assert json.loads((GOLDEN_32 / "metadata.json").read_text())["sites"] == [
        {"io": "input", "module": "blocks.1.mlp"},
        {"io": "output", "module": "blocks.1.mlp"},
    ]
    assert md.site_layer("blocks.1.mlp:output") == 2 and md.describe_layer(9) == "blocks.1.mlp (input)"
    np.testing.assert_array_equal(shards[:], golden_values(*md.shape).astype(np.float16))
    shards.verify()


def test_caches_without_sites_are_written_as_before() -> None:
    """Sites are why 3.2 exists: a configuration without them is still 3.1 by default, with the
    same hash and bytes as before 3.2, and 3.2 is written only where a cache has sites."""
    assert ss.PROTOCOL == "3.1"
    assert golden_metadata("3.1").hash == GOLDEN_31_PATHS["float16"].name
    assert golden_metadata("3.1", sites=GOLDEN_SITES).protocol == "3.2"  # picked for the sites
    assert golden_metadata("3.2").sites is None  # 3.2 without sites: valid, not written by default


def test_a_reader_of_3_1_alone_refuses_3_2_by_its_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """This library with 3.2 taken out of its version table, as the releases before 3.2 were:
    the 3.2 cache is refused by its version, never read as block outputs."""
    older = ("3.1", "3.0", *protocol_common.SAEV_CODE_PROTOCOLS)
    monkeypatch.setattr(versions, "SUPPORTED_PROTOCOLS", older)
    refused = r"unsupported protocol version '3\.2'; this library reads '3\.1'"
    with pytest.raises(ss.ProtocolVersionError, match=refused):
        ss.open(GOLDEN_32)
    ss.open(GOLDEN_31_PATHS["float16"])  # 3.1 still opens


@pytest.mark.parametrize(
    "sites",
    [
        [{"io": "input", "module": "blocks.1.mlp"}],
        [{"io": "input", "module": "blocks.1.mlp"}, {"io": "input", "module": "blocks.1.mlp"}],
        [{"io": "sideways", "module": "blocks.1.mlp"}, {"io": "output", "module": "blocks.1.mlp"}],
        "blocks.1.mlp:input",
        [None, 3],
    ],
)
def test_a_cache_with_bad_sites_is_refused_naming_them(tmp_path: Path, sites: Any) -> None:
    copy = tmp_path / GOLDEN_32.name
    copy.mkdir()
    for f in GOLDEN_32.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    md = json.loads((copy / "metadata.json").read_text())
    (copy / "metadata.json").write_text(json.dumps({**md, "sites": sites}))
    with pytest.raises(ss.MetadataFileError, match=r"metadata\.json.*sites"):
        ss.open(copy, check_hash=False)
