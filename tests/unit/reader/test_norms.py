"""reader.norms: the exact lower median norm of each layer's population, the tokens a multiple
of it drops, and ``max_norm_multiple`` checked."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import saev_shards as ss
from saev_shards.errors import ShardsError
from saev_shards.reader import norms

from ...support.caches import small_metadata


class Refused(ShardsError):
    """The caller's own error class."""


def cache(root: Path, seed: int) -> tuple[ss.Shards, np.ndarray, np.ndarray]:
    md = small_metadata(n_examples=9, dtype="float32", cls_token=False, patches_per_ex=6)
    rng = np.random.default_rng(seed)
    acts = rng.standard_normal(md.shape).astype(np.float32)
    acts[rng.integers(9), 1, rng.integers(6)] *= 100  # one huge vector at layer 11
    acts[4, 0, 2, 3] = np.inf  # a non-finite vector: norm +inf, out of the population
    lengths = rng.integers(1, 7, 9).astype(np.int32)
    lengths[4] = 6  # the inf vector is in the population's positions
    with ss.ShardWriter(root, md, durable=False, allow_nonfinite=True, columns={"lengths": ("int32", ())}) as w:
        w.write(acts, columns={"lengths": lengths})
    return ss.open(root / md.hash), acts, lengths


@given(seed=st.integers(0, 2**16))
def test_the_median_is_the_exact_lower_median_of_the_population(
    seed: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    shards, acts, lengths = cache(tmp_path_factory.mktemp("c"), seed)
    got = norms.median_norms(shards)
    valid = np.arange(6)[None, :] < lengths[:, None]
    for li in range(2):
        n = np.sqrt((acts[:, li] * acts[:, li]).sum(axis=2, dtype=np.float32))  # (9, 6) float32
        population = np.sort(n[valid & np.isfinite(n)])
        assert got[li] == population[(len(population) - 1) // 2]


def test_the_filter_drops_what_is_above_the_multiple_and_every_non_finite_vector(tmp_path: Path) -> None:
    shards, acts, _ = cache(tmp_path, 0)
    medians = norms.median_norms(shards)
    nf = norms.norm_filter(shards, 10.0, [1])
    n = np.sqrt((acts * acts).sum(axis=3, dtype=np.float32))  # (9, 2, 6)
    expected = n[:, 1].astype(np.float64) > 10.0 * np.float64(medians[1])
    np.testing.assert_array_equal(nf.dropped(np.arange(9)), expected)
    assert expected.sum() >= 1
    assert nf.thresholds() == {1: 10.0 * float(medians[1])}
    both = norms.norm_filter(shards, 10.0, [0, 1])
    assert both.dropped(np.array([4]))[0, 2]  # the inf vector at layer 6
    assert norms.to_json(both, shards.metadata.layers) == {
        "multiple": 10.0,
        "median_norms": {"6": float(medians[0]), "11": float(medians[1])},
    }


@pytest.mark.parametrize("value", [1, 0.5, float("inf"), float("nan"), 2**1100, True, "10", [10]])
def test_max_norm_multiple_is_a_finite_number_above_one(value: object) -> None:
    with pytest.raises(Refused, match=r"^max_norm_multiple: expected "):
        norms.parse_multiple(value, Refused)


def test_accepted_multiples() -> None:
    assert norms.parse_multiple(None, Refused) is None
    assert norms.parse_multiple(10, Refused) == 10.0
    assert norms.parse_multiple(np.float32(1.5), Refused) == 1.5
