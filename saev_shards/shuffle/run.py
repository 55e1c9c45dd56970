"""Carrying a shuffle out in one machine: the public entry points (`plan_shuffle`,
`shuffle_cache`, `run_plan`), the scratch folder (its lock, its plan, the space it needs,
removing it) and the two passes, in this process or in worker processes.

`ranks` carries out one rank's share of a shuffle over several machines with the same
pieces (`check_space`, `open_writer`, `remove_work`, `remove_stale_work`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

import orjson

from ..errors import AlreadyPublishedError, DiskFullError, ShardsError, WriterBusyError
from ..fileio import check_free_space, fault_point, naming_disk_full, remove_path, take_lock, write_file_atomic
from ..progress import Progress
from ..protocol.jsonfile import strict_json_loads
from ..protocol.staging import staging_dir
from ..reader import Shards
from ..reader import open as open_path
from ..selection import SelectionSpec
from ..store import open_cache, shards_roots
from ..store.roots import SHUFFLE_LOCK_FILE as LOCK_FILE
from ..store.roots import SHUFFLE_PREFIX as WORK_PREFIX
from ..writer import ShardWriter, finalize
from .options import ShuffleOptions, split_keywords, takes_keywords
from .plan import SOURCE_EXAMPLE, SOURCE_TOKEN, ShufflePlan, make_plan
from .scatter import scatter
from .scratch import PLAN_FILE, RUN_DISK_FULL_NOTE, Buffers, load_record, run_file, run_record_file
from .write_pass import write_buckets

__all__ = [
    "check_space",
    "open_writer",
    "plan_shuffle",
    "remove_stale_work",
    "remove_work",
    "run_plan",
    "shuffle_cache",
]

PathLike = str | os.PathLike[str]
#: Called after each step a test may want to interrupt: ("run", chunk) once its run is sealed,
#: ("scattered", 0), ("bucket", bucket) once all its rows are written (reported at the next
#: batch, so the gathering may be a few batches ahead), ("published", 0).
StepHook = Callable[[str, int], None]


@takes_keywords
def plan_shuffle(
    source: Shards | PathLike, root: PathLike | None = None, *, progress: bool | None = False, **keywords: Any
) -> ShufflePlan:
    """What `shuffle_cache` would do, without doing it (``plan.describe()`` says it in words).

    ``source``: a `Shards`, a cache path or a hash (prefix). ``root``: where the output is
    published (default: the folder holding the source). The keywords are the selection's
    (`saev_shards.selection.SelectionSpec`: ``layers``, ``tokens``, ``exclude_token_ids``,
    ``max_norm_multiple``) and the options' (`ShuffleOptions`: ``seed``, ``dtype``,
    ``patches_per_shard``, ``memory_bytes``, ``workers``, ``work_dir``, ``allow_nonfinite``,
    and ``n_buckets`` and ``examples_per_chunk``, which override the sizing drawn from
    ``memory_bytes``; the output does not depend on them). See `shuffle_cache` for what each
    does; `run_plan` carries a plan out.
    """
    spec, options = split_keywords("plan_shuffle", keywords)
    return _plan(source, root, spec, options, progress)


def _plan(
    source: Shards | PathLike,
    root: PathLike | None,
    spec: SelectionSpec,
    options: ShuffleOptions,
    progress: bool | None,
) -> ShufflePlan:
    shards = source if isinstance(source, Shards) else open_cache(source)
    if root is None:  # beside the source; a remote source's output goes to the local shards root
        root = shards.files.local_root or shards_roots()[0].path
    return make_plan(shards, Path(root), spec, options, progress=progress)


@takes_keywords
def shuffle_cache(
    source: Shards | PathLike,
    root: PathLike | None = None,
    *,
    progress: bool | None = None,
    durable: bool = True,
    **keywords: Any,
) -> Shards:
    """Write the chosen tokens of ``source`` in a uniformly random order as a new cache; return it opened.

    Arguments:
        source: a `Shards`, a cache path or a hash (prefix).
        root: where the shuffled cache is published (default: the folder holding the source).
        layers: layer values to keep (None: all); every row holds the token at each of them.
        tokens: ``"content"`` (patches), ``"cls"`` or ``"all"``; padding (positions beyond
            the source's ``lengths`` column) is always skipped.
        exclude_token_ids, max_norm_multiple: the loaders' token masks (`saev_shards.reader.norms`):
            positions whose ``token_ids`` value is listed, and positions whose vector at any
            chosen layer is above ``max_norm_multiple`` times its layer's median norm, are left
            out; the output's ``metadata.data["shuffle"]`` records both and how many each
            dropped (without them the metadata, and so the hash, are what they always were).
        seed: decides the order (with the source and the selection, nothing else).
        dtype: stored dtype of the output (default: the source's).
        patches_per_shard: shard budget of the output (default: the source's).
        memory_bytes: what all processes together may hold; the number of buckets follows.
        workers: processes sharing both passes (the output does not depend on it).
        work_dir: where the scratch runs go (default: ``root``); they need about the output's
            size in free space until the end, and are deleted then.
        allow_nonfinite: store inf/NaN (after the cast) instead of raising `NonFiniteError`.
        progress: progress bars on stderr (default: when stderr is a terminal).
        durable: fsync runs and output (turn off only for throwaway tests).

    The first four are `saev_shards.selection.SelectionSpec`'s fields, the others up to
    ``allow_nonfinite`` `ShuffleOptions`' (``n_buckets`` and ``examples_per_chunk`` too:
    `plan_shuffle`). Run it again after a kill (same arguments) and it resumes; if the
    result is already published it is returned at once.
    """
    spec, options = split_keywords("shuffle_cache", keywords)
    return run_plan(_plan(source, root, spec, options, progress), progress=progress, durable=durable)


def run_plan(
    plan: ShufflePlan, *, progress: bool | None = None, durable: bool = True, after_step: StepHook | None = None
) -> Shards:
    """Carry out ``plan`` (resuming whatever an earlier run of it left) and return the output opened.

    The scratch folder is this shuffle's own: it is removed once the output is published (by
    this process or by another one that got there first), and after an error that a rerun
    of the same plan would meet again (`_keeps_runs`). After a full disk, an interruption or
    another system error only the sealed runs stay, so that running it again resumes;
    `saev-shards clean` removes them once no shuffle holds the folder's lock.
    """
    step = after_step or _no_step
    if plan.path.exists():
        remove_stale_work(plan)  # killed after publishing, before cleaning up
        return open_path(plan.path)
    fault_point("shuffle-checked")  # the race tests pause a second shuffle here
    lock_fd = _lock_work(plan)
    try:
        try:
            # Checked again under the lock: another shuffle of the same plan may have
            # published (and removed this folder with its lock) since the check above.
            if not plan.path.exists():
                _carry_out(plan, progress, durable, step)
        except AlreadyPublishedError:
            pass  # the same bytes, published meanwhile by a shuffle with another scratch folder
        remove_work(plan)
    except BaseException as err:
        if plan.path.exists() or not _keeps_runs(err):
            remove_work(plan)
        raise
    finally:
        os.close(lock_fd)
    return open_path(plan.path)


def _carry_out(plan: ShufflePlan, progress: bool | None, durable: bool, step: StepHook) -> None:
    _adopt_plan(plan, durable)
    check_space(plan)
    buffers = Buffers()  # one mapping for both passes, in this process (`scratch.Buffers`)
    try:
        _scatter_pass(plan, progress, durable, step, buffers)
        step("scattered", 0)
        _write_pass(plan, progress, durable, step, buffers)
    finally:
        buffers.close()
    step("published", 0)


def _lock_work(plan: ShufflePlan) -> int:
    """Take the scratch folder's lock (creating both); `WriterBusyError` when another shuffle holds it.

    A shuffle that publishes removes the folder, lock file included, while it holds the
    lock; `take_lock` then starts over with whatever is at the name now, and a folder that
    disappeared meanwhile is made again (a few times at most: each round is another
    shuffle publishing)."""
    lock = plan.work / LOCK_FILE
    for _ in range(100):
        with naming_disk_full(plan.work):
            plan.work.mkdir(parents=True, exist_ok=True)
            try:
                fd = take_lock(lock)
            except FileNotFoundError:  # the folder was removed between the two calls
                continue
        if fd is None:
            raise WriterBusyError(f"{plan.work}: another process is running this shuffle")
        return fd
    raise WriterBusyError(f"{plan.work}: removed and made again 100 times while taking its lock")


def _keeps_runs(err: BaseException) -> bool:
    """Whether the sealed runs stay after ``err``: an error of this library that a rerun of the
    same plan would meet again, or that makes the runs useless (values not finite, a
    changed or damaged source, runs that fail their digests), removes the scratch folder;
    so does any error once the output is published. A full disk, another process holding
    the output's staging lock, an interruption, a system error or an unexpected one keep
    the sealed runs, so that running the shuffle again resumes from them."""
    if isinstance(err, (DiskFullError, WriterBusyError)):
        return True
    return not isinstance(err, ShardsError)


def _no_step(kind: str, index: int) -> None:
    return None


# --------------------------------------------------------------------------------------
# the work folder


def _adopt_plan(plan: ShufflePlan, durable: bool) -> None:
    """Keep the runs of an earlier run of this plan; discard runs cut for another (e.g. another budget)."""
    path = plan.work / PLAN_FILE
    wanted = plan.to_json()
    try:
        found = strict_json_loads(path.read_bytes())
    except (OSError, ValueError):
        found = None
    if found == wanted:
        return
    for name in os.listdir(plan.work):
        if name.startswith("run"):
            remove_path(plan.work / name)
    write_file_atomic(path, orjson.dumps(wanted), durable, note=RUN_DISK_FULL_NOTE)


def remove_work(plan: ShufflePlan) -> None:
    if plan.work.name.startswith(WORK_PREFIX):  # never delete a folder we did not name
        remove_path(plan.work)


def remove_stale_work(plan: ShufflePlan) -> None:
    """Remove the scratch folder of a published shuffle, unless a shuffle holds its lock (that one removes it)."""
    if not plan.work.is_dir():
        return
    with contextlib.suppress(FileNotFoundError):
        fd = take_lock(plan.work / LOCK_FILE)
        if fd is not None:
            try:
                remove_work(plan)
            finally:
                os.close(fd)


def check_space(plan: ShufflePlan) -> None:
    """Refuse to start when the runs and the output clearly cannot fit (a full disk hours in is worse)."""
    done = sum(
        os.stat(plan.work / run_file(c)).st_size
        for c in range(plan.n_chunks)
        if (plan.work / run_record_file(c)).exists() and (plan.work / run_file(c)).exists()
    )
    scratch = max(0, plan.scratch_nbytes - done)
    staging = staging_dir(plan.root, plan.output)
    written = sum(p.stat().st_size for p in staging.iterdir() if p.is_file()) if staging.is_dir() else 0
    output = max(0, plan.n_tokens * (plan.layout.row_nbytes - 8) - written)  # the sort key is not kept
    plan.root.mkdir(parents=True, exist_ok=True)
    work_dev, root_dev = os.stat(plan.work).st_dev, os.stat(plan.root).st_dev
    needs = {plan.work: scratch + (output if work_dev == root_dev else 0)}
    if work_dev != root_dev:
        needs[plan.root] = output
    what = "the shuffle's scratch runs and output" if len(needs) == 1 else "the shuffle's files"
    for where, need in needs.items():
        check_free_space(where, need, what, "put the scratch runs on another disk (work_dir, --work-dir)")


# --------------------------------------------------------------------------------------
# the two passes, in this process or in several


def _scatter_pass(plan: ShufflePlan, progress: bool | None, durable: bool, step: StepHook, buffers: Buffers) -> None:
    todo = [c for c in range(plan.n_chunks) if load_record(plan.work, c, plan.n_buckets, plan.layout) is None]
    row_bytes = plan.layout.fields[0].row_nbytes
    done_rows = plan.n_tokens - sum(plan.chunk_first[c + 1] - plan.chunk_first[c] for c in todo)
    with Progress(plan.n_tokens * row_bytes, "shuffle 1/2 scatter", enabled=progress) as bar:
        bar.update(done_rows * row_bytes)
        if plan.workers == 1 or len(todo) <= 1:
            scatter(plan, todo, lambda n: bar.update(n * row_bytes), lambda c: step("run", c), durable, buffers)
        else:
            shares = [todo[r :: plan.workers] for r in range(plan.workers)]
            jobs = [(_scatter_worker, (plan, share, durable)) for share in shares if share]
            _in_processes(plan, bar, row_bytes, jobs)


def _write_pass(plan: ShufflePlan, progress: bool | None, durable: bool, step: StepHook, buffers: Buffers) -> None:
    row_bytes = plan.layout.fields[0].row_nbytes
    remover: threading.Thread | None = None
    try:
        with Progress(plan.n_tokens * row_bytes, "shuffle 2/2 write", enabled=progress) as bar:
            if plan.workers == 1 or plan.output.n_shards <= 1:
                with open_writer(plan, 0, 1, durable) as writer:
                    bar.update(writer.next_example * row_bytes)
                    write_buckets(
                        plan, writer, lambda n: bar.update(n * row_bytes), lambda k: step("bucket", k), buffers
                    )
                    remover = _remove_runs(plan)  # while the writer finalizes (see _remove_runs)
                return
            world = min(plan.workers, plan.output.n_shards)
            _in_processes(plan, bar, row_bytes, [(_write_worker, (plan, r, world, durable)) for r in range(world)])
        remover = _remove_runs(plan)
        finalize(plan.root, plan.output, verify=False, durable=durable)
    finally:
        if remover is not None:
            remover.join()


def _remove_runs(plan: ShufflePlan) -> threading.Thread:
    """Delete the runs in a thread of their own, once every output shard is sealed.

    Unlinking gigabytes of runs waits on the filesystem's journal for about a second per
    2.5 GB here, so it overlaps finalizing. A shuffle killed while finalizing scatters again
    when rerun (the runs are gone; the sealed shards are kept).
    """

    def remove() -> None:
        for name in os.listdir(plan.work):
            if name.startswith("run"):
                with contextlib.suppress(OSError):
                    os.unlink(plan.work / name)

    thread = threading.Thread(target=remove, name="saev-shuffle-cleanup")
    thread.start()
    return thread


def open_writer(plan: ShufflePlan, rank: int, world_size: int, durable: bool) -> ShardWriter:
    columns: dict[str, tuple[Any, tuple[int, ...]]] = {}
    for field in plan.layout.fields:
        if field.name in (SOURCE_EXAMPLE, SOURCE_TOKEN):
            columns[field.name] = (field.dtype, ())
        elif field.name.startswith("column."):
            columns[field.name.split(".", 1)[1]] = (field.dtype, ())
    return ShardWriter(
        plan.root,
        plan.output,
        rank=rank,
        world_size=world_size,
        resume=True,
        # The scatter pass checked every value it wrote (unless allowed) and the write pass reads
        # them back against their digests: checking again would cost a pass over every byte.
        allow_nonfinite=True,
        labels=any(f.name == "label" for f in plan.layout.fields),
        columns=columns,
        background=False,  # write_buckets runs the writer in a thread of its own
        durable=durable,
    )


# Worker processes: started with "spawn" (never fork a process that runs threads), each
# reports rows done through a shared counter the parent turns into the progress bar.
_COUNTER: list[Any] = []


def _init_worker(counter: Any) -> None:
    _COUNTER.append(counter)


def _count(n: int) -> None:
    counter = _COUNTER[0]
    with counter.get_lock():
        counter.value += n


def _scatter_worker(plan: ShufflePlan, chunks: list[int], durable: bool) -> None:
    scatter(plan, chunks, _count, lambda c: None, durable)


def _write_worker(plan: ShufflePlan, rank: int, world_size: int, durable: bool) -> None:
    with open_writer(plan, rank, world_size, durable) as writer:
        _count(writer.next_example - writer.start)
        write_buckets(plan, writer, _count, lambda k: None)


def _in_processes(
    plan: ShufflePlan, bar: Progress, row_bytes: int, jobs: list[tuple[Callable[..., None], tuple[Any, ...]]]
) -> None:
    """Run ``jobs`` in processes of their own; the bar follows their shared row counter."""
    context = multiprocessing.get_context("spawn")
    counter = context.Value("q", 0)
    shown = 0
    with ProcessPoolExecutor(len(jobs), mp_context=context, initializer=_init_worker, initargs=(counter,)) as pool:
        futures: list[Future[None]] = [pool.submit(fn, *args) for fn, args in jobs]
        try:
            while not all(f.done() for f in futures):
                time.sleep(0.1)
                value = counter.value
                bar.update((value - shown) * row_bytes)
                shown = value
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    bar.update((counter.value - shown) * row_bytes)
