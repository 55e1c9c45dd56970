"""Fault injection for the reliability suites (crashes, races, disk full, concurrency).

* Processes are forked (cheap: no interpreter start) and stopped at the library's named
  points (`saev_shards.fileio.fault_point`): killed with SIGKILL, or paused until the
  test lets them go, so every interleaving is reached deterministically, not by sleeps.
* Children that must see file modes run as uid/gid 65534 ("nobody"), because root
  ignores modes (that is how a read-only file in a killed finalize once hid a bug).
* `small_filesystem` mounts a real tmpfs of a few MiB so ENOSPC is the kernel's own.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import saev_shards as ss
from saev_shards import fileio

from .caches import float_input, labels_for, logical_tensor, small_metadata, tree_bytes

#: The unprivileged user the mode-sensitive children run as.
NOBODY = 65534
#: A child that neither finishes nor reaches its point within this many seconds is a hang.
CHILD_TIMEOUT = 120.0

Hook = Callable[[str, int], None]

# --------------------------------------------------------------------------------------
# the cache every suite writes: 12 shards of 5 examples (the last holds 4), with labels,
# a column, text and statistics, so every step of writing and finalizing happens


def fault_metadata(**changes: Any) -> ss.Metadata:
    return small_metadata(n_examples=59, **changes)


def _fault_writer(root: Path, md: ss.Metadata, **kwargs: Any) -> ss.ShardWriter:
    """A writer of the fault-suite cache: labels, a lengths column, text and statistics."""
    columns = {"lengths": (np.int16, ())}
    return ss.ShardWriter(root, md, labels=True, columns=columns, text=["prompt"], stats=True, **kwargs)


def _feed(w: ss.ShardWriter, md: ss.Metadata, batch: int, pause: float = 0.0) -> None:
    """Write the writer's examples from where it resumes to its share's end, ``batch`` at a time."""
    source = float_input(md, logical_tensor(md))
    labels = labels_for(md)
    lengths = (np.arange(md.n_examples) % md.tokens_per_ex + 1).astype(np.int16)
    for a in range(w.next_example, w.stop, batch):
        b = min(a + batch, w.stop)
        w.write(
            source[a:b],
            labels=labels[a:b],
            columns={"lengths": lengths[a:b]},
            text={"prompt": [f"example {i}: é" for i in range(a, b)]},
        )
        time.sleep(pause)


def write_run(
    root: Path, md: ss.Metadata, resume: bool, *, batch: int = 4, durable: bool = False, pause: float = 0.0
) -> str:
    """Write (or, with ``resume``, finish) the fault-suite cache; returns the published path.

    ``pause``: seconds to sleep after each batch (spreads a run for timed kills)."""
    writer = _fault_writer(root, md, resume=resume, durable=durable)
    with writer as w:
        _feed(w, md, batch, pause)
    return str(writer.path)


def write_rank(root: Path, md: ss.Metadata, rank: int, world_size: int, resume: bool = False) -> str:
    """Write one rank's share of the fault-suite cache and close (publishes nothing)."""
    w = _fault_writer(root, md, rank=rank, world_size=world_size, resume=resume, durable=False)
    _feed(w, md, 4)
    return str(w.close())


def finalize_run(root: Path, md: ss.Metadata) -> str:
    return str(ss.finalize(root, md))


def clean_tree(tmp: Path, md: ss.Metadata) -> dict[str, bytes]:
    """Every file of an uninterrupted write, by name: what every recovery must end with."""
    root = tmp / "clean"
    write_run(root, md, resume=False)
    return tree_bytes(root / md.hash)


def record_points(fn: Callable[[], Any]) -> list[tuple[str, int]]:
    """The named points ``fn`` passes, in order (run in this process)."""
    seen: list[tuple[str, int]] = []
    fileio.fault_hook = lambda name, index: seen.append((name, index))
    try:
        fn()
    finally:
        fileio.fault_hook = None
    return seen


# --------------------------------------------------------------------------------------
# what must hold after any fault


def assert_nothing_partial(root: Path, md: ss.Metadata) -> None:
    """Whatever is at ``root/<hash>`` opens and verifies (or nothing is there)."""
    final = root / md.hash
    if os.path.lexists(final):
        ss.open(final).verify()


def assert_published_once(root: Path, md: ss.Metadata, expected: dict[str, bytes]) -> None:
    """``root`` holds exactly the published cache (no staging folder, no lock file), read-only,
    byte-identical to an uninterrupted write."""
    final = root / md.hash
    assert sorted(os.listdir(root)) == [md.hash]
    ss.open(final).verify()
    assert tree_bytes(final) == expected
    assert stat.S_IMODE(final.stat().st_mode) == 0o555
    assert {stat.S_IMODE(p.stat().st_mode) for p in final.iterdir()} == {0o444}


# --------------------------------------------------------------------------------------
# children: forked, optionally unprivileged, stopped at named points


@dataclass
class Outcome:
    """How a child ended: ``kind`` is "ok" (``detail`` = its return value), the name of the
    exception it raised (``detail`` = the message), "killed" or "exit <code>"."""

    kind: str
    detail: str = ""

    @property
    def killed(self) -> bool:
        return self.kind == "killed"


