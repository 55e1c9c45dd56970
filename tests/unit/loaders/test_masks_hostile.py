"""Token masks given what breaks them: ids beyond int64, a multiple beyond float, a shuffled
cache's one-value-per-row ``token_ids``, a ``token_ids`` column of another shape or dtype,
and caches of NaN vectors. Each ends in batches that follow the documented rule or in a
library error naming the argument or the column (before the fixes: raw ``OverflowError`` and
``ValueError``, and NaN vectors kept)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import saev_shards as ss
from saev_shards import loaders
from saev_shards.cli import main
from saev_shards.errors import LoaderError, ShuffleError
from saev_shards.shuffle import plan_shuffle, shuffle_cache

from ...support.caches import small_metadata
from .test_masks import BOS, PAD, masked_cache

HUGE_IDS: list[Any] = [2**63, -(2**63) - 1, 2**70, np.uint64(2**64 - 1)]


def every_row(loader: loaders.TokenLoader) -> list[tuple[int, int, int]]:
    return [
        (int(e), int(lay), int(t))
        for b in loader
        for e, lay, t in zip(b.examples.tolist(), b.layers.tolist(), b.tokens.tolist(), strict=True)
    ]


@pytest.mark.parametrize("token_id", HUGE_IDS, ids=repr)
def test_token_ids_beyond_int64_are_a_library_error(tmp_path: Path, token_id: Any) -> None:
    shards, _ = masked_cache(tmp_path, n=10)
    for make in (loaders.ShuffledLoader, loaders.OrderedLoader):
        with pytest.raises(LoaderError, match=r"exclude_token_ids: expected token ids in \[-2\*\*63, 2\*\*63\)"):
            make(shards, layers=11, exclude_token_ids=[BOS, token_id])
    with pytest.raises(LoaderError, match="exclude_token_ids"):
        loaders.TokenDataset(shards, layer=11, exclude_token_ids=[token_id])
    with pytest.raises(ShuffleError, match=r"exclude_token_ids: expected token ids in \[-2\*\*63, 2\*\*63\)"):
        plan_shuffle(shards, tmp_path / "out", layers=11, exclude_token_ids=[token_id])


@pytest.mark.parametrize(
    "multiple", [2**1100, -(2**1100), 10**400, 10**5000], ids=["2**1100", "-2**1100", "10**400", "10**5000"]
)
def test_a_multiple_beyond_float_is_a_library_error(tmp_path: Path, multiple: int) -> None:
    shards, _ = masked_cache(tmp_path, n=10)
    with pytest.raises(LoaderError, match="max_norm_multiple: expected a finite number above 1"):
        loaders.ShuffledLoader(shards, layers=11, max_norm_multiple=multiple)
    with pytest.raises(ShuffleError, match="max_norm_multiple: expected a finite number above 1"):
        plan_shuffle(shards, tmp_path / "out", layers=11, max_norm_multiple=multiple)


def test_the_command_line_refuses_them_as_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shards, _ = masked_cache(tmp_path / "src", n=10)
    base = ["shuffle", str(shards.path), "--layers", "11", "--to", str(tmp_path / "out")]
    assert main([*base, "--exclude-token-ids", f"101,{2**64}"]) == 2
    assert "exclude_token_ids: expected token ids in [-2**63, 2**63)" in capsys.readouterr().err
    assert main([*base, "--max-norm-multiple", "1e400"]) == 2
    assert "max_norm_multiple: expected a finite number above 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_masks_work_on_a_shuffled_cache(tmp_path: Path) -> None:
    """docs/loaders.md: shuffle first, then read in order. The shuffled cache's ``token_ids`` has
    one value per row (shape ``(n,)``, T = 1); excluding ids there drops exactly those rows."""
    shards, _ = masked_cache(tmp_path / "src")
    out = shuffle_cache(shards, tmp_path / "out", layers=11, memory_bytes=1 << 20, durable=False)
    ids = np.asarray(out.columns["token_ids"])
    assert ids.shape == (out.n_examples,)
    keep = {(int(j), 11, 0) for j in np.flatnonzero(~np.isin(ids, [BOS, PAD]))}
    assert 0 < len(keep) < out.n_examples
    ordered = loaders.OrderedLoader(out, batch_size=5, exclude_token_ids=[BOS, PAD])
    rows = every_row(ordered)
    assert rows == sorted(keep) and ordered.dropped == {"exclude_token_ids": out.n_examples - len(keep)}
    assert sorted(every_row(loaders.ShuffledLoader(out, batch_size=5, seed=1, exclude_token_ids=[BOS, PAD]))) == sorted(
        keep
    )
    ds = loaders.TokenDataset(out, layer=11, exclude_token_ids=[BOS, PAD])
    assert {(ds[i]["example"], 11, ds[i]["token"]) for i in range(len(ds))} == keep
    # And a shuffled cache shuffled again with the mask: the kept rows, carried with their ids.
    again = shuffle_cache(out, tmp_path / "again", exclude_token_ids=[BOS], memory_bytes=1 << 20, durable=False)
    assert again.n_examples == int((ids != BOS).sum())
    assert BOS not in ids[np.asarray(again.columns["source_example"])].tolist()


def _with_token_ids(root: Path, dtype: str, shape: tuple[int, ...]) -> ss.Shards:
    md = small_metadata(n_examples=6, cls_token=False, patches_per_ex=4, patches_per_shard=4 * 2 * 3)
    values = (np.arange(6 * int(np.prod(shape, dtype=np.int64))) % 7).reshape(6, *shape).astype(dtype)
    with ss.ShardWriter(root, md, durable=False, columns={"token_ids": (dtype, shape)}) as w:
        w.write(np.ones(md.shape, np.float16), columns={"token_ids": values})
    return ss.open(root / md.hash)


@pytest.mark.parametrize(
    ("dtype", "shape", "found"),
    [
        ("int32", (3,), r"int32 of shape \(6, 3\)"),
        ("int32", (), r"int32 of shape \(6,\)"),
        ("int32", (4, 2), r"int32 of shape \(6, 4, 2\)"),
        ("float32", (4,), r"float32 of shape \(6, 4\)"),
    ],
)
def test_a_token_ids_column_of_another_shape_is_named(
    tmp_path: Path, dtype: str, shape: tuple[int, ...], found: str
) -> None:
    shards = _with_token_ids(tmp_path, dtype, shape)
    message = rf"{shards.path}: token_ids: expected integers of shape \(6, 4\) \(one per token position\), found "
    message += found
    for make in (loaders.ShuffledLoader, loaders.OrderedLoader):
        with pytest.raises(LoaderError, match=message):
            make(shards, layers=11, exclude_token_ids=[3])
    with pytest.raises(LoaderError, match=message):
        loaders.TokenDataset(shards, layer=11, exclude_token_ids=[3])
    with pytest.raises(ShuffleError, match=message):
        plan_shuffle(shards, tmp_path / "out", layers=11, exclude_token_ids=[3])
    assert len(every_row(loaders.OrderedLoader(shards, batch_size=4, layers=11))) == 6 * 4  # no mask: no check


def _nan_cache(root: Path, nan_rows: slice, dtype: str) -> tuple[ss.Shards, np.ndarray[Any, Any]]:
    md = small_metadata(n_examples=8, dtype=dtype, cls_token=False, patches_per_ex=3, patches_per_shard=3 * 2 * 4)
    acts = np.random.default_rng(0).standard_normal(md.shape).astype(np.float32)
    acts[nan_rows, 1] = np.nan  # layer 11 of these examples, every token
    with ss.ShardWriter(root, md, durable=False, allow_nonfinite=True) as w:
        w.write(acts)
    return ss.open(root / md.hash), acts


@pytest.mark.parametrize("nan_rows", [slice(None), slice(0, 3)], ids=["every vector NaN", "some vectors NaN"])
@pytest.mark.parametrize("dtype", ["float16", "float8_e4m3"])
def test_max_norm_multiple_always_drops_nan_vectors(tmp_path: Path, nan_rows: slice, dtype: str) -> None:
    """docs/loaders.md: a vector holding a non-finite value has norm infinity and is dropped;
    before the fix a layer of NaN vectors only (median NaN) kept every one of them."""
    shards, acts = _nan_cache(tmp_path, nan_rows, dtype)
    finite = np.isfinite(acts[:, 1]).all(axis=-1)  # (N, T)
    for make in (loaders.OrderedLoader, loaders.ShuffledLoader):
        loader = make(shards, batch_size=4, layers=11, max_norm_multiple=1e30)
        rows = every_row(loader)
        assert sorted(rows) == sorted((int(e), 11, int(t)) for e, t in zip(*np.nonzero(finite), strict=True))
        assert loader.dropped == {"max_norm_multiple": int((~finite).sum())}
        assert all(torch_finite(b.acts) for b in make(shards, batch_size=4, layers=11, max_norm_multiple=1e30))
    out = shuffle_cache(shards, tmp_path / "out", layers=11, max_norm_multiple=1e30, memory_bytes=1 << 20,
                        durable=False)  # fmt: skip
    assert out.n_examples == int(finite.sum())


def torch_finite(x: Any) -> bool:
    import torch

    return bool(torch.isfinite(x).all())
