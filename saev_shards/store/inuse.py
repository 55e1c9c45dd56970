"""Who uses a cache folder: the processes that hold its lock, or have its files open or mapped.

Readers hold a shared ``flock`` on the cache folder while it is open (`reader.handles.FolderLock`).
`users` names them from Linux's ``/proc``: ``/proc/locks`` (the process that took a lock on
the folder), ``/proc/<pid>/fd`` (descriptors of the folder or a file in it: forked workers,
readers without the lock) and ``/proc/<pid>/maps`` (memory-mapped shards). Processes of
other users may be invisible there (``/proc`` hides their descriptors); the lock still
tells that *someone* holds the folder. Elsewhere than Linux the list is empty.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

#: Longest command line shown for a holder.
_COMMAND_CHARS = 80


@dataclasses.dataclass(frozen=True)
class Holder:
    """A process using a cache folder: its pid, its command line (bounded) and how it uses it."""

    pid: int
    command: str
    how: str

    def __str__(self) -> str:
        me = " (this process)" if self.pid == os.getpid() else ""
        return f"pid {self.pid}{me} ({self.command}): {self.how}"


def users(path: Path) -> list[Holder]:
    """The processes using the folder ``path`` (see the module docstring), one entry per pid."""
    folder = Path(os.path.realpath(path))
    found: dict[int, Holder] = {}
    try:
        st = os.stat(folder)
    except OSError:
        return []
    for pid in _lock_holders(st):
        found.setdefault(pid, Holder(pid, _command(pid), "holds the cache's lock"))
    prefix = str(folder) + os.sep
    for pid in _pids():
        if pid in found:
            continue
        how = _open_inside(pid, folder, prefix) or _mapped_inside(pid, prefix)
        if how is not None:
            found[pid] = Holder(pid, _command(pid), how)
    return sorted(found.values(), key=lambda h: h.pid)


def _pids() -> Iterator[int]:
    try:
        names = os.listdir("/proc")
    except OSError:
        return
    yield from (int(n) for n in names if n.isdigit())


def _lock_holders(st: os.stat_result) -> list[int]:
    """Pids that hold an ``flock`` (or another lock) on the file of ``st``, from /proc/locks."""
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                # "1: FLOCK  ADVISORY  READ  1234 08:01:5678 0 EOF"; waiters carry "->" and hold nothing
                if len(parts) >= 6 and "->" not in parts and parts[5] == want and parts[4].lstrip("-").isdigit():
                    pid = int(parts[4])
                    if pid > 0:
                        pids.append(pid)
    except OSError:
        return []
    return pids


def _open_inside(pid: int, folder: Path, prefix: str) -> str | None:
    base = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(base)
    except OSError:
        return None
    for fd in fds:
        try:
            target = os.readlink(f"{base}/{fd}")
        except OSError:
            continue
        if target == str(folder):
            return "has the cache folder open"
        if target.startswith(prefix):
            return f"has {target[len(prefix) :]} open"
    return None


def _mapped_inside(pid: int, prefix: str) -> str | None:
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                at = line.find(prefix)
                if at >= 0:
                    return f"maps {line[at + len(prefix) :].strip()}"
    except OSError:
        return None
    return None


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read(4 * _COMMAND_CHARS)
    except OSError:
        return "?"
    text = " ".join(raw.replace(b"\0", b" ").decode("utf-8", "replace").split()) or "?"  # one line
    return text if len(text) <= _COMMAND_CHARS else text[: _COMMAND_CHARS - 3] + "..."
