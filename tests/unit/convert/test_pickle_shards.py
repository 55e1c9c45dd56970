"""convert.pickle_shards: pickle shards (pickle.gz activations) -> cache: every value, length, column and
text; checksums; unsafe pickles."""

from __future__ import annotations

import gzip
import pickle
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import saev_shards as ss
from saev_shards.convert import Options, convert, safe_pickle
from saev_shards.errors import (
    ConvertError,
    ConvertOptionError,
    SourceChecksumError,
    SourceNotFoundError,
    UnsafePickleError,
)

from ...support.sources import assert_converted, pickle_source, rewrite_index


def _convert(src: Path, root: Path, **kwargs: object) -> ss.Shards:
    result = convert(src, root=root, durable=False, **kwargs)
    return ss.open(result.path)


@pytest.mark.parametrize("compressed", [True, False])
@pytest.mark.parametrize("protocol", [2, 5])
def test_every_value_length_column_and_text(tmp_path: Path, compressed: bool, protocol: int) -> None:
    expected = pickle_source(tmp_path / "src", compressed=compressed, protocol=protocol)
    shards = _convert(tmp_path / "src", tmp_path / "root", kind=None, patches_per_shard=2 * 9 * 5)
    assert shards.n_shards == 3  # 12 examples, 5 per shard: the writer's shards, not the source's
    assert_converted(shards, expected)
    md = shards.metadata
    assert (md.family, md.ckpt, md.dataset) == ("qwen2", "Qwen/Qwen2.5-7B", "HuggingFaceFW/fineweb-edu")
    assert md.data["converted_from"] == {"kind": "pickle", "version": 1}
    assert md.data["source"]["extraction_config"]["max_seq_length"] == 9
    assert shards.stats is not None  # padding excluded by lengths
    assert int(shards.stats["count"][0]) == int(expected.columns["lengths"].sum())
    shards.verify()


def test_float32_and_bfloat16_outputs(tmp_path: Path) -> None:
    expected = pickle_source(tmp_path / "src")
    for dtype in ("float32", "bfloat16"):
        shards = _convert(tmp_path / "src", tmp_path / dtype, dtype=dtype)
        assert shards.dtype == dtype
        assert_converted(shards, expected, dtype)


def test_max_tokens_truncates_and_counts(tmp_path: Path) -> None:
    expected = pickle_source(tmp_path / "src")
    result = convert(tmp_path / "src", root=tmp_path / "root", options=Options(max_tokens=4), durable=False)
    shards = ss.open(result.path)
    assert shards.shape[2] == 4
    np.testing.assert_array_equal(shards[:], expected.acts[:, :, :4].astype(np.float16))
    true = expected.columns["true_lengths"]
    np.testing.assert_array_equal(shards.columns["lengths"], np.minimum(true, 4))
    np.testing.assert_array_equal(shards.columns["true_lengths"], true)
    counts = result.report.counts
    assert counts["examples longer than T=4 truncated"] == int((true > 4).sum())
    assert counts["token positions dropped by that truncation"] == int(np.maximum(true - 4, 0).sum())


def test_corrupted_checksum_is_refused_and_nothing_is_published(tmp_path: Path) -> None:
    pickle_source(tmp_path / "src")
    shard = tmp_path / "src" / "shard_0002.pkl.gz"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    root = tmp_path / "root"
    with pytest.raises(SourceChecksumError, match=r"shard_0002\.pkl\.gz: sha256 expected [0-9a-f]{64}, found"):
        convert(tmp_path / "src", root=root, durable=False)
    assert not [p for p in root.iterdir() if not p.name.startswith(".staging-")] if root.exists() else True


def test_wrong_size_and_missing_shard(tmp_path: Path) -> None:
    pickle_source(tmp_path / "src")
    rewrite_index(tmp_path / "src", lambda m: m["shards"][0].update(size_bytes=m["shards"][0]["size_bytes"] + 1))
    with pytest.raises(SourceChecksumError, match="size_bytes in the index"):
        convert(tmp_path / "src", root=tmp_path / "root", durable=False)
    pickle_source(tmp_path / "src2")
    (tmp_path / "src2" / "shard_0003.pkl.gz").unlink()
    with pytest.raises(SourceNotFoundError, match=r"shard_0003\.pkl\.gz: listed in the source's index but missing"):
        convert(tmp_path / "src2", root=tmp_path / "root", durable=False)


