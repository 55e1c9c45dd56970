"""The shuffle over several processes or machines: rank ``R`` of ``W``, one shared work folder.

Every rank runs `run_rank` with the same arguments; the work folder (``work_dir``, default
the output's root) and the output's root must be on a filesystem every rank shares:

1. **Agree.** The ranks meet (`meeting`) and compare their arguments (`arguments`:
   the source, layers, tokens, token masks, seed, dtype, shard budget, memory budget,
   workers, world size, and the plan they give). A rank whose arguments differ from a
   running rank's is refused at once, its error naming each difference.
2. Each rank holds the scratch folder's lock *shared* (so `saev-shards clean` sees the
   shuffle live and a one-process shuffle of the same plan is refused) and a lock of its
   own, ``.rank-<R>-of-<W>.lock`` (the same rank started twice is refused); it writes
   ``plan.json`` or checks that the one there is this plan.
3. **Scatter**: it writes the runs of the chunks ``c`` with ``c % W == R``; runs an
   earlier, killed run of this rank sealed are kept.
4. **Meet**: every chunk's run is sealed, whichever rank wrote it.
5. **Write**: ranks ``r < min(W, output shards)`` each write their block of output shards
   (`ShardWriter` with ``rank``/``world_size``: its part records seal them; with one
   writer, its writer publishes as it closes), reading every bucket and keeping the rows
   of their shards.
6. **Meet**: every output shard is sealed. Rank 0 publishes (one rename), then removes the
   scratch folder. Output that someone else published first counts as published (its hash
   is the plan's, so its bytes are this shuffle's): rank 0 still removes what is left.

The bytes depend on the plan only, so the output is byte-identical to a one-process
shuffle with the same seed. A killed rank, started again with the same arguments, resumes
from its sealed runs and shards while the others wait for it at steps 4 and 6.

How the ranks meet, agree and wait for each other (through ``torch.distributed`` where a
process group is set up, else through files) is `meeting`.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from typing import Any

import orjson

from .. import world
from ..errors import AlreadyPublishedError, ShuffleError, WriterBusyError
from ..fileio import fault_point, remove_path, take_lock, write_file_atomic
from ..progress import Progress
from ..protocol.jsonfile import strict_json_loads
from ..protocol.staging import lock_path, part_record, staging_dir
from ..reader import Shards
from ..reader import open as open_path
from ..store.roots import SHUFFLE_LOCK_FILE as LOCK_FILE
from ..writer import finalize
from .meeting import DEFAULT_WAIT, FileMeeting, Meeting, TorchMeeting, torch_group
from .plan import ShufflePlan
from .run import check_space, open_writer, remove_stale_work, remove_work
from .scatter import scatter
from .scratch import PLAN_FILE, RUN_DISK_FULL_NOTE, load_record, run_record_file
from .write_pass import write_buckets

#: Seconds between two looks at what the other ranks have sealed (the file path).
POLL_SECONDS = 0.5
#: How ranks meet: `run_rank`'s ``sync``.
SYNCS = ("auto", "torch", "files")


def rank_lock_name(rank: int, world_size: int) -> str:
    return f".rank-{rank}-of-{world_size}.lock"


def arguments(plan: ShufflePlan, world_size: int) -> dict[str, Any]:
    """What the ranks of one shuffle agree on: every argument that decides the output or how
    the work is cut, and the world size (plus the plan they give, which a difference of
    library versions could change)."""
    sel = plan.selection
    return {
        "source": plan.source.metadata.hash,
        "layers": list(sel.layers),
        "tokens": sel.tokens,
        "exclude_token_ids": list(sel.exclude_token_ids),
        "max_norm_multiple": None if sel.norm_filter is None else sel.norm_filter.multiple,
        "seed": plan.seed,
        "dtype": plan.output.dtype,
        "patches_per_shard": plan.output.patches_per_shard,
        "allow_nonfinite": plan.allow_nonfinite,
        "memory_bytes": plan.memory_bytes * plan.workers,
        "workers": plan.workers,
        "n_buckets": plan.n_buckets,
        "examples_per_chunk": plan.examples_per_chunk,
        "world_size": world_size,
        "plan": plan.to_json(),
    }


def _check_wait(wait: object) -> float:
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not (math.isfinite(wait) and wait > 0):
        raise ShuffleError(f"wait: expected a number of seconds above 0, found {wait!r}")
    return float(wait)


def run_rank(
    plan: ShufflePlan,
    rank: int,
    world_size: int,
    *,
    progress: bool | None = None,
    durable: bool = True,
    poll: float = POLL_SECONDS,
    on_wait: Callable[[str], None] | None = None,
    wait: float = DEFAULT_WAIT,
    sync: str = "auto",
) -> Shards | None:
    """Carry out rank ``rank``'s share of ``plan`` (module docstring). Rank 0 returns the
    published output opened, the others None once their share is written (through
    ``torch.distributed``, every rank returns it once it is published).

    ``wait``: seconds a rank waits for the others without progress (files) or at one
    meeting point (torch.distributed) before it gives up with a `ShuffleError` naming the
    missing ranks. ``sync``: ``"auto"`` (torch.distributed when a process group of this rank
    and size is initialised, else files), ``"torch"`` or ``"files"``. ``on_wait`` is told,
    in words, what the rank waits for whenever that changes. ``poll``: seconds between two
    looks at the work folder while waiting (files only). Raises `ShuffleError` at once for a
    rank outside ``[0, world_size)`` and for arguments that differ from a running rank's.
    """
    rank, world_size = world.check(rank, world_size, ShuffleError)
    wait = _check_wait(wait)
    if sync not in SYNCS:
        raise ShuffleError(f"sync: expected one of {list(SYNCS)}, found {sync!r}")
    say = on_wait or (lambda text: None)
    group = torch_group(rank, world_size, sync)
    meeting: Meeting
    if group is not None:
        meeting = TorchMeeting(plan, rank, world_size, wait, say, group)
    else:
        meeting = FileMeeting(plan, rank, world_size, wait, say, poll, progress)
    with meeting:
        meeting.agree(orjson.loads(orjson.dumps(arguments(plan, world_size))))  # as JSON: records compare equal
        return _run(plan, meeting, progress, durable)


def _run(plan: ShufflePlan, meeting: Meeting, progress: bool | None, durable: bool) -> Shards | None:
    rank, world_size = meeting.rank, meeting.world_size
    if meeting.published(plan.path.exists()):
        if rank == 0:
            remove_stale_work(plan)  # rank 0 killed after publishing, before cleaning up
            _discard_staging(plan)
        return open_path(plan.path) if rank == 0 or meeting.everyone_returns else None
    plan.work.mkdir(parents=True, exist_ok=True)
    shared = take_lock(plan.work / LOCK_FILE, shared=True)
    if shared is None:
        raise ShuffleError(f"{plan.work}: a one-process shuffle of this plan is running")
    mine = take_lock(plan.work / rank_lock_name(rank, world_size))
    if mine is None:
        os.close(shared)
        raise WriterBusyError(f"{plan.work}: rank {rank} of {world_size} is already running")
    writers = min(world_size, plan.output.n_shards)
    try:

        def start() -> None:
            _share_plan(plan, durable)
            check_space(plan)

        meeting.step("start", _attempt(start))
        row_bytes = plan.layout.fields[0].row_nbytes

        def scatter_share() -> None:
            chunks = [c for c in range(plan.n_chunks) if c % world_size == rank]
            todo = [c for c in chunks if load_record(plan.work, c, plan.n_buckets, plan.layout) is None]
            rows = sum(plan.chunk_first[c + 1] - plan.chunk_first[c] for c in todo)
            what = f"shuffle 1/2 scatter (rank {rank}/{world_size})"
            with Progress(rows * row_bytes, what, enabled=progress) as bar:
                scatter(plan, todo, lambda n: bar.update(n * row_bytes), lambda c: fault_point("rank-run", c), durable)

        runs = lambda: _runs_missing(plan, world_size)  # noqa: E731
        meeting.step("scatter", _attempt(scatter_share), runs, "runs", rank < writers)
        if meeting.published(plan.path.exists()):
            return _published_meanwhile(plan, meeting)

        def write_share() -> None:
            if rank >= writers:
                return
            what = f"shuffle 2/2 write (rank {rank})"
            with (
                Progress(plan.n_tokens * row_bytes // writers, what, enabled=progress) as bar,
                open_writer(plan, rank, writers, durable) as writer,
            ):
                write_buckets(plan, writer, lambda n: bar.update(n * row_bytes), lambda k: None)

        error = _attempt(write_share)
        if isinstance(error, AlreadyPublishedError) and plan.path.exists():
            error = None  # one writer publishes as it closes: someone published the same bytes first
        pending = lambda: _shards_missing(plan, writers)  # noqa: E731
        meeting.step("write", error, pending, "output shards", rank == 0)
        if rank != 0 and not meeting.everyone_returns:
            return None
        error = _attempt(lambda: _publish(plan, writers, durable, meeting.wait)) if rank == 0 else None
        meeting.step("publish", error, lambda: {} if plan.path.exists() else {0: 1}, "the publication", True)
    finally:
        os.close(mine)
        os.close(shared)
    meeting.step("the end", None)  # (torch.distributed) no rank holds the scratch folder's locks any more
    if rank == 0:
        _cleanup(plan)
    return open_path(plan.path)


def _attempt(step: Callable[[], object]) -> BaseException | None:
    """``step()``'s error (for the meeting that follows: every rank hears of it), or None."""
    try:
        step()
    except Exception as err:
        return err
    return None


