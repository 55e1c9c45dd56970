"""The shuffle over several processes or machines: rank ``R`` of ``W``, one shared work folder.

Every rank runs `run_rank` with the same arguments; the work folder (``work_dir``, default
the output's root) and the output's root must be on a filesystem every rank shares:

1. **Agree.** The ranks meet (`Meeting`, below) and compare their arguments (`arguments`:
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

**How the ranks meet.** Where ``torch.distributed`` has a process group of this rank and
size (torchrun, or any launcher that sets one up: ``saev-shards shuffle`` makes a gloo group
itself when torchrun's variables are set), through its collectives on a gloo group of their
own: one ``all_gather`` of the arguments (every rank sees every difference and refuses),
then at each meeting point a ``monitored_barrier`` bounded by ``wait`` (it names the ranks
that did not arrive) and an ``all_gather`` of each rank's outcome, so that a rank's failure
stops every rank at once. Every rank then waits for the publication and returns the output.
MosaicML streaming and litdata coordinate their ranks the same way (barriers and broadcasts
of the shared state through the process group), and keep files for what has no group.

Without a process group (a SLURM array, ranks started by hand), through files in a
rendezvous folder beside the work folder, ``.shuffle-ranks-<source hash>`` (with
``-job<SLURM_ARRAY_JOB_ID>`` inside a SLURM array, so two arrays never meet): each running
rank holds ``rank-<R>.lock`` and has written its arguments to ``rank-<R>.json``; a rank
joining compares its arguments with every running rank's. At steps 4 and 6 a rank polls
the work folder, shows what it waits for (a progress bar, and the ranks it waits on,
running or not), and gives up with a `ShuffleError` naming the missing ranks after
``wait`` seconds without progress; a rank with nothing left to do returns without waiting.
Each rank removes its records as it leaves, and the last one the folder.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson

from .. import world
from ..errors import AlreadyPublishedError, ShuffleError, WriterBusyError
from ..fileio import fault_point, remove_path, take_lock, try_flock, write_file_atomic
from ..format import strict_json_loads
from ..progress import Progress
from ..protocol.staging import lock_path, part_record, staging_dir
from ..reader import Shards
from ..reader import open as open_path
from ..store.roots import SHUFFLE_LOCK_FILE as LOCK_FILE
from ..store.roots import SHUFFLE_PREFIX
from ..writer import finalize
from .append import write_buckets
from .plan import ShufflePlan
from .runs import PLAN_FILE, RUN_DISK_FULL_NOTE, load_record, run_record_file
from .scatter import scatter

#: Seconds between two looks at what the other ranks have sealed (the file path).
POLL_SECONDS = 0.5
#: Seconds a rank waits for the others without progress before it gives up (``wait``).
DEFAULT_WAIT = 1800.0
#: How ranks meet: `run_rank`'s ``sync``.
SYNCS = ("auto", "torch", "files")
#: Prefix of the rendezvous folder of the file path (a `SHUFFLE_PREFIX` folder: `saev-shards
#: clean` lists it, live while a rank holds its lock).
RENDEZVOUS_PREFIX = f"{SHUFFLE_PREFIX}ranks-"
#: Seconds a starting rank retries its lock (another rank may be looking at it that instant).
_LOCK_RETRY_SECONDS = 2.0
#: Arguments that name the output; the rest size the passes (`arguments`).
_ARGUMENT_ORDER = (
    "source", "layers", "tokens", "exclude_token_ids", "max_norm_multiple", "seed", "dtype", "patches_per_shard",
    "allow_nonfinite", "memory_bytes", "workers", "n_buckets", "examples_per_chunk", "world_size", "plan",
)  # fmt: skip


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


def differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """``"seed: 7 here, 8 there"`` for each argument that differs (the plan only when nothing
    else does: it follows from the rest)."""
    out = [
        f"{key}: {_short(mine.get(key))} here, {_short(theirs.get(key))} there"
        for key in _ARGUMENT_ORDER
        if key != "plan" and mine.get(key) != theirs.get(key)
    ]
    if not out and mine != theirs:
        out.append("the plans differ (another version of saev-shards?)")
    return out


def _short(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
    in words, what the rank waits for whenever that changes. Raises `ShuffleError` at once
    for a rank outside ``[0, world_size)`` and for arguments that differ from a running rank's.
    """
    rank, world_size = world.check(rank, world_size, ShuffleError)
    wait = _check_wait(wait)
    if sync not in SYNCS:
        raise ShuffleError(f"sync: expected one of {list(SYNCS)}, found {sync!r}")
    say = on_wait or (lambda text: None)
    group = _torch_group(rank, world_size, sync)
    meeting: _Meeting
    if group is not None:
        meeting = _TorchMeeting(plan, rank, world_size, wait, say, group)
    else:
        meeting = _FileMeeting(plan, rank, world_size, wait, say, poll, progress)
    with meeting:
        meeting.agree(orjson.loads(orjson.dumps(arguments(plan, world_size))))  # as JSON: records compare equal
        return _run(plan, meeting, progress, durable)


