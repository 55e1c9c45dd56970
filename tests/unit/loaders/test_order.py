"""loaders.order: an epoch's order as a strategy. The shuffled order permutes every span once,
drawn from ``(seed, epoch)`` alone; the ordered walk is the same every epoch; an order is taken
by name or as an object with the attributes a loader asks for, anything else refused."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from saev_shards.errors import LoaderError
from saev_shards.loaders.order import ORDERS, Order, Sequential, ShuffledWindows, parse_order

seeds = st.integers(0, 2**32 - 1)


@given(st.integers(0, 300), seeds, st.integers(0, 1000))
def test_the_shuffled_order_permutes_every_span_the_same_way_for_the_same_seed_and_epoch(
    n: int, seed: int, epoch: int
) -> None:
    order = ShuffledWindows().block_order(n, seed, epoch)
    assert order.dtype == np.int64 and sorted(order.tolist()) == list(range(n))
    assert np.array_equal(order, ShuffledWindows().block_order(n, seed, epoch))
    if n >= 20:  # another epoch, another order (20! orders: equal by chance never)
        assert not np.array_equal(order, ShuffledWindows().block_order(n, seed, epoch + 1))


@given(st.integers(0, 300), seeds, st.integers(0, 1000))
def test_the_ordered_walk_is_the_same_every_epoch(n: int, seed: int, epoch: int) -> None:
    order = Sequential().block_order(n, seed, epoch)
    assert order.dtype == np.int64 and order.tolist() == list(range(n))
    ordered: Order = Sequential()
    assert ordered.window_rng(seed, epoch, 0, 0, 1) is None


@given(seeds, st.integers(0, 100), st.integers(0, 100), st.integers(1, 8), st.data())
def test_a_windows_generator_depends_on_its_five_numbers_only(
    seed: int, epoch: int, window: int, world_size: int, data: st.DataObject
) -> None:
    rank = data.draw(st.integers(0, world_size - 1))
    a = ShuffledWindows().window_rng(seed, epoch, window, rank, world_size).integers(0, 2**62, 4)
    b = ShuffledWindows().window_rng(seed, epoch, window, rank, world_size).integers(0, 2**62, 4)
    c = ShuffledWindows().window_rng(seed, epoch, window + 1, rank, world_size).integers(0, 2**62, 4)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_the_fingerprint_holds_window_sizes_only_when_they_matter() -> None:
    assert ShuffledWindows().fingerprint(100, 10) == {"shuffle": True, "buffer_bytes": 100, "block_bytes": 10}
    assert Sequential().fingerprint(100, 10) == {"shuffle": False, "buffer_bytes": 0, "block_bytes": 0}
    assert not ShuffledWindows().sequential and Sequential().sequential


def test_an_order_is_taken_by_name_or_as_an_object() -> None:
    assert parse_order("shuffled") is ORDERS["shuffled"] and parse_order("ordered") is ORDERS["ordered"]
    assert parse_order("shuffled").name == "shuffled" and parse_order("ordered").name == "ordered"

    class Reversed:
        name = "reversed"

        def block_order(self, n_blocks: int, seed: int, epoch: int) -> Any:
            return np.arange(n_blocks)[::-1]

        def window_rng(self, *args: int) -> None:
            return None

        def fingerprint(self, buffer_bytes: int, block_bytes: int) -> dict[str, Any]:
            return {"reversed": True}

    mine: Any = Reversed()
    assert parse_order(mine) is mine


@pytest.mark.parametrize("order", ["random", "Shuffled", "", None, 3, object()])
def test_anything_else_is_refused(order: object) -> None:
    with pytest.raises(LoaderError, match=r"^order: expected one of \['shuffled', 'ordered'\] or an Order, found"):
        parse_order(order)