class Child:
    """A forked process running ``fn(*args)``, reporting how it ended through a pipe."""

    def __init__(self, fn: Callable[..., Any], *args: Any, hook: Hook | None = None, as_nobody: bool = False) -> None:
        ctx = mp.get_context("fork")
        self._recv, send = ctx.Pipe(duplex=False)

        def main() -> None:
            if as_nobody and os.geteuid() == 0:
                drop_privileges()
            fileio.fault_hook = hook
            try:
                result = fn(*args)
            except BaseException as err:
                send.send((type(err).__name__, str(err)))
            else:
                send.send(("ok", str(result)))

        self.process = ctx.Process(target=main, daemon=True)
        self.process.start()
        send.close()

    def wait(self, timeout: float = CHILD_TIMEOUT) -> Outcome:
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
            raise AssertionError(f"child still running after {timeout} s (a hang)")
        message = None
        if self._recv.poll():
            with contextlib.suppress(EOFError):  # killed: the pipe closed with nothing sent
                message = self._recv.recv()
        self._recv.close()
        if message is not None:
            return Outcome(*message)
        if self.process.exitcode == -signal.SIGKILL:
            return Outcome("killed")
        return Outcome(f"exit {self.process.exitcode}")


def run_child(fn: Callable[..., Any], *args: Any, hook: Hook | None = None, as_nobody: bool = False) -> Outcome:
    return Child(fn, *args, hook=hook, as_nobody=as_nobody).wait()


def drop_privileges() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def kill_at(n: int) -> Hook:
    """A hook that SIGKILLs its process at the ``n``-th named point it passes (1-based)."""
    count = 0

    def hook(name: str, index: int) -> None:
        nonlocal count
        count += 1
        if count == n:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


class Pause:
    """A hook that stops its process at the ``n``-th named point (the ``n``-th point called
    ``only``, when given) until `release`."""

    def __init__(self, folder: Path, n: int, only: str | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.reached_file = folder / "reached"
        self.go_file = folder / "go"
        self.n = n
        self.only = only
        self.count = 0

    def __call__(self, name: str, index: int) -> None:
        if self.only is not None and name != self.only:
            return
        self.count += 1
        if self.count != self.n:
            return
        tmp = self.reached_file.with_suffix(".tmp")
        tmp.write_text(f"{name} {index}")
        tmp.rename(self.reached_file)  # whole, for the test that polls for it
        deadline = time.monotonic() + CHILD_TIMEOUT
        while not self.go_file.exists():
            if time.monotonic() > deadline:
                os._exit(99)
            time.sleep(0.002)

    def wait_reached(self, child: Child, timeout: float = CHILD_TIMEOUT) -> bool:
        """True once the child stands at its point; False if it ended without reaching it."""
        deadline = time.monotonic() + timeout
        while not self.reached_file.exists():
            if not child.process.is_alive():
                return self.reached_file.exists()
            if time.monotonic() > deadline:
                raise AssertionError("child neither reached its pause point nor ended (a hang)")
            time.sleep(0.002)
        return True

    def release(self) -> None:
        self.go_file.touch()


# --------------------------------------------------------------------------------------
# places: a folder the unprivileged user owns, and a small real filesystem


@contextlib.contextmanager
def nobody_folder() -> Iterator[Path]:
    """A fresh folder that the children running as `NOBODY` own (the current user's when not root).

    Skips the test, with the reason, when this machine cannot switch to that user.
    """
    if os.geteuid() != 0:
        folder = Path(tempfile.mkdtemp(prefix="saev-faults-"))
        try:
            yield folder
        finally:
            _remove_tree(folder)
        return
    probe = run_child(os.getuid, as_nobody=True)
    if probe.kind != "ok" or probe.detail != str(NOBODY):
        pytest.skip(f"running as root and cannot switch to uid {NOBODY} to honour file modes: {probe}")
    folder = Path(tempfile.mkdtemp(prefix="saev-faults-", dir="/tmp"))  # /tmp: any user may enter
    os.chown(folder, NOBODY, NOBODY)
    try:
        yield folder
    finally:
        _remove_tree(folder)


def _remove_tree(folder: Path) -> None:
    for path in [folder, *folder.rglob("*")]:
        if path.is_dir() and not path.is_symlink():
            with contextlib.suppress(OSError):
                os.chmod(path, 0o755)
    shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def small_filesystem(folder: Path, size_mib: int = 8, kind: str = "tmpfs") -> Iterator[Path]:
    """A real filesystem of ``size_mib`` MiB mounted at ``folder`` (root only), unmounted
    afterwards: tmpfs (``mount -t tmpfs -o size=8m``, which refuses O_DIRECT), or ext4 in
    a loop-mounted image file (O_DIRECT works, as on a real disk; no blocks reserved for root).
    Skips the test, with the reason, where mounting is not possible."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem to fill it needs root")
    folder.mkdir(parents=True, exist_ok=True)
    image = folder.with_name(folder.name + ".img")
    if kind == "tmpfs":
        command = ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(folder)]
    else:
        with open(image, "wb") as f:
            f.truncate(size_mib << 20)
        made = subprocess.run(
            ["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=False, capture_output=True, text=True
        )
        if made.returncode != 0:
            pytest.skip(f"cannot make an ext4 image here: {made.stderr.strip()}")
        command = ["mount", "-o", "loop", str(image), str(folder)]
    try:
        mounted = subprocess.run(command, check=False, capture_output=True, text=True)
    except FileNotFoundError as err:
        pytest.skip(f"cannot mount a {kind} here: {err}")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a {kind} here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)], check=False, capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], check=False, capture_output=True)
        image.unlink(missing_ok=True)


def fill(folder: Path, leave: int = 0) -> Path:
    """Fill the filesystem of ``folder`` with one file until fewer than ``leave`` + 4096
    bytes stay free (``leave=0``: full, as tmpfs counts whole pages)."""
    path = folder / "filler"
    with open(path, "ab", buffering=0) as f:
        for size in (1 << 20, 4096):
            while (fileio.free_bytes(folder) or 0) - size >= leave:
                try:
                    f.write(b"\0" * size)
                except OSError:
                    break
    return path
