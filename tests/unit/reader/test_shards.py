"""reader.shards: `Shards` takes layer positions where numpy would and layer values where it
names them, and says which when one is given for the other."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import saev_shards as ss

from ...support.caches import small_metadata, write_cache


@pytest.fixture
def cache(tmp_path: Path) -> tuple[ss.Shards, np.ndarray]:
    md = small_metadata(n_examples=7)  # layers (6, 11)
    lengths = np.full(md.n_examples, md.tokens_per_ex, np.int32)
    logical = write_cache(tmp_path, md, lengths=lengths, text=True)
    return ss.open(tmp_path / md.hash), logical


def test_indexing_takes_positions_and_example_takes_values(cache: tuple[ss.Shards, np.ndarray]) -> None:
    shards, logical = cache
    np.testing.assert_array_equal(shards[3, 1], logical[3, 1])
    np.testing.assert_array_equal(shards.example(3, 11), logical[3, 1])
    np.testing.assert_array_equal(shards[:, shards.layer_index(11)], logical[:, 1])


@pytest.mark.parametrize("key", [(3, 11), (slice(None), 11), (3, [1, 6]), (3, np.int64(11), 0)])
def test_a_layer_value_given_as_a_position_says_how_to_select_by_value(
    cache: tuple[ss.Shards, np.ndarray], key: tuple[object, ...]
) -> None:
    shards, _ = cache
    with pytest.raises(ss.LayerIndexError, match=r"is a recorded layer value \(layers \[6, 11\]\).*layer_index") as err:
        shards[key]
    assert isinstance(err.value, IndexError) and isinstance(err.value, ss.ShardsError)


def test_other_out_of_range_positions_stay_plain_index_errors(cache: tuple[ss.Shards, np.ndarray]) -> None:
    shards, _ = cache
    with pytest.raises(IndexError) as err:
        shards[3, 5]
    assert not isinstance(err.value, ss.LayerIndexError)


def test_a_position_given_as_a_layer_value_is_named(cache: tuple[ss.Shards, np.ndarray]) -> None:
    shards, _ = cache
    with pytest.raises(ss.NameNotFoundError, match=r"recorded layer values are \[6, 11\] \(1 is a layer position"):
        shards.example(3, 1)
    with pytest.raises(KeyError, match=r"layer 7 was not recorded; recorded layer values are \[6, 11\]$"):
        shards.get(3, 7, 0)
