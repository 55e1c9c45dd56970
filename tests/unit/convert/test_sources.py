"""Zarr activation logs, SAELens caches and .npy -> cache: every value, length, column and text; detection."""

from __future__ import annotations

import dataclasses
import inspect
import json
import warnings
from pathlib import Path

import numpy as np
import pytest

import saev_shards as ss
from saev_shards.convert import SOURCES, ConvertOptions, Options, convert, detect, run
from saev_shards.convert.saelens import layer_of
from saev_shards.errors import ConvertError, ConvertOptionError

from ...support.sources import assert_converted, npy_source, pickle_source, saelens_source, zarr_source

pytest.importorskip("zarr")
warnings.filterwarnings("ignore", message="Consolidated metadata")


def _convert(src: Path, root: Path, **kwargs: object) -> tuple[ss.Shards, object]:
    result = convert(src, root=root, durable=False, **kwargs)
    return ss.open(result.path), result


# -- zarr ------------------------------------------------------------------------------


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


# -- SAELens ---------------------------------------------------------------------------


def test_saelens_rows_hooks_and_token_ids(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    expected = saelens_source(tmp_path / "cache")
    shards, _ = _convert(tmp_path / "cache", tmp_path / "root")
    assert_converted(shards, expected)
    assert shards.metadata.layers == (3, 1)  # column order, numbers from the hook names
    assert shards.lengths is None
    cut, _ = _convert(tmp_path / "cache", tmp_path / "cut", options=Options(max_tokens=4, layers=(30, 10)))
    assert cut.metadata.layers == (30, 10)
    np.testing.assert_array_equal(cut[:], expected.acts[:, :, :4].astype(np.float16))
    np.testing.assert_array_equal(cut.columns["token_ids"], expected.columns["token_ids"][:, :4])


def test_saelens_layer_numbers(tmp_path: Path) -> None:
    assert layer_of("blocks.5.hook_resid_post") == 5
    assert layer_of("blocks.12.attn.hook_z") == 12
    assert layer_of("model.layers.7.mlp") == 7
    assert layer_of("hook_embed") is None
    pytest.importorskip("datasets")
    saelens_source(tmp_path / "dup", hooks=("blocks.2.hook_resid_pre", "blocks.2.hook_mlp_out"))
    with pytest.raises(ConvertOptionError, match="give them with --layers"):
        convert(tmp_path / "dup", root=tmp_path / "root")
    shards, _ = _convert(tmp_path / "dup", tmp_path / "root", options=Options(layers=(2, 102)))
    assert shards.metadata.layers == (2, 102)


# -- npy -------------------------------------------------------------------------------


@pytest.mark.parametrize("fortran", [False, True])
def test_npy_is_memmapped_and_copied_exactly(tmp_path: Path, fortran: bool) -> None:
    expected = npy_source(tmp_path / "acts.npy", fortran=fortran)
    shards, _ = _convert(tmp_path / "acts.npy", tmp_path / "root", dtype="float32", patches_per_shard=3 * 5 * 4)
    assert shards.n_shards == 3
    assert_converted(shards, expected, "float32")
    shards, _ = _convert(
        tmp_path / "acts.npy",
        tmp_path / "named",
        options=Options(layers=(2, 4, 6), cls_token=True, family="clip", ckpt="x"),
    )
    md = shards.metadata
    assert (md.layers, md.cls_token, md.patches_per_ex, md.family, md.ckpt) == ((2, 4, 6), True, 4, "clip", "x")


def test_npy_bad_shapes(tmp_path: Path) -> None:
    np.save(tmp_path / "three.npy", np.zeros((4, 5, 6), np.float32))
    with pytest.raises(ConvertError, match=r"expected shape \(N, L, T, D\).*np.expand_dims"):
        convert(tmp_path / "three.npy", root=tmp_path / "root")
    np.save(tmp_path / "ints.npy", np.zeros((4, 1, 5, 6), np.int32))
    with pytest.raises(ConvertError, match="expected floating-point activations, found dtype int32"):
        convert(tmp_path / "ints.npy", root=tmp_path / "root")
    npy_source(tmp_path / "ok.npy")
    with pytest.raises(ConvertOptionError, match="expected 3 layer numbers"):
        convert(tmp_path / "ok.npy", root=tmp_path / "root", options=Options(layers=(1, 2)))


# -- detection and the same source twice ------------------------------------------------


def test_each_kind_is_detected(tmp_path: Path) -> None:
    pickle_source(tmp_path / "pickle")
    zarr_source(tmp_path / "zarr")
    npy_source(tmp_path / "a.npy")
    assert detect(tmp_path / "pickle").name == "pickle"
    assert detect(tmp_path / "zarr").name == "zarr"
    assert detect(tmp_path / "a.npy").name == "npy"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hello")
    with pytest.raises(ConvertOptionError, match="not a source kind convert recognises; name one with --from"):
        detect(tmp_path / "other")
    if pytest.importorskip("datasets"):
        saelens_source(tmp_path / "saelens")
        assert detect(tmp_path / "saelens").name == "saelens"


def test_convert_takes_the_fields_of_convert_options(tmp_path: Path) -> None:
    """`convert`'s keywords are `ConvertOptions`' fields (its signature says so); any other is
    refused as Python refuses an unexpected keyword argument."""
    names = list(inspect.signature(convert).parameters)
    assert names == ["src", *(f.name for f in dataclasses.fields(ConvertOptions))]
    with pytest.raises(TypeError, match=r"^convert\(\) got an unexpected keyword argument 'dtypes'$"):
        convert(tmp_path / "x.npy", dtypes="float32")
    assert ConvertOptions(dtype="float32").keywords_of(run) == {
        f: getattr(ConvertOptions(), f)
        for f in ("allow_nonfinite", "stats", "restart", "progress", "durable", "check_space")
    }


def test_same_source_same_hash_and_already_published(tmp_path: Path) -> None:
    npy_source(tmp_path / "a.npy")
    first = convert(tmp_path / "a.npy", root=tmp_path / "root", durable=False)
    again = convert(tmp_path / "a.npy", root=tmp_path / "root", durable=False)
    assert again.already_published and again.path == first.path
    np.save(tmp_path / "a.npy", np.ones((11, 3, 5, 8), np.float32))  # changed: another cache
    other = convert(tmp_path / "a.npy", root=tmp_path / "root", durable=False)
    assert other.path != first.path
    assert json.loads((other.path / "metadata.json").read_text())["data"]["converted_from"]["kind"] == "npy"
