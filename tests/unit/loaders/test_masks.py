"""Token masks (`exclude_token_ids`, `max_norm_multiple`) against numpy filtering of the logical tensor:
every remaining vector once per epoch, the same after a resume mid-epoch, the drops counted."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import saev_shards as ss
from saev_shards import loaders
from saev_shards.errors import LoaderError
from saev_shards.reader import norms

from ...support.caches import small_metadata

BOS, PAD = 101, 0


def masked_cache(root: Path, n: int = 40, seed: int = 0, dtype: str = "float16") -> tuple[ss.Shards, dict[str, Any]]:
    """A dumped-like cache: lengths, token_ids (BOS first, PAD after the length) and a few
    vectors with huge norms (the massive activations these masks are for)."""
    md = small_metadata(n_examples=n, dtype=dtype, cls_token=False, patches_per_ex=6, patches_per_shard=7 * 6 * 2)
    rng = np.random.default_rng(seed)
    acts = rng.standard_normal(md.shape).astype(np.float32)
    acts[:, :, 0] *= 30  # BOS: far above the median at every layer
    hot = rng.choice(n * 6, size=n // 4, replace=False)
    acts[hot // 6, 1, hot % 6] *= 12  # outliers at layer 11 only
    lengths = rng.integers(1, 7, n).astype(np.int32)
    ids = rng.integers(1000, 2000, (n, 6)).astype(np.int32)
    ids[:, 0] = BOS
    ids[np.arange(6)[None, :] >= lengths[:, None]] = PAD
    acts[np.broadcast_to((np.arange(6)[None, :] >= lengths[:, None])[:, None, :], acts.shape[:3])] = 0
    with ss.ShardWriter(root, md, durable=False, columns={"lengths": ("int32", ()), "token_ids": ("int32", (6,))}) as w:
        w.write(acts, columns={"lengths": lengths, "token_ids": ids})
    shards = ss.open(root / md.hash)
    return shards, {"stored": shards.read_range(0, n, dtype="float32"), "lengths": lengths, "ids": ids}


def reference(shards: ss.Shards, ref: dict[str, Any], layers: list[int], exclude: list[int], k: float | None):
    """numpy: the exact lower median norm per layer and the kept (example, layer, token)."""
    x = ref["stored"]  # (N, L, T, D) float32 (float8 dequantized)
    vector_norms = np.sqrt((x * x).sum(axis=3, dtype=np.float32))  # (N, L, T)
    valid = np.arange(x.shape[2])[None, :] < ref["lengths"][:, None]  # (N, T): the stats population
    medians = []
    for li in range(x.shape[1]):
        values = np.sort(vector_norms[:, li][valid])
        medians.append(values[(len(values) - 1) // 2])
    keep = valid.copy()
    keep &= ~np.isin(ref["ids"], exclude)
    after_exclude = keep.copy()
    positions = [shards.metadata.layers.index(v) for v in layers]
    if k is not None:
        for p in positions:
            keep &= ~(vector_norms[:, p].astype(np.float64) > k * np.float64(medians[p]))
    kept = {(int(e), layer, int(t)) for e, t in zip(*np.nonzero(keep), strict=True) for layer in layers}
    dropped = {"exclude_token_ids": int((valid & ~after_exclude).sum())} if exclude else {}
    if k is not None:
        dropped["max_norm_multiple"] = int((after_exclude & ~keep).sum())
    return np.array(medians, np.float32), kept, dropped


def epoch(loader: loaders.TokenLoader, md: ss.Metadata, stored: Any) -> list[tuple[int, int, int]]:
    seen = []
    for batch in loader:
        ex, tok, lay = batch.examples.numpy(), batch.tokens.numpy(), batch.layers.numpy()
        positions = [md.layers.index(int(v)) for v in lay]
        np.testing.assert_array_equal(batch.acts.numpy(), stored[ex, positions, tok])
        seen += list(zip(ex.tolist(), lay.tolist(), tok.tolist(), strict=True))
    return seen


@pytest.mark.parametrize(
    ("layers", "exclude", "k", "dtype"),
    [
        ([11], [BOS], None, "float16"),
        ([11], [], 3.0, "float16"),
        ([6, 11], [BOS, PAD], 2.5, "float16"),
        ([6], [BOS], 1.5, "bfloat16"),
    ],
)
def test_masks_match_numpy_filtering_and_resume_mid_epoch(
    tmp_path: Path, layers: list[int], exclude: list[int], k: float | None, dtype: str
) -> None:
    shards, ref = masked_cache(tmp_path, dtype=dtype)
    md = shards.metadata
    medians, kept, dropped = reference(shards, ref, layers, exclude, k)
    kwargs: dict[str, Any] = dict(
        batch_size=7, layers=layers, seed=3, buffer_bytes=600, block_bytes=200, mix_layers=True, out_dtype="float32",
        exclude_token_ids=exclude, max_norm_multiple=k,
    )  # fmt: skip
    loader = loaders.ShuffledLoader(shards, **kwargs)
    seen = epoch(loader, md, ref["stored"])
    assert len(seen) == len(set(seen)) and set(seen) == kept  # every remaining vector once
    assert loader.dropped == dropped and loader.n_tokens == len(kept)
    if k is not None:
        np.testing.assert_array_equal(norms.median_norms(shards), medians)
        assert loader.norm_medians == {v: float(medians[md.layers.index(v)]) for v in layers}
        assert loader.settings["max_norm_multiple"] == k
    # Resume mid-epoch: the rest of the epoch, exactly.
    first = loaders.ShuffledLoader(shards, **kwargs)
    first.set_epoch(1)
    whole = [tuple(b.examples.tolist()) for b in first]
    second = loaders.ShuffledLoader(shards, **kwargs)
    second.set_epoch(1)
    it = iter(second)
    for _ in range(3):
        next(it)
    state = second.state_dict()
    resumed = loaders.ShuffledLoader(shards, **kwargs)
    resumed.load_state_dict(state)
    assert [tuple(b.examples.tolist()) for b in resumed] == whole[3:]
    # The ordered walk and the token dataset agree on what remains.
    walk = loaders.OrderedLoader(
        shards,
        batch_size=5,
        layers=layers,
        mix_layers=True,
        exclude_token_ids=exclude,
        max_norm_multiple=k,
        out_dtype="float32",
    )
    ordered = epoch(walk, md, ref["stored"])
    assert ordered == sorted(kept, key=lambda v: (v[0], md.layers.index(v[1]), v[2]))
    if len(layers) == 1:
        ds = loaders.TokenDataset(shards, layer=layers[0], exclude_token_ids=exclude, max_norm_multiple=k)
        assert {(ds[i]["example"], layers[0], ds[i]["token"]) for i in range(len(ds))} == kept


def test_float8_norms_are_those_of_the_dequantized_values(tmp_path: Path) -> None:
    """A float8_e4m3 cache's norms are those of its values times their scales (read as float32)."""
    shards, ref = masked_cache(tmp_path, dtype="float8_e4m3")
    medians, kept, dropped = reference(shards, ref, [11], [], 2.0)
    np.testing.assert_array_equal(norms.median_norms(shards), medians)
    nf = norms.norm_filter(shards, 2.0, [1])
    n = shards.n_examples
    valid = np.arange(6)[None, :] < ref["lengths"][:, None]
    gone = nf.dropped(np.arange(n, dtype=np.int64))
    assert int((valid & gone).sum()) == dropped["max_norm_multiple"]
    assert {(int(e), 11, int(t)) for e, t in zip(*np.nonzero(valid & ~gone), strict=True)} == kept