def _run(plan: ShufflePlan, meeting: _Meeting, progress: bool | None, durable: bool) -> Shards | None:
    from . import _check_space, _open_writer, _remove_stale_work

    rank, world_size = meeting.rank, meeting.world_size
    if meeting.published(plan.path.exists()):
        if rank == 0:
            _remove_stale_work(plan)  # rank 0 killed after publishing, before cleaning up
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
            _check_space(plan)

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
                _open_writer(plan, rank, writers, durable) as writer,
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


def _published_meanwhile(plan: ShufflePlan, meeting: _Meeting) -> Shards | None:
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
    from . import _remove_work

    _remove_work(plan)
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


# --------------------------------------------------------------------------------------
# how the ranks meet


class _Meeting:
    """Where the ranks of one shuffle agree and wait for each other (the module docstring)."""

    #: Whether every rank waits for the publication and returns the output.
    everyone_returns = False

    def __init__(self, plan: ShufflePlan, rank: int, world_size: int, wait: float, say: Callable[[str], None]):
        self.plan = plan
        self.rank = rank
        self.world_size = world_size
        self.wait = wait
        self.say = say

    def __enter__(self) -> _Meeting:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        return None

    def agree(self, mine: dict[str, Any]) -> None:
        raise NotImplementedError

    def published(self, here: bool) -> bool:
        """Whether the output is published (``here``: as this rank sees it)."""
        return here

    def step(
        self,
        name: str,
        error: BaseException | None,
        pending: Callable[[], dict[int, int]] | None = None,
        what: str = "",
        waits: bool = True,
    ) -> None:
        """Meeting point ``name``: raise this rank's ``error``, or the failure of another rank;
        return once ``pending()`` (rank -> items not done) is empty, if this rank ``waits``."""
        raise NotImplementedError


def _torch_group(rank: int, world_size: int, sync: str) -> Any:
    """torch.distributed (the module) when the ranks meet through it, else None."""
    dist = sys.modules.get("torch.distributed")
    if sync == "torch" and dist is None:
        import torch.distributed as dist
    initialised = dist is not None and dist.is_available() and dist.is_initialized()
    if sync == "files" or (sync == "auto" and not initialised):
        return None
    if not initialised:
        raise ShuffleError("sync='torch': expected an initialised torch.distributed process group, found none")
    assert dist is not None
    found = (dist.get_rank(), dist.get_world_size())
    if found != (rank, world_size):
        raise ShuffleError(
            f"rank {rank} of {world_size}: the torch.distributed process group says rank {found[0]} of {found[1]}; "
            "give the group's rank and size (or leave them out on the command line), or sync='files'"
        )
    return dist


