"""Per-process handles of an open cache: shard memmaps and file descriptors, opened lazily,
and the shared lock held on the cache folder while it is open.

A float8_e4m3 cache's scale files (protocol 3.1) get the same per-process handles as its
shards (`scale_shard`, `scale_fd`).

A `Shards` object crosses process boundaries two ways, and neither may share a handle:
forked (a DataLoader worker: `_check_pid` sees the new pid and drops the parent's) and
pickled (spawn: `__getstate__` drops them, `__setstate__` starts empty). The read paths
(`reads`) and the files beside the activations (`sidecars`) build on this class.

The lock (protocol.md section 6, "Caches in use"): a shared ``flock`` on the cache folder
itself, taken when the cache is opened and released by `close` (taken again when the cache
is next read) or when the object goes away. A forked copy shares its parent's lock; an
unpickled copy takes its own. ``saev-shards rm`` and `store.remove` refuse a folder that
anyone holds so.

The storage seam: every data file is reached through ``files`` (`storage.base.Files`),
which opens it, reads it (``preadv``), maps it and closes it. A local cache has
`storage.local.LocalFiles` (descriptors and ``os.preadv``, the same calls as always, and
memory maps); a remote one `storage.remote.RemoteFiles`, whose reads are ranged requests
checked against the manifest, and whose shards (and scale files), which it cannot map, are
`RemoteShard` array-likes returning copies.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..protocol.common import SCALES_DTYPE
from ..protocol.manifest import Manifest
from ..protocol.metadata import Metadata
from ..storage.base import Files
from ..storage.local import FolderLock, LocalFiles, naming_removal, removed_while_open

__all__ = ["Files", "FolderLock", "LocalFiles", "RemoteShard", "ShardHandles", "naming_removal", "removed_while_open"]

#: Attributes that belong to one process: never pickled, rebuilt after fork or unpickling.
_PER_PROCESS = (
    "_maps", "_fds", "_scale_maps", "_scale_fds", "_aux", "_pid", "_out_cache", "_lock", "_preadv", "_folder_lock"
)  # fmt: skip


class ShardHandles:
    """Memmaps and file descriptors of a cache's shards, one set per process (`Shards` is one)."""

    path: Path
    metadata: Metadata
    manifest: Manifest
    numpy_dtype: np.dtype[Any]
    #: Where the data files are read from (`LocalFiles`, or `RemoteFiles` for a remote cache).
    files: Files
    #: The shared lock on the cache's folder (`_hold_folder`), None until taken or where there is none.
    _folder_lock: FolderLock | None = None

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._preadv = self.files.preadv  # the hot path reads it as one attribute
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
        """Hold the shared lock on the cache's folder (taken once; again after `close`), where
        its storage has one (`Files.lock_folder`: a remote cache has no folder of its data)."""
        if self._folder_lock is None:
            self._folder_lock = self.files.lock_folder()

    def close(self, wait: bool = True) -> None:
        """Drop this process's memmaps and file descriptors and release the cache's lock
        (all taken again on next use). ``wait=False`` (from `__del__`) never waits for another
        thread: a remote cache's block-cache writes then finish in the background."""
        if self._pid == os.getpid():
            for fd in (*self._fds.values(), *self._scale_fds.values()):
                self.files.close(fd)
        self.files.close_all(wait=wait)
        lock = self._folder_lock
        if lock is not None:
            lock.release()
            self._folder_lock = None
        self._reset()

    def __del__(self) -> None:
        # The collector may run this on any thread, at any allocation, even one that holds a
        # lock that joining a thread needs (threading's own, while a thread starts): waiting
        # for the block-cache writer here once deadlocked the test suite.
        # Not contextlib.suppress: at interpreter shutdown a module's globals (contextlib, os)
        # may already be None; a try statement needs builtins only.
        try:  # noqa: SIM105
            self.close(wait=False)
        except Exception:  # noqa: S110  # nothing to tell a collector
            pass

    def shard_path(self, k: int) -> Path:
        """Absolute path of shard file ``k`` (of a local cache: a remote one's files are `files`)."""
        return self.path / self.manifest.shards[k].name

    def shard(self, k: int) -> npt.NDArray[Any]:
        """Shard ``k`` as a read-only array backed by a memory map, shape ``(n_examples_k, L, T, D)``;
        of a remote cache, a `RemoteShard` whose indexing returns copies."""
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
        mapped = self.files.map(entry.name, self.numpy_dtype, shape)
        if mapped is None:  # a storage without maps: an array-like over verified reads
            read: Any = getattr(self, "read_range_raw")  # noqa: B009 - `reads.ReadPaths` has it
            return RemoteShard(read, k * self.metadata.examples_per_shard, shape, self.numpy_dtype)  # type: ignore[return-value]
        # A plain ndarray over the map: np.memmap's Python-level __getitem__ costs ~1 us per index.
        return mapped.view(np.ndarray)

    def shard_fd(self, k: int) -> int:
        """The descriptor of shard file ``k``, opened once (through `files`) and kept until
        `close`: for reads and checks outside the reader's own (the loaders' mapped reads
        check a file's size with it). Not to be closed by the caller."""
        self._check_pid()
        fd = self._fds.get(k)
        if fd is None:
            with self._lock:  # two threads opening one shard would leak a descriptor
                fd = self._fds.get(k)
                if fd is None:
                    self._hold_folder()
                    fd = self.files.open(self.manifest.shards[k].name)
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
                    made: Any = self.files.map(path.name, np.dtype(SCALES_DTYPE), shape)
                    if made is None:
                        read: Any = getattr(self, "read_range_scales")  # noqa: B009 - `reads.ReadPaths` has it
                        first = k * self.metadata.examples_per_shard
                        made = RemoteShard(read, first, shape, np.dtype(SCALES_DTYPE))
                    else:
                        made = made.view(np.ndarray)
                    mm = self._scale_maps[k] = made
        return mm

    def scale_fd(self, k: int) -> int:
        """The descriptor of shard ``k``'s scale file (float8_e4m3 caches only), as `shard_fd`."""
        self._check_pid()
        fd = self._scale_fds.get(k)
        if fd is None:
            path = self.scale_path(k)
            with self._lock:
                fd = self._scale_fds.get(k)
                if fd is None:
                    self._hold_folder()
                    fd = self.files.open(path.name)
                    self._scale_fds[k] = fd
        return fd


