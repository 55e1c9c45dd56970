"""A memory limit for a child process and everything it starts: a cgroup of its own (`MemoryLimit`).

The scale suite (`benchmarks/scale.py`) runs each measurement in a child held to a quarter of
its cache's size, so the page cache can hold neither the cache nor the shuffle's scratch
runs: every byte they read comes from the disk, as on a machine whose memory the cache
outgrows. Page cache is charged to the cgroup of the process that reads or writes it, so a
limit on the child's cgroup bounds its page cache as well as its own memory.

Where the limit comes from, in order:

* cgroup v2 (``memory.max``, peak ``memory.peak``) when the unified hierarchy has the memory
  controller: a new cgroup beside this process's own (its parent hands out the memory
  controller), or under it when it may hand it out itself;
* cgroup v1 (``memory.limit_in_bytes``, peak ``memory.max_usage_in_bytes``) on hybrid hosts
  whose memory controller is still on a v1 hierarchy: a new cgroup under this process's own.

`MemoryLimit.create` raises `Unavailable`, saying why, where neither works (no cgroup
filesystem, not root, a read-only mount); the suite then runs without a limit and says so.
The child joins its cgroup before it runs anything (``preexec_fn``), so nothing it allocates
escapes the limit; `MemoryLimit.remove` deletes the cgroup once the child has exited.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Where the kernel says which cgroups a process is in, and where the hierarchies are mounted.
PROC_CGROUP = Path("/proc/self/cgroup")
PROC_MOUNTINFO = Path("/proc/self/mountinfo")


class Unavailable(RuntimeError):
    """No memory limit can be set here; the message says why."""


def _mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """``(mount root, mount point, fstype, super options)`` of each cgroup mount in ``mountinfo``."""
    out = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        out.append((fields[3], fields[4].replace("\\040", " "), tail[0], set(tail[2].split(","))))
    return out


def _memberships(cgroup: str) -> dict[str, str]:
    """This process's cgroup path per hierarchy: ``"v2"`` for the unified one, else each v1
    controller's name (``"memory"``)."""
    out: dict[str, str] = {}
    for line in cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            out["v2"] = path
        for name in controllers.split(","):
            if name:
                out[name] = path
    return out


def _under(mount_root: str, point: str, path: str) -> Path:
    """Where cgroup ``path`` (as /proc/self/cgroup names it) is in a hierarchy mounted at ``point``."""
    root = mount_root.rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root) :]
    return Path(point) / path.lstrip("/")


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def locate(proc_cgroup: str | None = None, mountinfo: str | None = None) -> tuple[int, Path]:
    """``(version, folder)``: where a new memory-limited cgroup can be made for a child of this
    process; `Unavailable` (saying why) where none can.

    v2 first: beside this process's cgroup when its parent delegates the memory controller (a
    cgroup with processes of its own may not, the "no internal processes" rule), else under
    it when it is the root or already delegates it. Then v1: under this process's own.
    """
    try:
        proc_cgroup = PROC_CGROUP.read_text() if proc_cgroup is None else proc_cgroup
        mountinfo = PROC_MOUNTINFO.read_text() if mountinfo is None else mountinfo
    except OSError as e:
        raise Unavailable(f"cannot read /proc ({e.strerror})") from None
    member = _memberships(proc_cgroup)
    mounts = _mounts(mountinfo)
    reasons = []
    v2 = [(r, p) for r, p, kind, _ in mounts if kind == "cgroup2"]
    if v2 and "v2" in member:
        own = _under(*v2[0], member["v2"])
        controllers = _read_words(own / "cgroup.controllers")
        if "memory" not in controllers:
            reasons.append(f"cgroup v2 at {v2[0][1]} has no memory controller here")
        else:
            candidates = [own.parent] if member["v2"] not in ("", "/") else []
            candidates.append(own)
            for folder in candidates:
                if _delegates_memory(folder):
                    return 2, folder
            reasons.append(f"cannot enable the memory controller under {own} (processes in it, or not root)")
    elif not v2:
        reasons.append("no cgroup v2 hierarchy mounted")
    v1 = [(r, p) for r, p, kind, opts in mounts if kind == "cgroup" and "memory" in opts]
    if v1 and "memory" in member:
        own = _under(*v1[0], member["memory"])
        if (own / "memory.limit_in_bytes").exists() and os.access(own, os.W_OK):
            return 1, own
        reasons.append(f"cgroup v1 memory hierarchy at {own} is not writable")
    elif not v1:
        reasons.append("no cgroup v1 memory hierarchy mounted")
    raise Unavailable("; ".join(reasons))


