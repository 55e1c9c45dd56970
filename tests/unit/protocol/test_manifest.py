"""The fast and the slow parsers of a 3.0 shards.json's shard list agree on every input."""

from __future__ import annotations

from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from saev_shards.protocol.checks import JSONChecks
from saev_shards.protocol.v3 import SHARD_KEYS, _fast_shards, _slow_shards

HEX = "0123456789abcdef"
digests = st.one_of(
    st.text(HEX, min_size=32, max_size=32),
    st.text(HEX + "ABCDEF\n", min_size=0, max_size=66),
    st.integers(),
)
counts = st.one_of(st.integers(-2, 2**63), st.booleans(), st.floats(allow_nan=False), st.text(max_size=3))
good_entry = st.fixed_dictionaries(
    {
        "name": st.text(max_size=16),
        "n_examples": st.integers(0, 2**63),
        "nbytes": st.integers(0, 2**63),
        "xxh3_128": st.text(HEX, min_size=32, max_size=32),
    }
)
any_entry = st.one_of(
    good_entry,
    st.fixed_dictionaries(
        {
            "name": st.one_of(st.text(max_size=4), st.integers()),
            "n_examples": counts,
            "nbytes": counts,
            "xxh3_128": digests,
        }
    ),
    st.dictionaries(st.sampled_from([*SHARD_KEYS, "extra"]), st.integers(0, 5), max_size=5),
    st.integers(),
    st.none(),
)


@given(st.one_of(st.lists(good_entry, max_size=6), st.lists(any_entry, max_size=6)))
@example([{"name": "acts000000.bin", "n_examples": 1, "nbytes": 4, "xxh3_128": "a" * 32 + "\n" + "b" * 32}])
@example([{"name": "acts000000.bin", "n_examples": True, "nbytes": 4, "xxh3_128": "a" * 32}])
def test_fast_and_slow_shard_parsers_agree(entries: list[Any]) -> None:
    checks = JSONChecks("/x/shards.json")
    slow = _slow_shards(entries, checks)
    fast = _fast_shards(entries)
    if fast is not None:  # the fast path accepts only what the slow one accepts, with the same values
        assert not checks.problems
        assert list(fast) == slow
    if not checks.problems:  # and every valid list is taken by the fast path
        assert fast is not None
        assert list(fast) == slow
