"""selection.token_masks: the ``exclude_token_ids`` ids and the ``token_ids`` column they are
compared with, checked once for the loaders and the shuffle."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import saev_shards as ss
from saev_shards.errors import ShardsError
from saev_shards.selection.token_masks import parse_exclude_token_ids, token_ids_of, token_ids_problem

from ...support.caches import small_metadata


class Refused(ShardsError):
    """The caller's own error class."""


@given(st.lists(st.integers(-(2**63), 2**63 - 1)))
def test_ids_become_sorted_distinct_int64(ids: list[int]) -> None:
    parsed = parse_exclude_token_ids(ids, Refused)
    assert parsed.dtype == np.int64
    assert parsed.tolist() == sorted(set(ids))
    np.testing.assert_array_equal(parse_exclude_token_ids(np.array(ids, np.int64), Refused), parsed)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("3", r"expected a list of token ids, found '3'"),
        (3, r"expected a list of token ids, found 3"),
        (np.int64(3), r"expected a list of token ids"),
        (np.array(3), r"expected a list of token ids"),
        ([1, 2.0], r"expected integer token ids, found \[1, 2\.0\]"),
        ([True], r"expected integer token ids"),
        ([2**63], r"expected token ids in \[-2\*\*63, 2\*\*63\) .*found 9223372036854775808"),
        ([-(2**63) - 1], r"expected token ids in \[-2\*\*63, 2\*\*63\)"),
    ],
)
def test_anything_but_integer_ids_is_refused_with_the_callers_class(value: object, message: str) -> None:
    with pytest.raises(Refused, match="^exclude_token_ids: " + message):
        parse_exclude_token_ids(value, Refused)


def cache_with(root: Path, dtype: str, shape: tuple[int, ...], patches: int = 4) -> ss.Shards:
    md = small_metadata(n_examples=6, cls_token=False, patches_per_ex=patches)
    acts = np.zeros(md.shape, np.float32)
    ids = np.arange(6 * int(np.prod(shape, dtype=np.int64)), dtype=dtype).reshape(6, *shape)
    with ss.ShardWriter(root, md, durable=False, columns={"token_ids": (dtype, shape)}) as w:
        w.write(acts, columns={"token_ids": ids})
    return ss.open(root / md.hash)


def test_a_column_of_one_id_per_position_is_read_as_examples_by_positions(root: Path) -> None:
    shards = cache_with(root, "int32", (4,))
    assert token_ids_problem(shards) is None
    got = token_ids_of(shards, np.array([4, 1], np.int64))
    np.testing.assert_array_equal(got, [[16, 17, 18, 19], [4, 5, 6, 7]])


def test_one_id_per_row_is_enough_for_one_token_per_example(root: Path) -> None:
    shards = cache_with(root, "uint16", (), patches=1)
    assert token_ids_problem(shards) is None
    np.testing.assert_array_equal(token_ids_of(shards, np.array([5, 0], np.int64)), [[5], [0]])


@pytest.mark.parametrize(("dtype", "shape"), [("float32", (4,)), ("int64", (3,)), ("int64", ())])
def test_any_other_column_is_described(root: Path, dtype: str, shape: tuple[int, ...]) -> None:
    shards = cache_with(root, dtype, shape)
    assert token_ids_problem(shards) == (
        f"{shards.path}: token_ids: expected integers of shape (6, 4) (one per token position), "
        f"found {dtype} of shape {(6, *shape)}"
    )


def test_a_cache_without_the_column_is_for_the_caller_to_name(root: Path) -> None:
    md = small_metadata(n_examples=6)
    with ss.ShardWriter(root, md, durable=False) as w:
        w.write(np.zeros(md.shape, np.float32))
    assert token_ids_problem(ss.open(root / md.hash)) is None
