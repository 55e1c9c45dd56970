"""Committed caches every release must read exactly; protocol 2.1 compatibility both ways."""

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

from ..data.make_golden import (
    GOLDEN_LENGTHS,
    GOLDEN_PROMPTS,
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
