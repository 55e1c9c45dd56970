"""The shuffle over several processes or machines: ``rank`` of ``world_size``, one shared work folder.

Every rank runs `run_rank` with the same plan (the same source, selection, seed, budget and
folders, which must be on a filesystem all ranks share):

1. It holds the scratch folder's lock *shared* (so `saev-shards clean` sees the shuffle live
   and a one-process shuffle of the same plan is refused) and a lock of its own,
   ``.rank-<R>-of-<W>.lock``, exclusively (the same rank started twice is refused).
2. It writes ``plan.json`` or checks that the one there is this plan (runs cut for another
   plan are never mixed in: clean the folder, or give the same arguments).
3. Scatter: it writes the runs of the chunks ``c`` with ``c % world_size == rank``; runs an
   earlier, killed run of this rank sealed are kept.
4. It waits until every chunk's run is sealed, whichever rank wrote it.
5. Write: ranks ``r < min(world_size, output shards)`` each write their block of output
   shards (`ShardWriter` with ``rank``/``world_size``: its part records seal them), reading
   every bucket and keeping the rows of their shards.
6. Rank 0 waits until every output shard is sealed, then finalizes: one rename publishes.
   It removes the scratch folder afterwards; the other ranks return once their share is
   written.

The bytes depend on the plan only, so the output is byte-identical to a one-process
shuffle with the same seed. A killed rank, started again with the same arguments, resumes
from its sealed runs and shards while the others wait for it at steps 4 and 6.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import orjson

from ..errors import ShuffleError, WriterBusyError
from ..fileio import fault_point, take_lock, write_file_atomic
from ..format import strict_json_loads
from ..progress import Progress
from ..protocol.staging import part_record, staging_dir
from ..reader import Shards
from ..reader import open as open_path
from ..store.roots import SHUFFLE_LOCK_FILE as LOCK_FILE
from ..writer import finalize
from .append import write_buckets
from .plan import ShufflePlan
from .runs import PLAN_FILE, RUN_DISK_FULL_NOTE, load_record, run_record_file
from .scatter import scatter

#: Seconds between two looks at what the other ranks have sealed.
POLL_SECONDS = 0.5


def rank_lock_name(rank: int, world_size: int) -> str:
    return f".rank-{rank}-of-{world_size}.lock"


def run_rank(
    plan: ShufflePlan,
    rank: int,
    world_size: int,
    *,
    progress: bool | None = None,
    durable: bool = True,
    poll: float = POLL_SECONDS,
    on_wait: Callable[[str], None] | None = None,
) -> Shards | None:
    """Carry out rank ``rank``'s share of ``plan`` (module docstring); rank 0 returns the
    published output opened, the others None once their share is written."""
    from . import _check_space, _open_writer, _remove_stale_work, _remove_work

    if plan.path.exists():
        if rank != 0:
            return None
        _remove_stale_work(plan)  # rank 0 killed after publishing, before cleaning up
        return open_path(plan.path)
    plan.work.mkdir(parents=True, exist_ok=True)
    shared = take_lock(plan.work / LOCK_FILE, shared=True)
    if shared is None:
        raise WriterBusyError(f"{plan.work}: a one-process shuffle of this plan is running")
    mine = take_lock(plan.work / rank_lock_name(rank, world_size))
    if mine is None:
        os.close(shared)
        raise WriterBusyError(f"{plan.work}: rank {rank} of {world_size} is already running")
    try:
        _share_plan(plan, durable)
        _check_space(plan)
        row_bytes = plan.layout.fields[0].row_nbytes
        chunks = [c for c in range(plan.n_chunks) if c % world_size == rank]
        todo = [c for c in chunks if load_record(plan.work, c, plan.n_buckets, plan.layout) is None]
        rows = sum(plan.chunk_first[c + 1] - plan.chunk_first[c] for c in todo)
        with Progress(rows * row_bytes, f"shuffle 1/2 scatter (rank {rank}/{world_size})", enabled=progress) as bar:
            scatter(plan, todo, lambda n: bar.update(n * row_bytes), lambda c: fault_point("rank-run", c), durable)
        _wait(plan, lambda: _runs_missing(plan), "runs of other ranks", poll, on_wait)
        writers = min(world_size, plan.output.n_shards)
        if rank < writers:
            with (
                Progress(
                    plan.n_tokens * row_bytes // writers, f"shuffle 2/2 write (rank {rank})", enabled=progress
                ) as bar,
                _open_writer(plan, rank, writers, durable) as writer,
            ):
                write_buckets(plan, writer, lambda n: bar.update(n * row_bytes), lambda k: None)
        if rank != 0:
            return None
        _wait(plan, lambda: _shards_missing(plan), "output shards of other ranks", poll, on_wait)
        while True:
            try:
                finalize(plan.root, plan.output, verify=False, durable=durable)
                break
            except WriterBusyError:  # another rank is still closing its writer
                time.sleep(poll)
        _remove_work(plan)
    finally:
        os.close(mine)
        os.close(shared)
    return open_path(plan.path)


def _share_plan(plan: ShufflePlan, durable: bool) -> None:
    """Write plan.json, or check that the one there (another rank's) is this plan."""
    path = plan.work / PLAN_FILE
    wanted = plan.to_json()
    try:
        found = strict_json_loads(path.read_bytes())
    except FileNotFoundError:
        write_file_atomic(path, orjson.dumps(wanted), durable, note=RUN_DISK_FULL_NOTE)
        return
    except ValueError:
        found = None
    if found != wanted:
        raise ShuffleError(
            f"{path}: the ranks of one shuffle need one plan, and this folder holds runs cut for another "
            "(other arguments, or another memory budget): start every rank with the same arguments, or remove "
            f"the folder first (`saev-shards clean`)"
        )


def _runs_missing(plan: ShufflePlan) -> int:
    """Chunks whose run is not sealed yet (a record's presence first: cheap; then checked)."""
    missing = [c for c in range(plan.n_chunks) if not (plan.work / run_record_file(c)).exists()]
    if missing:
        return len(missing)
    return sum(load_record(plan.work, c, plan.n_buckets, plan.layout) is None for c in range(plan.n_chunks))


def _shards_missing(plan: ShufflePlan) -> int:
    staging = staging_dir(plan.root, plan.output)
    return sum(not (staging / part_record(k)).exists() for k in range(plan.output.n_shards))


def _wait(
    plan: ShufflePlan, missing: Callable[[], int], what: str, poll: float, on_wait: Callable[[str], None] | None
) -> None:
    """Return once ``missing()`` is 0 or the output is published; says what it waits for once."""
    told = False
    while (left := missing()) and not plan.path.exists():
        if not told and on_wait is not None:
            on_wait(f"waiting for {left} {what} (a killed rank resumes when started again)")
            told = True
        time.sleep(poll)
