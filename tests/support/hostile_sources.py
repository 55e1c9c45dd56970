"""Hostile conversion sources (`source_catalogue`: one catalogue per converter) and the rule
every conversion must follow, checked in a child process under a wall-clock and a memory limit.

Each case builds a source (a valid one from `sources`, then damaged the way its own adversary
would: a FIFO or a link to /dev/zero where a file should be, a gzip bomb, a 30-byte pickle
asking for gigabytes, a store declaring 10^9 samples in 3 KB, numbers beyond 64 bits,
fractions where integers belong, layer keys that collide...). `run_case` converts it in a
child forked from a clean server process (never in the test process: a hang, a runaway
allocation or a crash stays there), with ``RLIMIT_AS`` set to what the child already maps
plus `CASE_MEMORY`, and kills it after `CASE_SECONDS`. The rule (`check_outcome`): the
conversion publishes a cache that opens and verifies, or raises a `ShardsError`; nothing is
published half-made, the source is left as it was and nothing is written outside the root.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing as mp
import os
import resource
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Wall-clock bound of one case: far above the ~0.1 s a small conversion takes, far below "forever".
CASE_SECONDS = 60.0
#: Address space a case may add to what its child maps when it starts.
CASE_MEMORY = 1536 << 20
#: The memory budget the cases convert with (`Options.memory_bytes`): caps far below the limit.
CASE_BUDGET = 256 << 20

# --------------------------------------------------------------------------------------
# running a case in a child


@dataclasses.dataclass(frozen=True)
class CaseOutcome:
    """How a case ended: ``kind`` "ok" (``detail``: the published path), the exception's class
    name (``shards_error``: it is a `ShardsError`; ``detail``: its message, or the traceback
    for any other exception), "hang", or "died" (a signal or an exit code)."""

    kind: str
    shards_error: bool = False
    detail: str = ""

    @property
    def follows_the_rule(self) -> bool:
        return self.kind == "ok" or self.shards_error


@functools.cache
def _context() -> Any:
    """A forkserver: children fork from a process that has imported the converters' libraries
    but started no thread (zarr's event loop thread would not survive a fork from here)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["numpy", "saev_shards", "saev_shards.convert", "zarr", "datasets", "pyarrow"])
    return ctx


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _child(send: Any, fn: Callable[..., str], args: tuple[Any, ...], memory: int) -> None:
    limit = _vm_bytes() + memory
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import saev_shards as ss

    try:
        result = fn(*args)
    except BaseException as err:
        detail = str(err) if isinstance(err, ss.ShardsError) else traceback.format_exc()
        send.send((type(err).__name__, isinstance(err, ss.ShardsError), detail[-4000:]))
    else:
        send.send(("ok", False, result))


def run_case(
    fn: Callable[..., str], *args: Any, seconds: float = CASE_SECONDS, memory: int = CASE_MEMORY
) -> CaseOutcome:
    """``fn(*args)`` in a child limited to ``memory`` more bytes of address space and ``seconds``."""
    ctx = _context()
    recv, send = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child, args=(send, fn, args, memory), daemon=True)
    process.start()
    send.close()
    got = recv.poll(seconds)
    if not got:
        process.kill()
        process.join()
        recv.close()
        return CaseOutcome("hang", False, f"still running after {seconds} s")
    try:
        kind, shards_error, detail = recv.recv()
    except EOFError:
        process.join()
        recv.close()
        return CaseOutcome("died", False, f"exit code {process.exitcode}")
    process.join(seconds)
    if process.is_alive():  # answered, then could not exit: a thread that never stops
        process.kill()
        process.join()
        return CaseOutcome("hang", False, f"answered {kind}, then did not exit within {seconds} s")
    recv.close()
    return CaseOutcome(kind, shards_error, detail)


def convert_in_child(src: str, root: str, kind: str | None, options: dict[str, Any]) -> str:
    """The case itself (run in the child): convert, then open and verify what was published."""
    import saev_shards as ss
    from saev_shards.convert import Options, convert

    result = convert(src, kind=kind, root=root, options=Options(**options), progress=False, durable=False)
    ss.open(result.path).verify()
    return str(result.path)


# --------------------------------------------------------------------------------------
# what must hold after a case


def tree_listing(path: Path) -> dict[str, tuple[str, int]]:
    """Every entry under ``path`` (links not followed): its kind and size (regular files)."""
    out: dict[str, tuple[str, int]] = {}
    if not os.path.lexists(path):
        return out
    for here, dirs, names in os.walk(path):
        for name in [*dirs, *names]:
            p = Path(here) / name
            st = os.lstat(p)
            kind = "link" if p.is_symlink() else "dir" if p.is_dir() else "file" if p.is_file() else "other"
            out[str(p.relative_to(path))] = (kind, st.st_size if kind == "file" else 0)
    return out


def check_outcome(case: str, outcome: CaseOutcome, folder: Path, before: dict[str, tuple[str, int]]) -> None:
    """The rule for one case (``folder`` holds ``src`` and ``root`` only; ``before`` is the
    source's listing before the case): a documented outcome in bounded time and memory,
    nothing published half-made, the source untouched, nothing written beside the root."""
    import saev_shards as ss

    assert outcome.follows_the_rule, f"{case}: {outcome.kind}: {outcome.detail}"
    assert sorted(p.name for p in folder.iterdir()) in (["src"], ["root", "src"]), f"{case}: wrote beside the root"
    assert tree_listing(folder / "src") == before, f"{case}: the source changed"
    root = folder / "root"
    for entry in root.iterdir() if root.is_dir() else []:
        if not entry.name.startswith("."):  # published: it must be whole
            ss.open(entry).verify()
