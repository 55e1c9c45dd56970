"""selection.layers: a ``layers`` argument checked against the recorded layers, one wording for every caller."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from saev_shards.errors import ShardsError, ShuffleError
from saev_shards.selection import choose_layers, string_layers_problem

RECORDED = (6, 11)


def test_choose_layers_keeps_the_order_asked() -> None:
    assert choose_layers(RECORDED, [11, 6], ShuffleError) == (11, 6)
    assert choose_layers(RECORDED, None, ShuffleError) == RECORDED


class Refused(ShardsError):
    """The caller's own error class."""


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        (7, r"expected values among the recorded layers \[6, 11\], found 7"),
        (True, r"expected None, a layer value or a list of them, found True"),
        ([], r"expected at least one of the recorded layers \[6, 11\], found none"),
        ([6, 6], r"expected distinct values, found \[6, 6\]"),
        ([6.0], r"expected values among the recorded layers \[6, 11\], found 6\.0"),
        ({6: 1}, r"expected None, a layer value or a list of them"),
        (np.array([[6]]), r"expected None, a layer value or a list of them"),
        ("6", r"expected a list of layer values such as \[6\], found the string '6'"),
    ],
)
def test_choose_layers_refuses_with_the_callers_class(layers: object, message: str) -> None:
    with pytest.raises(Refused, match="^layers: " + message):
        choose_layers(RECORDED, layers, Refused)


def test_choose_layers_takes_one_value_or_any_iterable_of_values() -> None:
    assert choose_layers(RECORDED, np.int32(11), Refused) == (11,)
    assert choose_layers(RECORDED, iter([11]), Refused) == (11,)
    assert choose_layers(RECORDED, np.array([6, 11]), Refused) == (6, 11)
    assert all(type(v) is int for v in choose_layers(RECORDED, np.array([6, 11]), Refused))


@pytest.mark.parametrize(
    ("value", "example"),
    [("11", "[11]"), ("[6, 11]", "[6, 11]"), (" 6 11 ", "[6, 11]"), (b"3,-1", "[3, -1]"), ("all", "[1, 3]")],
)
def test_a_string_is_refused_with_a_list_to_write_instead(value: str | bytes, example: str) -> None:
    problem = string_layers_problem("cfg.layers", value)
    assert problem == (
        f"cfg.layers: expected a list of layer values such as {example}, found the string {value!r} "
        "(a string is not read as a list of layers)"
    )


@given(st.one_of(st.none(), st.integers(), st.lists(st.integers()), st.floats()))
def test_anything_but_a_string_is_no_string_problem(value: object) -> None:
    assert string_layers_problem("layers", value) is None
