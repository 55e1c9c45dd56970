"""convert.pickle_records: a pickle shard's layer keys and records, checked."""

from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path

import numpy as np
import pytest

import saev_shards as ss
from saev_shards.convert import convert, safe_pickle
from saev_shards.errors import (
    ConvertError,
)

from ...support.sources import pickle_source, rewrite_index


def _convert(src: Path, root: Path, **kwargs: object) -> ss.Shards:
    result = convert(src, root=root, durable=False, **kwargs)
    return ss.open(result.path)


def _rewrite_shards(folder: Path, change: object) -> None:
    """Apply ``change(shard)`` to every shard of a pickle source (sizes and checksums dropped)."""
    for entry in json.loads((folder / "metadata.json").read_text())["shards"]:
        path = folder / entry["filename"]
        shard = safe_pickle.load(gzip.decompress(path.read_bytes()), path)
        change(shard)  # type: ignore[operator]
        path.write_bytes(gzip.compress(pickle.dumps(shard)))
    rewrite_index(folder, lambda m: [e.pop(k, None) for e in m["shards"] for k in ("size_bytes", "checksum")])


def test_two_keys_of_one_layer_are_refused(tmp_path: Path) -> None:
    """`layer_1` and `layer_01` in every shard: before the fix one silently replaced the other."""
    src = tmp_path / "src"
    pickle_source(src, per_shard=(2, 2), layers=(1, 2))
    _rewrite_shards(src, lambda shard: shard.update(layer_01=shard.pop("layer_2")))
    with pytest.raises(ConvertError, match=r"keys 'layer_1' and 'layer_01' name the same layer 1"):
        convert(src, root=tmp_path / "root", durable=False)
    assert not (tmp_path / "root").exists() or not any((tmp_path / "root").iterdir())


def test_layer_keys_of_thousands_of_digits(tmp_path: Path) -> None:
    """A key of 5,000 digits raised Python's own ValueError (int()'s 4,300-digit limit) before
    the fix; a number that long never fits 64 bits, while leading zeros name a small layer."""
    src = tmp_path / "src"
    pickle_source(src, per_shard=(2, 2), layers=(1, 2))
    _rewrite_shards(src, lambda shard: shard.update({"layer_" + "9" * 5000: shard.pop("layer_2")}))
    with pytest.raises(ConvertError, match=r"'layer_9999.*: the layer number does not fit 64 bits"):
        convert(src, root=tmp_path / "root", durable=False)
    again = tmp_path / "zeros"
    pickle_source(again, per_shard=(2, 2), layers=(1, 2))
    _rewrite_shards(again, lambda shard: shard.update({"layer_" + "0" * 5000 + "2": shard.pop("layer_2")}))
    assert _convert(again, tmp_path / "root2").metadata.layers == (1, 2)


@pytest.mark.parametrize("value", [1.5, np.float64(2.25), "7", True, 2**70], ids=repr)
def test_a_sample_idx_that_is_not_an_integer_is_refused(tmp_path: Path, value: object) -> None:
    """Before the fix a sample_idx of 1.5 was stored as 1."""
    src = tmp_path / "src"
    pickle_source(src, per_shard=(2,))

    def change(shard: dict[str, list[dict[str, object]]]) -> None:
        for records in shard.values():
            records[1]["sample_idx"] = value

    _rewrite_shards(src, change)
    with pytest.raises(ConvertError, match=r"layer_15\[1\]: expected 'sample_idx' as an integer of 64 bits"):
        convert(src, root=tmp_path / "root", durable=False)


def test_an_integral_float_sample_idx_is_taken_exactly(tmp_path: Path) -> None:
    src = tmp_path / "src"
    expected = pickle_source(src, per_shard=(3,))

    def change(shard: dict[str, list[dict[str, object]]]) -> None:
        for records in shard.values():
            for r in records:
                r["sample_idx"] = float(r["sample_idx"])  # type: ignore[arg-type]

    _rewrite_shards(src, change)
    shards = ss.open(convert(src, root=tmp_path / "root", durable=False).path)
    np.testing.assert_array_equal(shards.columns["sample_idx"], expected.columns["sample_idx"])
