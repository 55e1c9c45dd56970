"""How the ranks of a shuffle meet (`saev_shards.shuffle.ranks`): agree on their arguments,
wait for each other at each step, and hear of each other's failures.

**Through torch.distributed.** Where a process group of this rank and size is initialised
(torchrun, or any launcher that sets one up: ``saev-shards shuffle`` makes a gloo group
itself when torchrun's variables are set, `torch_group_from_env`), through collectives on
a gloo group of the shuffle's own: one ``all_gather`` of the arguments (every rank sees
every difference and refuses), then at each meeting point a ``monitored_barrier`` bounded
by ``wait`` (it names the ranks that did not arrive) and an ``all_gather`` of each rank's
outcome, so that a rank's failure stops every rank at once. Every rank then waits for the
publication and returns the output. MosaicML streaming and litdata coordinate their ranks
the same way (barriers and broadcasts of the shared state through the process group), and
keep files for what has no group.

**Through files.** Without a process group (a SLURM array, ranks started by hand), in a
rendezvous folder beside the work folder, ``.shuffle-ranks-<source hash>`` (with
``-job<SLURM_ARRAY_JOB_ID>`` inside a SLURM array, so two arrays never meet): each running
rank holds ``rank-<R>.lock`` and has written its arguments to ``rank-<R>.json``; a rank
joining compares its arguments with every running rank's, and a refused rank's record
stays, so that the others can say what it was started with. At a meeting point a rank
polls the work folder, shows what it waits for (a progress bar, and the ranks it waits on,
running or not), and gives up with a `ShuffleError` naming the missing ranks after
``wait`` seconds without progress; a rank with nothing left to do returns without waiting.
Each rank removes its records as it leaves, and the last one the folder.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson

from .. import world
from ..errors import ShuffleError, WriterBusyError
from ..fileio import remove_path, take_lock, try_flock, write_file_atomic
from ..progress import Progress
from ..store.roots import SHUFFLE_LOCK_FILE as LOCK_FILE
from ..store.roots import SHUFFLE_RANKS_PREFIX
from .plan import ShufflePlan

#: Seconds a rank waits for the others without progress before it gives up (``wait``).
DEFAULT_WAIT = 1800.0
#: Prefix of the rendezvous folder of the file path (`saev-shards ls` and `clean` list it as
#: the shuffle ranks' meeting folder, live while a rank holds its lock).
RENDEZVOUS_PREFIX = SHUFFLE_RANKS_PREFIX
#: Seconds a starting rank retries its lock (another rank may be looking at it that instant).
_LOCK_RETRY_SECONDS = 2.0
#: The arguments in the order differences are named (`ranks.arguments` makes them).
_ARGUMENT_ORDER = (
    "source", "layers", "tokens", "exclude_token_ids", "max_norm_multiple", "seed", "dtype", "patches_per_shard",
    "allow_nonfinite", "memory_bytes", "workers", "n_buckets", "examples_per_chunk", "world_size", "plan",
)  # fmt: skip


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


class Meeting:
    """Where the ranks of one shuffle agree and wait for each other (the module docstring)."""

    #: Whether every rank waits for the publication and returns the output.
    everyone_returns = False

    def __init__(self, plan: ShufflePlan, rank: int, world_size: int, wait: float, say: Callable[[str], None]):
        self.plan = plan
        self.rank = rank
        self.world_size = world_size
        self.wait = wait
        self.say = say

    def __enter__(self) -> Meeting:
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


def torch_group(rank: int, world_size: int, sync: str) -> Any:
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


class TorchMeeting(Meeting):
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


class FileMeeting(Meeting):
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
