"""shuffle.meeting: what the ranks of a shuffle are told when their arguments differ."""

from __future__ import annotations

from saev_shards.shuffle.meeting import differences


def test_each_differing_argument_is_named_with_both_values() -> None:
    mine = {"seed": 7, "layers": [6], "dtype": "float16", "plan": {"a": 1}}
    theirs = {"seed": 8, "layers": [6], "dtype": "float32", "plan": {"a": 2}}
    assert differences(mine, theirs) == ["seed: 7 here, 8 there", 'dtype: "float16" here, "float32" there']
    assert differences(mine, dict(mine)) == []


def test_the_plan_is_named_only_when_nothing_else_differs() -> None:
    assert differences({"seed": 1, "plan": {"a": 1}}, {"seed": 1, "plan": {"a": 2}}) == [
        "the plans differ (another version of saev-shards?)"
    ]


def test_long_values_are_cut() -> None:
    (line,) = differences({"source": "x" * 100}, {"source": "y"})
    assert line == f'source: "{"x" * 56}... here, "y" there'