def _published_meanwhile(plan: ShufflePlan, meeting: Meeting) -> Shards | None:
    """The output appeared while this rank waited (another process published the same plan)."""
    if meeting.rank == 0:
        _cleanup(plan)
    return open_path(plan.path) if meeting.rank == 0 or meeting.everyone_returns else None


def _publish(plan: ShufflePlan, writers: int, durable: bool, wait: float) -> None:
    """Rank 0's finalize, once every output shard is sealed (a single writer has published
    already as it closed). Published by someone else first: done as well."""
    if writers == 1 or plan.path.exists():
        return
    fault_point("rank-finalize")
    deadline = time.monotonic() + wait
    while True:
        try:
            finalize(plan.root, plan.output, verify=False, durable=durable)
            return
        except AlreadyPublishedError:
            if plan.path.exists():
                return
            raise
        except WriterBusyError:  # another rank is still closing its writer
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _cleanup(plan: ShufflePlan) -> None:
    """After the publication (by rank 0, or by someone else first): the scratch folder, and the
    output's staging folder if it is still there (someone else published from theirs)."""
    remove_work(plan)
    _discard_staging(plan)


def _discard_staging(plan: ShufflePlan) -> None:
    """The output's staging folder and lock file of a published output, unless a writer holds them."""
    staging, lock = staging_dir(plan.root, plan.output), lock_path(plan.root, plan.output)
    if not (staging.exists() or lock.exists()) or not plan.path.exists():
        return
    with contextlib.suppress(FileNotFoundError):
        fd = take_lock(lock)
        if fd is None:
            return
        try:
            remove_path(staging)
            lock.unlink(missing_ok=True)  # held exclusively: see take_lock
        finally:
            os.close(fd)


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


def _runs_missing(plan: ShufflePlan, world_size: int) -> dict[int, int]:
    """Rank -> chunks of its share whose run is not sealed yet (a record's presence first: cheap)."""
    missing = [c for c in range(plan.n_chunks) if not (plan.work / run_record_file(c)).exists()]
    if not missing:
        missing = [c for c in range(plan.n_chunks) if load_record(plan.work, c, plan.n_buckets, plan.layout) is None]
    out: dict[int, int] = {}
    for c in missing:
        out[c % world_size] = out.get(c % world_size, 0) + 1
    return out


def _shards_missing(plan: ShufflePlan, writers: int) -> dict[int, int]:
    """Rank -> output shards of its block not sealed yet (the blocks of `ShardWriter`'s ranks)."""
    staging = staging_dir(plan.root, plan.output)
    n = plan.output.n_shards
    out: dict[int, int] = {}
    for r in range(writers):
        for k in world.share(n, r, writers):
            if not (staging / part_record(k)).exists():
                out[r] = out.get(r, 0) + 1
    return out