class RemoteShard:
    """Shard ``k`` of a remote cache (or its scales) as an array-like of shape ``(n_examples_k, ...)``.

    Indexing reads the examples the key selects (``read(start, stop, out)`` over runs of
    neighbours, so through the verified storage) and applies the rest of the key to them:
    the result equals indexing the shard's array, and is always a copy.
    """

    def __init__(
        self,
        read: Callable[[int, int, npt.NDArray[Any]], Any],
        first: int,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
    ) -> None:
        self.read = read
        self.first = first
        self.shape = shape
        self.ndim = len(shape)
        self.dtype = dtype

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> npt.NDArray[Any]:
        out = self._read(np.arange(self.shape[0]))
        return out if dtype is None else out.astype(dtype)

    def __getitem__(self, key: Any) -> npt.NDArray[Any]:
        key = key if isinstance(key, tuple) else (key,)
        if not key or key[0] is Ellipsis:
            return np.asarray(self.__array__()[key])
        first, rest = key[0], key[1:]
        n = self.shape[0]
        if isinstance(first, slice):  # exactly the rows the slice takes, in its order
            return np.asarray(self._read(np.arange(n)[first])[(slice(None), *rest)])
        picked = np.arange(n)[first]  # numpy's rules for an integer, an array, a boolean mask
        if np.ndim(picked) == 0:
            return np.asarray(self._read(np.array([int(picked)]))[(0, *rest)])
        unique = np.unique(picked)
        return np.asarray(self._read(unique)[(np.searchsorted(unique, picked), *rest)])

    def _read(self, rows: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """Rows ``rows`` of the shard (any order, repeats allowed), read in runs of neighbours."""
        unique, inverse = np.unique(rows, return_inverse=True)
        out = np.empty((len(unique), *self.shape[1:]), self.dtype)
        if len(unique):
            breaks = np.flatnonzero(np.diff(unique) != 1) + 1
            starts = np.r_[0, breaks]
            stops = np.r_[breaks, len(unique)]
            for a, b in zip(starts.tolist(), stops.tolist(), strict=True):
                lo = self.first + int(unique[a])
                self.read(lo, lo + b - a, out[a:b])
        return out if len(unique) == len(rows) and bool(np.all(unique == rows)) else out[inverse.reshape(-1)]