class _Exploit:
    """A payload whose unpickling would create a file: ``open(path, "w")``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.path), "w"))


def test_malicious_shard_through_convert(tmp_path: Path) -> None:
    pickle_source(tmp_path / "src", compressed=False, checksums=False)
    marker = tmp_path / "pwned"
    (tmp_path / "src" / "shard_0002.pkl").write_bytes(pickle.dumps({"layer_15": [_Exploit(marker)]}))
    rewrite_index(tmp_path / "src", lambda m: m["shards"][1].pop("size_bytes"))
    with pytest.raises(UnsafePickleError, match=r"shard_0002\.pkl: refusing to load"):
        convert(tmp_path / "src", root=tmp_path / "root", durable=False)
    assert not marker.exists()


def test_malformed_sources(tmp_path: Path) -> None:
    pickle_source(tmp_path / "src", per_shard=(3, 3))
    with pytest.raises(ConvertOptionError, match="pickle shards name their layers"):
        convert(tmp_path / "src", root=tmp_path / "root", options=Options(layers=(1, 2)), durable=False)
    rewrite_index(tmp_path / "src", lambda m: m["shards"][1].update(filename="../etc/passwd"))
    with pytest.raises(ConvertError, match="expected a file name inside"):
        convert(tmp_path / "src", root=tmp_path / "root", durable=False)
    rewrite_index(tmp_path / "src", lambda m: m["shards"][1].update(filename="shard_0002.pkl.gz", checksum="crc:00"))
    with pytest.raises(ConvertError, match="unknown checksum algorithm 'crc'"):
        convert(tmp_path / "src", root=tmp_path / "root", durable=False)
    # a shard whose second layer disagrees on sample_idx
    bad = tmp_path / "bad"
    pickle_source(bad, per_shard=(2,), checksums=False)
    shard = safe_pickle.load(gzip.decompress((bad / "shard_0001.pkl.gz").read_bytes()), bad)
    shard["layer_16"][1]["sample_idx"] = 99
    (bad / "shard_0001.pkl.gz").write_bytes(gzip.compress(pickle.dumps(shard)))
    rewrite_index(bad, lambda m: m["shards"][0].pop("size_bytes"))
    with pytest.raises(ConvertError, match=r"layer_16\[1\]: expected sample_idx 1007 as under layer_15, found 99"):
        convert(bad, root=tmp_path / "root", durable=False)


@settings(max_examples=15)
@given(
    per_shard=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    layers=st.lists(st.integers(-3, 40), min_size=1, max_size=3, unique=True),
    max_len=st.integers(1, 6),
    max_tokens=st.none() | st.integers(1, 6),
    budget_examples=st.integers(1, 5),
)
def test_any_layout_converts_exactly(
    per_shard: list[int], layers: list[int], max_len: int, max_tokens: int | None, budget_examples: int
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src, root = Path(tmp) / "src", Path(tmp) / "root"
        expected = pickle_source(src, per_shard=tuple(per_shard), layers=tuple(layers), d_model=3, max_len=max_len)
        tokens = max_tokens if max_tokens is not None else max_len
        result = convert(
            src,
            root=root,
            options=Options(max_tokens=max_tokens),
            patches_per_shard=budget_examples * tokens * len(layers),
            durable=False,
        )
        shards = ss.open(result.path)
        assert shards.metadata.layers == tuple(sorted(layers))
        order = [layers.index(v) for v in sorted(layers)]
        want = np.zeros((sum(per_shard), len(layers), tokens, 3), np.float32)
        keep = min(tokens, max_len)
        want[:, :, :keep] = expected.acts[:, order, :keep]
        np.testing.assert_array_equal(shards[:], want.astype(np.float16))
        true = expected.columns["true_lengths"]
        np.testing.assert_array_equal(shards.columns["lengths"], np.minimum(true, tokens))
        np.testing.assert_array_equal(shards.columns["sample_idx"], expected.columns["sample_idx"])
        assert list(shards.text("text_preview")) == expected.text["text_preview"]
