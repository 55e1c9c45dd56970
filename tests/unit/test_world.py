"""`saev_shards.world`: one precedence for writers and loaders, and the one rank split."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from saev_shards import world, writer
from saev_shards.errors import LoaderError, WriterError

SLURM = {"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_MIN": "6", "SLURM_ARRAY_TASK_COUNT": "3"}
TORCHRUN = {"RANK": "2", "WORLD_SIZE": "4"}


def fake_group(monkeypatch: pytest.MonkeyPatch, rank: int, size: int) -> None:
    dist = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True)
    dist.get_rank, dist.get_world_size = (lambda: rank), (lambda: size)
    monkeypatch.setitem(sys.modules, "torch.distributed", dist)


def test_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    both = {**TORCHRUN, **SLURM}
    assert world.detect(env={}) == world.World(0, 1, "single process")
    assert world.detect(env=SLURM) == world.World(1, 3, "SLURM array")
    assert world.detect(env=SLURM, slurm_array=False) == world.World(0, 1, "single process")
    assert world.detect(env=both) == world.World(2, 4, "RANK/WORLD_SIZE")
    assert world.detect(0, 2, env=both) == world.World(0, 2, "explicit")
    fake_group(monkeypatch, 1, 5)
    assert world.detect(env=both) == world.World(1, 5, "torch.distributed")
    assert world.detect(3, 4, env=both) == world.World(3, 4, "explicit")


def test_loaders_and_writers_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", *SLURM):
        monkeypatch.delenv(key, raising=False)
    for key, value in TORCHRUN.items():
        monkeypatch.setenv(key, value)
    assert writer.world_from_env(None, None) == (2, 4)
    assert world.detect(slurm_array=False, error=LoaderError).rank == 2
    fake_group(monkeypatch, 3, 4)  # an initialised process group wins for both
    assert writer.world_from_env(None, None) == (3, 4)
    assert writer.rank_shards(10, 3, 4) == range(7, 10) == world.share(10, 3, 4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(rank=1), "give both rank and world_size"),
        (dict(rank=3, world_size=3), r"expected 0 <= rank < world_size=3, found 3"),
        (dict(rank=-1, world_size=2), "found -1"),
        (dict(rank=0, world_size=0), "world_size=0"),
        (dict(rank="0", world_size=1), "rank: expected an integer, found '0'"),
        (dict(env={"RANK": "x", "WORLD_SIZE": "2"}), r"\$RANK: expected an integer, found 'x'"),
        (
            dict(env={"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2", "SLURM_ARRAY_TASK_MIN": "4"}),
            "found -3",
        ),
    ],
)
def test_errors_name_the_value(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(LoaderError, match=message):
        world.detect(error=LoaderError, **{"env": {}, **kwargs})
    with pytest.raises(WriterError, match=message):
        world.detect(error=WriterError, **{"env": {}, **kwargs})


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_shares_partition(n: int, world_size: int) -> None:
    shares = [world.World(r, world_size).share(n) for r in range(world_size)]
    assert [i for s in shares for i in s] == list(range(n))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