class _TorchMeeting(_Meeting):
    """Through a process group: all_gather of the arguments, then at each meeting point a
    monitored barrier bounded by ``wait`` and an all_gather of every rank's outcome."""

    everyone_returns = True

    def __init__(
        self, plan: ShufflePlan, rank: int, world_size: int, wait: float, say: Callable[[str], None], dist: Any
    ) -> None:
        super().__init__(plan, rank, world_size, wait, say)
        self.dist = dist
        # A gloo group of our own (monitored_barrier is gloo's; the job's group may be NCCL),
        # its collectives bounded by `wait`. Every rank runs this line: new_group is collective.
        try:
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=wait))
        except RuntimeError as err:
            raise ShuffleError(
                f"rank {rank} of {world_size}: the other ranks did not all start the shuffle within {wait:g} s "
                f"(making its gloo group, torch.distributed: {err})"
            ) from err

    def close(self) -> None:
        with contextlib.suppress(Exception):  # a group broken by a failed rank cannot always be destroyed
            self.dist.destroy_process_group(self.group)

    def _gather(self, value: object, name: str) -> list[Any]:
        found: list[Any] = [None] * self.world_size
        try:
            self.dist.all_gather_object(found, value, group=self.group)
        except RuntimeError as err:
            where = f"rank {self.rank} of {self.world_size}"
            raise ShuffleError(f"{where}: the ranks could not meet at {name} (torch.distributed: {err})") from err
        return found

    def agree(self, mine: dict[str, Any]) -> None:
        found = self._gather(mine, "the start")
        problems = [
            f"rank {r}: " + "; ".join(differences(mine, theirs))
            for r, theirs in enumerate(found)
            if r != self.rank and theirs != mine
        ]
        if problems:
            raise ShuffleError(
                f"rank {self.rank} of {self.world_size}: the ranks of one shuffle need the same arguments, and "
                f"these ranks have others: {' | '.join(problems)}; start every rank with the same arguments"
            )

    def published(self, here: bool) -> bool:
        return any(self._gather(here, "a look for the output"))

    def step(
        self,
        name: str,
        error: BaseException | None,
        pending: Callable[[], dict[int, int]] | None = None,
        what: str = "",
        waits: bool = True,
    ) -> None:
        if pending is not None:  # a step the others may take a while to finish
            self.say(f"{name} done: waiting for the other ranks (at most {self.wait:g} s)")
        try:
            self.dist.monitored_barrier(
                group=self.group, timeout=datetime.timedelta(seconds=self.wait), wait_all_ranks=True
            )
        except RuntimeError as err:
            raise ShuffleError(
                f"rank {self.rank} of {self.world_size}: not every rank reached {name} within {self.wait:g} s "
                f"(torch.distributed: {err}); a rank that failed says why in its own output"
            ) from err
        self._outcomes(name, error)
        if pending is not None:
            left = pending()  # every rank has sealed its share: all of it should be in the shared folder
            missing = None
            if left:
                missing = ShuffleError(
                    f"{self.plan.work}: {sum(left.values())} {what} of ranks {sorted(left)} are missing although "
                    "every rank finished this step: is the work folder (and the output's root) on a filesystem "
                    "every rank shares?"
                )
            self._outcomes(name, missing)

    def _outcomes(self, name: str, error: BaseException | None) -> None:
        """Every rank's outcome of step ``name``: this rank's error raised, else another's failure."""
        outcomes = self._gather(None if error is None else f"{type(error).__name__}: {error}", name)
        if error is not None:
            raise error
        failed = [f"rank {r}: {o}" for r, o in enumerate(outcomes) if o is not None]
        if failed:
            raise ShuffleError(
                f"rank {self.rank} of {self.world_size}: stopping at {name}, another rank failed: {' | '.join(failed)}"
            )