def test_a_loader_without_masks_keeps_its_fingerprint(tmp_path: Path) -> None:
    shards, _ = masked_cache(tmp_path, n=10)
    plain = loaders.ShuffledLoader(shards, batch_size=4, layers=11)
    assert "exclude_token_ids" not in plain.settings and "max_norm_multiple" not in plain.settings
    assert plain.dropped == {} and plain.norm_medians == {}
    masked = loaders.ShuffledLoader(shards, batch_size=4, layers=11, exclude_token_ids=[BOS])
    state = masked.state_dict()
    with pytest.raises(LoaderError, match=r"exclude_token_ids \[101\] in the state, 'unset' here"):
        plain.load_state_dict(state)


def test_mask_arguments_are_checked(tmp_path: Path) -> None:
    shards, _ = masked_cache(tmp_path, n=10)
    bad: Any
    for bad in (1, 0.5, float("nan"), "10", True):
        with pytest.raises(LoaderError, match="max_norm_multiple: expected"):
            loaders.ShuffledLoader(shards, layers=11, max_norm_multiple=bad)
    with pytest.raises(LoaderError, match="exclude_token_ids: expected"):
        loaders.ShuffledLoader(shards, layers=11, exclude_token_ids="101")  # type: ignore[arg-type]
    with pytest.raises(LoaderError, match="exclude_token_ids: expected integer token ids"):
        loaders.ShuffledLoader(shards, layers=11, exclude_token_ids=[1.5])  # type: ignore[list-item]
    plain = small_metadata(n_examples=3)
    with ss.ShardWriter(tmp_path / "plain", plain, durable=False) as w:
        w.write(np.zeros(plain.shape, np.float16))
    with pytest.raises(LoaderError, match="expected a cache with a token_ids column"):
        loaders.ShuffledLoader(tmp_path / "plain" / plain.hash, layers=11, exclude_token_ids=[BOS])