def _read_words(path: Path) -> set[str]:
    try:
        return set(path.read_text().split())
    except OSError:
        return set()


def _delegates_memory(folder: Path) -> bool:
    """Whether ``folder``'s children get the memory controller (enabling it when it can)."""
    if "memory" in _read_words(folder / "cgroup.subtree_control"):
        return os.access(folder, os.W_OK)
    try:
        _write(folder / "cgroup.subtree_control", "+memory")
    except OSError:
        return False
    return "memory" in _read_words(folder / "cgroup.subtree_control")


class MemoryLimit:
    """A cgroup of its own holding ``limit`` bytes (memory and page cache together) for the
    children started by `run` or `popen`; `peak` is the most it held, `oom_kills` how many
    processes the limit killed. Use as a context manager, or call `remove`."""

    def __init__(self, version: int, path: Path, limit: int) -> None:
        self.version = version
        self.path = path
        self.limit = int(limit)

    @classmethod
    def create(cls, limit: int, name: str | None = None, where: tuple[int, Path] | None = None) -> MemoryLimit:
        """A new cgroup limited to ``limit`` bytes (`Unavailable` where none can be made)."""
        version, folder = locate() if where is None else where
        path = folder / (name or f"saev-bench-{os.getpid()}-{time.monotonic_ns()}")
        try:
            path.mkdir()
        except OSError as e:
            raise Unavailable(f"cannot create a cgroup in {folder}: {e.strerror}") from None
        made = cls(version, path, limit)
        try:
            if version == 2:
                _write(path / "memory.max", str(made.limit))
                with contextlib.suppress(OSError):  # no swap, or no swap accounting: nothing to cap
                    _write(path / "memory.swap.max", "0")
            else:
                _write(path / "memory.limit_in_bytes", str(made.limit))
                with contextlib.suppress(OSError):  # memsw exists only with swap accounting
                    _write(path / "memory.memsw.limit_in_bytes", str(made.limit))
        except OSError as e:
            made.remove()
            raise Unavailable(f"cannot set a memory limit in {path}: {e.strerror}") from None
        return made

    @property
    def kind(self) -> str:
        """What holds the limit, for tables: ``cgroup v2 memory.max`` or ``cgroup v1 memory.limit_in_bytes``."""
        return "cgroup v2 memory.max" if self.version == 2 else "cgroup v1 memory.limit_in_bytes"

    def join(self) -> None:
        """Move the calling process into the cgroup (a child's ``preexec_fn``: before it runs anything)."""
        _write(self.path / "cgroup.procs", str(os.getpid()))

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside the cgroup (it and everything it starts)."""
        return subprocess.Popen(list(argv), preexec_fn=self.join, **kwargs)  # noqa: PLW1509 (no threads run here)

    def run(self, argv: Sequence[str], timeout: float | None = None, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` inside the cgroup to the end (killed after ``timeout`` seconds)."""
        with self.popen(argv, **kwargs) as proc:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def _read_int(self, name: str) -> int | None:
        try:
            return int((self.path / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def usage(self) -> int | None:
        """Bytes the cgroup holds now (its processes' memory and the page cache charged to it)."""
        return self._read_int("memory.current" if self.version == 2 else "memory.usage_in_bytes")

    def peak(self) -> int | None:
        """The most bytes the cgroup held since it was made (None where the kernel does not say:
        ``memory.peak`` came with Linux 5.19)."""
        return self._read_int("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes")

    def oom_kills(self) -> int:
        """Processes the limit's out-of-memory killer ended in this cgroup."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        with contextlib.suppress(OSError):
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def remove(self, timeout: float = 10.0) -> None:
        """Delete the cgroup, once the processes left in it (none, after `run`) have exited.

        Page cache charged to it stays cached, charged to the parent from then on (v1) or to
        the removed cgroup until reclaimed (v2): the suite drops its files' pages itself.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def __enter__(self) -> MemoryLimit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
