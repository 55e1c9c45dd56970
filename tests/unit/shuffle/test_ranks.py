"""shuffle.ranks: what the ranks of one shuffle must agree on, and the names of their locks."""

from __future__ import annotations

from pathlib import Path

import saev_shards as ss
from saev_shards.shuffle import plan_shuffle
from saev_shards.shuffle.meeting import differences
from saev_shards.shuffle.ranks import arguments, rank_lock_name

from ...support.caches import small_metadata, write_cache


def test_the_ranks_agree_on_every_argument_that_decides_the_output(root: Path) -> None:
    md = small_metadata(n_examples=6)
    write_cache(root, md)
    src = ss.open(root / md.hash)
    a = arguments(plan_shuffle(src, seed=1, layers=[11]), 2)
    assert a["source"] == md.hash and a["layers"] == [11] and a["seed"] == 1 and a["world_size"] == 2
    assert differences(a, arguments(plan_shuffle(src, seed=1, layers=[11]), 2)) == []
    assert differences(a, arguments(plan_shuffle(src, seed=2, layers=[11]), 2)) == ["seed: 1 here, 2 there"]
    assert differences(a, arguments(plan_shuffle(src, seed=1, layers=[11]), 3)) == ["world_size: 2 here, 3 there"]


def test_rank_lock_names() -> None:
    assert rank_lock_name(0, 4) == ".rank-0-of-4.lock"
