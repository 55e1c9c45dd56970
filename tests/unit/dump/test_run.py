"""dump.run: the words a dump uses for the shards it wrote or left."""

from __future__ import annotations

from saev_shards.dump.run import shard_ranges


def test_shard_ranges_are_runs_of_ascending_indices() -> None:
    assert shard_ranges([4]) == "shard 4"
    assert shard_ranges([0, 1, 2, 4, 6, 7, 8]) == "shards 0-2, 4, 6-8"
    assert shard_ranges([1, 3]) == "shards 1, 3"