class _FileMeeting(_Meeting):
    """Through files: rank records in a rendezvous folder, and polls of the work folder."""

    def __init__(
        self,
        plan: ShufflePlan,
        rank: int,
        world_size: int,
        wait: float,
        say: Callable[[str], None],
        poll: float,
        progress: bool | None,
    ) -> None:
        super().__init__(plan, rank, world_size, wait, say)
        self.poll = poll
        self.progress = progress
        self.folder = rendezvous_folder(plan)
        self.shared: int | None = None
        self.mine: int | None = None
        self.mine_args: dict[str, Any] = {}
        self.keep_record = False

    # -- joining and leaving -------------------------------------------------------------
    def _join(self) -> None:
        deadline = time.monotonic() + _LOCK_RETRY_SECONDS
        while self.shared is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):  # the last rank out removed the folder meanwhile
                self.shared = take_lock(self.folder / LOCK_FILE, shared=True)
            if self.shared is None:
                if time.monotonic() > deadline:
                    raise ShuffleError(f"{self.folder}: could not join the ranks' rendezvous folder (held)")
                time.sleep(0.05)
        while True:
            self.mine = take_lock(self.folder / f"rank-{self.rank}.lock")
            if self.mine is not None:
                return
            if time.monotonic() > deadline:  # not another rank's look for an instant: running
                raise WriterBusyError(
                    f"{self.folder}: rank {self.rank} of this shuffle is already running (it holds "
                    f"rank-{self.rank}.lock); one process per rank"
                )
            time.sleep(0.05)

    def close(self) -> None:
        if self.mine is not None:
            if not self.keep_record:  # refused: the record stays, so the others can say why
                for name in (f"rank-{self.rank}.json", f"rank-{self.rank}.lock"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.folder / name)
            os.close(self.mine)
            self.mine = None
        if self.shared is not None:
            os.close(self.shared)
            self.shared = None
            with contextlib.suppress(FileNotFoundError):
                last = take_lock(self.folder / LOCK_FILE)  # no other rank here: the folder goes
                if last is not None:
                    try:
                        remove_path(self.folder)
                    finally:
                        os.close(last)

    # -- agreeing ------------------------------------------------------------------------
    def agree(self, mine: dict[str, Any]) -> None:
        self._join()
        self.mine_args = mine
        record = {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "work": str(self.plan.work)}
        write_file_atomic(self.folder / f"rank-{self.rank}.json", orjson.dumps({**record, "arguments": mine}), False)
        problems = [
            f"rank {r} ({rec.get('host')}, pid {rec.get('pid')}): " + "; ".join(differences(mine, rec["arguments"]))
            for r, rec in self._records().items()
            if r != self.rank and self._running(r) and rec.get("arguments") != mine
        ]
        if problems:
            self.keep_record = True
            raise ShuffleError(
                f"rank {self.rank} of {self.world_size}: refused, running ranks of this shuffle (of source "
                f"{mine['source'][:12]}, in {self.folder}) were started with other arguments: {' | '.join(problems)}; "
                "start every rank with the same arguments"
            )

    def _records(self) -> dict[int, dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        try:
            names = os.listdir(self.folder)
        except FileNotFoundError:
            return out
        for name in names:
            if not (name.startswith("rank-") and name.endswith(".json")):
                continue
            try:
                rec = json.loads((self.folder / name).read_bytes())
                out[int(rec["rank"])] = rec
            except (OSError, ValueError, KeyError, TypeError):
                continue  # half written, or removed as we read: looked at again at the next poll
        return out

    def _running(self, rank: int) -> bool:
        """Whether a process holds rank ``rank``'s lock (taken for an instant to find out: a
        rank starting in that instant retries)."""
        try:
            fd = os.open(self.folder / f"rank-{rank}.lock", os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            return not try_flock(fd)
        finally:
            os.close(fd)

    # -- waiting -------------------------------------------------------------------------
    def step(
        self,
        name: str,
        error: BaseException | None,
        pending: Callable[[], dict[int, int]] | None = None,
        what: str = "",
        waits: bool = True,
    ) -> None:
        if error is not None:
            raise error
        if pending is None or not waits:
            return
        left = pending()
        if not left:
            return
        total = sum(left.values())
        shown = total
        last_progress = time.monotonic()
        told = ""
        with Progress(total, f"rank {self.rank}: waiting for {what}", unit=what, enabled=self.progress) as bar:
            while left and not self.plan.path.exists():
                now = time.monotonic()
                count = sum(left.values())
                if count < shown:
                    bar.update(shown - count)
                    shown, last_progress = count, now
                status = self._status(left)
                if status != told:
                    self.say(f"waiting for {count} {what} of {status}")
                    told = status
                if now - last_progress > self.wait:
                    raise ShuffleError(
                        f"rank {self.rank} of {self.world_size}: gave up after {self.wait:g} s without progress, "
                        f"waiting for {count} {what} of {status} (work folder {self.plan.work}); start the missing "
                        "ranks with the same arguments (a killed rank resumes where it stopped), or give a longer "
                        "wait (--wait)"
                    )
                time.sleep(self.poll)
                left = pending()

    def _status(self, left: dict[int, int]) -> str:
        """``"rank 1 (running), rank 2 (not running; last started with seed: 8 ...)"``."""
        records = self._records()
        parts = []
        for r in sorted(left):
            if self._running(r):
                parts.append(f"rank {r} (running)")
                continue
            rec = records.get(r)
            note = "not running"
            if rec is not None and rec.get("arguments") != self.mine_args:
                note += "; last started with other arguments: " + "; ".join(
                    differences(self.mine_args, rec.get("arguments") or {})
                )
            parts.append(f"rank {r} ({note})")
        return ", ".join(parts)


def rendezvous_folder(plan: ShufflePlan) -> Path:
    """Where the ranks of a shuffle of ``plan``'s source meet without a process group: beside the
    work folder, named for the source (and the SLURM array job, inside one)."""
    job = os.environ.get("SLURM_ARRAY_JOB_ID", "")
    suffix = f"-job{job}" if job.isdigit() else ""
    return plan.work.parent / f"{RENDEZVOUS_PREFIX}{plan.source.metadata.hash[:16]}{suffix}"


@contextlib.contextmanager
def torch_group_from_env(world_: world.World, wait: float) -> Iterator[bool]:
    """Under torchrun (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE`` set, more than
    one rank, and torch installed), a gloo process group for the command line's shuffle, its
    calls bounded by ``wait``: yields True inside it (destroyed at the end), else False."""
    env = os.environ
    wanted = (
        world_.world_size > 1
        and world_.source == "RANK/WORLD_SIZE"
        and all(name in env for name in ("MASTER_ADDR", "MASTER_PORT"))
    )
    dist: Any = None
    if wanted:
        try:
            import torch.distributed as dist
        except ImportError:
            dist = None
    if dist is None or not dist.is_available() or dist.is_initialized():
        yield False
        return
    try:
        dist.init_process_group(
            "gloo", rank=world_.rank, world_size=world_.world_size, timeout=datetime.timedelta(seconds=wait)
        )
    except (RuntimeError, ValueError) as err:
        raise ShuffleError(
            f"rank {world_.rank} of {world_.world_size}: could not join torchrun's process group at "
            f"{env['MASTER_ADDR']}:{env['MASTER_PORT']} ({err})"
        ) from err
    try:
        yield True
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