@settings(max_examples=15, deadline=None)
@given(st.data())
def test_the_median_is_the_exact_lower_median_with_bounded_passes(data: st.DataObject) -> None:
    """Many equal norms, norms across the 16-bit bucket edges, padding and non-finite vectors."""
    import tempfile

    n = data.draw(st.integers(1, 30))
    scale = data.draw(st.sampled_from([1e-3, 1.0, 300.0]))
    md = small_metadata(n_examples=n, dtype="float32", cls_token=False, patches_per_ex=3, patches_per_shard=3 * 2 * 4)
    values = data.draw(st.lists(st.sampled_from([0.0, 1.0, 1.0000001, 2.0, 7.5]), min_size=n * 2 * 3 * 8,
                                max_size=n * 2 * 3 * 8))  # fmt: skip
    acts = np.array(values, np.float32).reshape(md.shape) * np.float32(scale)
    if data.draw(st.booleans()):
        acts[0, 0, 0, 0] = np.inf  # left out of the population, as stats.json leaves it out
    lengths = np.array(data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)), np.int32)
    with tempfile.TemporaryDirectory() as tmp:
        with ss.ShardWriter(tmp, md, durable=False, allow_nonfinite=True) as w:
            w.write(acts, columns={"lengths": lengths})
        shards = ss.open(Path(tmp) / md.hash)
        got = norms.median_norms(shards)
        x = np.where(np.arange(3)[None, None, :, None] < lengths[:, None, None, None], acts, 0)
        vector_norms = np.sqrt((x * x).sum(axis=3, dtype=np.float32))
        for li in range(2):
            valid = (np.arange(3)[None, :] < lengths[:, None]) & np.isfinite(vector_norms[:, li])
            population = np.sort(vector_norms[:, li][valid])
            if len(population) == 0:
                assert np.isnan(got[li])
            else:
                assert got[li] == population[(len(population) - 1) // 2]
        shards.close()


def test_medians_are_computed_once_per_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shards, _ = masked_cache(tmp_path, n=12)
    passes: list[str] = []
    real = norms._blocks

    def counting(*args: Any, **kwargs: Any) -> Any:
        passes.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(importlib.import_module("saev_shards.reader.norms"), "_blocks", counting)
    loaders.ShuffledLoader(shards, layers=11, max_norm_multiple=4)
    loaders.ShuffledLoader(shards, layers=6, max_norm_multiple=8)
    assert passes == ["median norms (1 of 2)", "median norms (2 of 2)", "norms above 4 x the median",
                      "norms above 8 x the median"]  # fmt: skip


def test_shuffle_drops_what_the_loaders_drop_and_records_it(tmp_path: Path) -> None:
    """`shuffle_cache` with the token masks keeps exactly the loaders' remaining tokens, records
    the masks and what they dropped in ``data``, and a shuffle without them keeps its hash."""
    from saev_shards.shuffle import plan_shuffle, shuffle_cache

    shards, ref = masked_cache(tmp_path / "src")
    md = shards.metadata
    _, kept, dropped = reference(shards, ref, [11], [BOS], 2.0)
    out = shuffle_cache(shards, tmp_path / "out", layers=11, exclude_token_ids=[BOS, BOS], max_norm_multiple=2,
                        memory_bytes=1 << 20, durable=False)  # fmt: skip
    source_example = out.columns["source_example"]
    source_token = out.columns["source_token"]
    rows = {(int(e), 11, int(t)) for e, t in zip(source_example, source_token, strict=True)}
    assert rows == kept and out.n_examples == len(kept)
    np.testing.assert_array_equal(out[:, 0, 0], ref["stored"][np.asarray(source_example), 1, np.asarray(source_token)])
    recorded = out.metadata.data["shuffle"]
    assert recorded["exclude_token_ids"] == [BOS]
    assert recorded["max_norm_multiple"] == {
        "multiple": 2.0,
        "median_norms": {"11": float(norms.median_norms(shards)[1])},
    }
    assert recorded["dropped"] == dropped
    # Without masks: the metadata (and so the hash) of every shuffle before them.
    plain = plan_shuffle(shards, tmp_path / "out", layers=11, memory_bytes=1 << 20)
    assert set(plain.output.data["shuffle"]) == {"source", "layers", "tokens", "skip_padding", "seed", "order"}
    assert plain.output.hash != out.metadata.hash
    with pytest.raises(ss.ShuffleError, match="max_norm_multiple: expected a finite number above 1"):
        shuffle_cache(shards, tmp_path / "out", layers=11, max_norm_multiple=0.5)
    assert md.hash == shards.metadata.hash
