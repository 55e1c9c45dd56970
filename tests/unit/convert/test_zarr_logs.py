"""convert.zarr_logs: zarr activation logs -> cache: every value, length, column and text, in every layout."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

import saev_shards as ss
from saev_shards.convert import SOURCES, Options, convert
from saev_shards.errors import ConvertOptionError

from ...support.sources import assert_converted, zarr_source

pytest.importorskip("zarr")


warnings.filterwarnings("ignore", message="Consolidated metadata")


def _convert(src: Path, root: Path, **kwargs: object) -> tuple[ss.Shards, object]:
    result = convert(src, root=root, durable=False, **kwargs)
    return ss.open(result.path), result


def test_zarr_store_prompt_then_response_in_one_cache(tmp_path: Path) -> None:
    expected = zarr_source(tmp_path / "run")
    for src in (tmp_path / "run", tmp_path / "run" / "activations.zarr"):  # the run folder or the store
        shards, result = _convert(src, tmp_path / f"root-{src.name}", patches_per_shard=2 * 10 * 3)
        assert_converted(shards, expected)
        md = shards.metadata
        assert md.ckpt == "Qwen/Qwen2.5-0.5B"
        assert md.data["source"]["config"] == {"T_chunk_prompt": 4, "R_max": 4}
        assert md.data["source"]["attrs"]["prompt_truncated_count"] == 0
        assert any("ONE cache" in line for line in result.plan.layout)  # type: ignore[attr-defined]
        # The response of example i starts at prompt_len[i]
        i = 3
        p, r = int(expected.columns["prompt_len"][i]), int(expected.columns["response_len"][i])
        assert shards.example(i, 0)[p : p + r].shape == (r, 8)


def test_zarr_sharded_layout_and_max_tokens(tmp_path: Path) -> None:
    expected = zarr_source(tmp_path / "run", n=9, shards=(4, 2, 3))
    shards, _ = _convert(tmp_path / "run", tmp_path / "root")
    assert_converted(shards, expected)
    assert shards.metadata.data["source"]["layout"] == "sharded"
    shards, result = _convert(tmp_path / "run", tmp_path / "cut", options=Options(max_tokens=5, layers=(7, 9)))
    assert shards.metadata.layers == (7, 9)
    np.testing.assert_array_equal(shards[:], expected.acts[:, :, :5].astype(np.float16))
    true = expected.columns["true_lengths"]
    np.testing.assert_array_equal(shards.columns["lengths"], np.minimum(true, 5))
    assert result.report.counts["samples longer than T=5 truncated"] == int((true > 5).sum())  # type: ignore[attr-defined]


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_zarr_single_activations_array_and_dirty_padding(tmp_path: Path, zarr_format: int) -> None:
    import zarr

    store = tmp_path / "log.zarr"
    g = zarr.open_group(store, mode="w", zarr_format=zarr_format)  # type: ignore[arg-type]
    acts = np.random.default_rng(0).standard_normal((5, 3, 4, 6)).astype(np.float16)
    a = g.create_array("activations", shape=acts.shape, chunks=(1, 1, 4, 6), dtype="float16", compressors=None)
    a[:] = acts  # padding positions are NOT zero: reported, and zeroed in the cache
    s = g.create_array("seq_len", shape=(5,), chunks=(5,), dtype="int64", compressors=None)
    s[:] = [4, 1, 2, 3, 4]
    shards, result = _convert(store, tmp_path / "root")
    want = acts.astype(np.float32).copy()
    for i, n in enumerate([4, 1, 2, 3, 4]):
        want[i, :, n:] = 0
    np.testing.assert_array_equal(shards[:], want.astype(np.float16))
    np.testing.assert_array_equal(shards.columns["seq_len"], [4, 1, 2, 3, 4])
    assert result.report.counts["samples with nonzero values in seq padding (dropped)"] == 3  # type: ignore[attr-defined]


def test_zarr_without_activations_is_refused(tmp_path: Path) -> None:
    import zarr

    g = zarr.open_group(tmp_path / "x.zarr", mode="w", zarr_format=2)
    g.create_array("other", shape=(3,), dtype="int32")
    assert not SOURCES["zarr"].load().detect(tmp_path / "x.zarr")
    with pytest.raises(ConvertOptionError, match="does not look like a zarr source"):
        convert(tmp_path / "x.zarr", kind="zarr", root=tmp_path / "root")
