"""Who this process is among the processes sharing one job: ``World(rank, world_size, source)``.

The writers (a dump split over ranks) and the training loaders (each rank reads its share
of an epoch) find their place the same way, in this order:

1. explicit ``rank`` and ``world_size`` (both or neither);
2. an initialised ``torch.distributed`` process group (checked only when the process has
   imported torch already: a process that never imported torch cannot have a group);
3. the launcher's ``RANK`` and ``WORLD_SIZE`` variables (torchrun, accelerate, deepspeed);
4. a SLURM job array: ``SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN`` of
   ``SLURM_ARRAY_TASK_COUNT`` (``MIN`` defaults to 0), when the caller counts arrays;
5. a single process: ``(0, 1)``.

The writers count SLURM arrays (one dump split over array tasks is what an array is for
there); the loaders do not, because an array of training jobs is almost always a sweep in
which every task trains on the whole cache. A loader in an array that should split the
data takes ``rank``/``world_size`` explicitly.

`share` is the one rank split of the library: rank ``r`` of ``W`` gets the contiguous
items ``[r * n // W, (r + 1) * n // W)``, so shares differ by at most one item.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import sys
from collections.abc import Mapping

from .errors import ShardsError

#: Where a `World` came from, in the order they are tried.
SOURCES = ("explicit", "torch.distributed", "RANK/WORLD_SIZE", "SLURM array", "single process")


@dataclasses.dataclass(frozen=True)
class World:
    """This process's ``rank`` among ``world_size`` and the ``source`` that said so (one of `SOURCES`)."""

    rank: int
    world_size: int
    source: str = "explicit"

    def share(self, n: int) -> range:
        """The contiguous items of ``n`` this rank owns."""
        return share(n, self.rank, self.world_size)


def share(n: int, rank: int, world_size: int) -> range:
    """Items ``[rank * n // world_size, (rank + 1) * n // world_size)`` of ``n``."""
    return range(rank * n // world_size, (rank + 1) * n // world_size)


def check(rank: object, world_size: object, error: type[ShardsError] = ShardsError) -> tuple[int, int]:
    """``(rank, world_size)`` as ints, or ``error`` unless ``0 <= rank < world_size``."""
    values = []
    for name, value in (("rank", rank), ("world_size", world_size)):
        try:
            if isinstance(value, bool):
                raise TypeError
            values.append(operator.index(value))  # type: ignore[arg-type]
        except TypeError:
            raise error(f"{name}: expected an integer, found {value!r}") from None
    r, w = values
    if w < 1 or not 0 <= r < w:
        raise error(f"rank: expected 0 <= rank < world_size={w}, found {r}")
    return r, w


def detect(
    rank: int | None = None,
    world_size: int | None = None,
    *,
    slurm_array: bool = True,
    error: type[ShardsError] = ShardsError,
    env: Mapping[str, str] | None = None,
) -> World:
    """The `World` of this process (module docstring: the order of the sources).

    ``error`` is the class raised for a bad value (the loaders raise `LoaderError`, the
    writers `WriterError`); ``env`` defaults to ``os.environ``.
    """
    if rank is not None or world_size is not None:
        if rank is None or world_size is None:
            found = f"found rank={rank}, world_size={world_size}"
            raise error(f"rank and world_size: give both rank and world_size, or neither; {found}")
        return World(*check(rank, world_size, error), "explicit")
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return World(*check(dist.get_rank(), dist.get_world_size(), error), "torch.distributed")
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        r, w = _ints(env, ("RANK", "WORLD_SIZE"), error)
        return World(*check(r, w, error), "RANK/WORLD_SIZE")
    if slurm_array and "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env:
        task, count = _ints(env, ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT"), error)
        (first,) = _ints(
            {"SLURM_ARRAY_TASK_MIN": env.get("SLURM_ARRAY_TASK_MIN", "0")}, ("SLURM_ARRAY_TASK_MIN",), error
        )
        return World(*check(task - first, count, error), "SLURM array")
    return World(0, 1, "single process")


def _ints(env: Mapping[str, str], names: tuple[str, ...], error: type[ShardsError]) -> list[int]:
    values = []
    for name in names:
        try:
            values.append(int(env[name]))
        except ValueError:
            raise error(f"${name}: expected an integer, found {env[name]!r}") from None
    return values
