"""Per-process handles of an open cache: shard memmaps and file descriptors, opened lazily,
and the shared lock held on the cache folder while it is open.

A float8_e4m3 cache's scale files (protocol 3.1) get the same per-process handles as its
shards (`scale_shard`, `_scale_fd`).

A `Shards` object crosses process boundaries two ways, and neither may share a handle:
forked (a DataLoader worker: `_check_pid` sees the new pid and drops the parent's) and
pickled (spawn: `__getstate__` drops them, `__setstate__` starts empty). The read paths
(`reads`) and the files beside the activations (`sidecars`) build on this class.

The lock (protocol.md section 6, "Caches in use"): a shared ``flock`` on the cache folder
itself, taken when the cache is opened and released by `close` (taken again when the cache
is next read) or when the object goes away. A forked copy shares its parent's lock; an
unpickled copy takes its own. ``saev-shards rm`` and `store.remove` refuse a folder that
anyone holds so.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..fileio import hold_folder
from ..manifest import Manifest
from ..metadata import Metadata
from ..protocol.common import SCALES_DTYPE

#: Attributes that belong to one process: never pickled, rebuilt after fork or unpickling.
_PER_PROCESS = ("_maps", "_fds", "_scale_maps", "_scale_fds", "_aux", "_pid", "_out_cache", "_lock", "_folder_lock")


class FolderLock:
    """A shared ``flock`` on a cache folder, held until `release` or until the object goes away
    (`fileio.hold_folder`; ``fd`` None where it could not be taken: the filesystem does not
    lock, or another process holds the folder exclusively while it publishes or removes it)."""

    def __init__(self, path: Path) -> None:
        self.fd = hold_folder(path, shared=True)

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)  # a forked child closes its copy only: the parent's lock stays

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.release()


class ShardHandles:
    """Memmaps and file descriptors of a cache's shards, one set per process (`Shards` is one)."""

    path: Path
    metadata: Metadata
    manifest: Manifest
    numpy_dtype: np.dtype[Any]

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._maps: dict[int, npt.NDArray[Any]] = {}
        self._fds: dict[int, int] = {}
        self._scale_maps: dict[int, npt.NDArray[Any]] = {}
        self._scale_fds: dict[int, int] = {}
        self._aux: dict[str, Any] = {}
        self._lock = threading.Lock()  # guards opening handles; a new one after fork or unpickling
        # The last `out` buffer given to read_example and its byte view (reused while it is).
        self._out_cache: tuple[npt.NDArray[Any], memoryview] | None = None

    def _check_pid(self) -> None:
        if self._pid != os.getpid():  # forked: never use the parent's handles
            self._reset()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in _PER_PROCESS:
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()
        self._hold_folder()

    def _hold_folder(self) -> None:
        """Hold the shared lock on the cache folder (taken once; again after `close`)."""
        if getattr(self, "_folder_lock", None) is None:
            self._folder_lock: FolderLock | None = FolderLock(self.path)

    def close(self) -> None:
        """Drop this process's memmaps and file descriptors and release the cache's lock
        (all taken again on next use)."""
        if self._pid == os.getpid():
            for fd in (*self._fds.values(), *self._scale_fds.values()):
                os.close(fd)
        lock = getattr(self, "_folder_lock", None)
        if lock is not None:
            lock.release()
            self._folder_lock = None
        self._reset()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter shutdown os may be gone
            self.close()

    def shard_path(self, k: int) -> Path:
        """Absolute path of shard file ``k``."""
        return self.path / self.manifest.shards[k].name

    def shard(self, k: int) -> npt.NDArray[Any]:
        """Shard ``k`` as a read-only array backed by a memory map, shape ``(n_examples_k, L, T, D)``."""
        self._check_pid()
        mm = self._maps.get(k)
        if mm is None:
            with self._lock:
                mm = self._maps.get(k)
                if mm is None:
                    self._hold_folder()
                    mm = self._open_map(k)
                    self._maps[k] = mm
        return mm

    def _open_map(self, k: int) -> npt.NDArray[Any]:
        entry = self.manifest.shards[k]
        shape = (entry.n_examples, *self.metadata.shard_shape[1:])
        if entry.n_examples == 0 or self.metadata.example_nbytes == 0:
            return np.zeros(shape, self.numpy_dtype)  # mmap cannot map 0 bytes
        # A plain ndarray over the map: np.memmap's Python-level __getitem__ costs ~1 us per index.
        return np.memmap(self.path / entry.name, dtype=self.numpy_dtype, mode="r", shape=shape).view(np.ndarray)

    def _fd(self, k: int) -> int:
        self._check_pid()
        fd = self._fds.get(k)
        if fd is None:
            with self._lock:  # two threads opening one shard would leak a descriptor
                fd = self._fds.get(k)
                if fd is None:
                    self._hold_folder()
                    fd = os.open(self.shard_path(k), os.O_RDONLY)
                    self._fds[k] = fd
        return fd

    # -- the scale files of a float8_e4m3 cache (protocol 3.1) ------------------------------
    def scale_path(self, k: int) -> Path:
        """Absolute path of shard ``k``'s scale file (float8_e4m3 caches only)."""
        scales = self.manifest.scales
        if scales is None:
            raise ValueError(f"{self.path}: a {self.metadata.dtype} cache has no scale files")
        return self.path / scales.names[k]

    def scale_shard(self, k: int) -> npt.NDArray[Any]:
        """Shard ``k``'s scales as a read-only float32 array backed by a memory map, shape
        ``(n_examples_k, L, T)``: one per vector (float8_e4m3 caches only)."""
        self._check_pid()
        mm = self._scale_maps.get(k)
        if mm is None:
            path = self.scale_path(k)
            with self._lock:
                mm = self._scale_maps.get(k)
                if mm is None:
                    self._hold_folder()
                    n = self.manifest.shards.counts[k]
                    shape = (n, *self.metadata.shard_shape[1:3])
                    if n == 0 or shape[1] * shape[2] == 0:
                        mm = np.zeros(shape, SCALES_DTYPE)
                    else:
                        mm = np.memmap(path, dtype=SCALES_DTYPE, mode="r", shape=shape).view(np.ndarray)
                    self._scale_maps[k] = mm
        return mm

    def _scale_fd(self, k: int) -> int:
        self._check_pid()
        fd = self._scale_fds.get(k)
        if fd is None:
            path = self.scale_path(k)
            with self._lock:
                fd = self._scale_fds.get(k)
                if fd is None:
                    self._hold_folder()
                    fd = os.open(path, os.O_RDONLY)
                    self._scale_fds[k] = fd
        return fd
