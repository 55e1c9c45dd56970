"""`ShardWriter`: write a cache into a staging directory and publish it atomically.

How a cache is written (protocol.md section 6):

* Everything goes to ``<root>/.staging-<HASH>/``; nothing appears at ``<root>/<HASH>``
  until every file is complete and fsynced, then one ``rename`` publishes it.
* Data arrives as *streams*: activations, and optionally labels, per-example numeric
  columns and per-example text. Each stream is cut at shard boundaries into per-shard
  part files. When every stream has covered a shard, a small part record
  (``part<06d>.json``) seals it, with sizes and xxh3_128 digests computed while writing.
* Sealed shards survive a crash: a writer opened with ``resume=True`` starts after the
  last sealed shard. Several writers (``rank``/``world_size``) each write a disjoint,
  contiguous block of shards into the same staging directory; `finalize` checks every
  part record, joins the per-shard parts into the final files and publishes.
* A lock file beside the staging directory, ``<root>/.staging-<HASH>.lock``, stays valid
  until the rename is done: a single writer or `finalize` holds it exclusively, each of
  several writers shares it. Every state a kill can leave resumes (protocol.md section 6).
* The output is a pure function of the data: the same input gives byte-identical
  files, however it was batched and however many writers produced it.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import math
import mmap
import os
import queue
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
import xxhash

from . import dtypes, world
from .errors import (
    AlreadyPublishedError,
    MetadataError,
    NonFiniteError,
    WriterBusyError,
    WriterError,
)
from .fileio import (
    IO_CHUNK,
    fault_point,
    hash_file,
    make_owner_writable,
    make_writable,
    naming_disk_full,
    publish_dir,
    pwrite_all,
    remove_path,
    stream,
    take_lock,
    try_flock,
    write_all,
    write_file_atomic,
)
from .manifest import ArrayEntry, FileEntry, Manifest, ShardEntry, ShardList, TextEntry
from .metadata import Metadata
from .protocol.common import (
    COLUMN_DTYPES,
    FIELD_NAME_RE,
    LABELS_DTYPE,
    LABELS_FILE,
    MANIFEST_FILE,
    METADATA_FILE,
    STATS_FILE,
    ProtocolWarning,
    column_file,
    shard_name,
    text_file,
)
from .protocol.jsonfile import strict_json_loads
from .protocol.saev_code import SAEV_ROOT_PARTS
from .protocol.v3 import pretty_json

STAGING_PREFIX = ".staging-"
#: The lock file of a staging directory sits beside it: ``<root>/.staging-<HASH>.lock``.
LOCK_SUFFIX = ".lock"
#: Where older versions kept the lock (inside the staging directory); removed when met.
OLD_LOCK_FILE = ".lock"
#: O_DIRECT write size for shard files, and the alignment O_DIRECT needs (offsets, sizes, memory).
DIRECT_BLOCK = 16 << 20
DIRECT_ALIGN = 4096
#: O_DIRECT writes in flight per file: the next block is copied and hashed meanwhile.
DIRECT_IN_FLIGHT = 2
#: Examples per step of the statistics pass (bounds its float32 scratch memory).
STATS_CHUNK = 8
#: Batches that may wait for the statistics thread before the writer blocks.
_STATS_BACKLOG = 2


def staging_dir(root: Path, md: Metadata) -> Path:
    """Where ``md``'s cache is written before it is published."""
    return Path(root) / f"{STAGING_PREFIX}{md.hash}"


def lock_path(root: Path, md: Metadata) -> Path:
    """The lock file of ``md``'s staging directory (beside it, so a rename never moves it)."""
    return Path(root) / f"{STAGING_PREFIX}{md.hash}{LOCK_SUFFIX}"


def range_lock(shards: range) -> str:
    """Name of the lock file (inside staging) held by the writer of ``shards`` among several."""
    return f".shards-{shards.start:06d}-{shards.stop:06d}{LOCK_SUFFIX}"


def part_record(k: int) -> str:
    """Name of shard ``k``'s part record in the staging directory."""
    return f"part{k:06d}.json"


def part_file(k: int, stream: str) -> str:
    """Name of stream ``stream``'s part of shard ``k`` (activations use the final name)."""
    if stream == "acts":
        return shard_name(k)
    suffix = ".jsonl" if stream.startswith("text.") else ".bin"
    return f"part{k:06d}.{stream}{suffix}"


def rank_shards(n_shards: int, rank: int, world_size: int) -> range:
    """The contiguous block of shard indices writer ``rank`` of ``world_size`` writes."""
    return world.share(n_shards, *world.check(rank, world_size, WriterError))


def world_from_env(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)`` by `saev_shards.world.detect`: explicit values, else an initialised
    torch.distributed group, else torchrun's RANK/WORLD_SIZE, else a SLURM array, else ``(0, 1)``."""
    found = world.detect(rank, world_size, slurm_array=True, error=WriterError)
    return found.rank, found.world_size


def _byte_view(data: bytes | npt.NDArray[Any]) -> memoryview:
    """The raw bytes of ``data`` as a flat memoryview (also for empty and 0-d arrays)."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
    return memoryview(data)


# --------------------------------------------------------------------------------------
# per-shard statistics


class _Stats:
    """Per-layer sums over the tokens of one shard, accumulated example by example.

    The order of every floating-point addition depends only on the data, never on how
    it was batched, so the sums (and the cache) are byte-identical for any batching.
    """

    def __init__(self, n_layers: int, d_model: int) -> None:
        self.sum = np.zeros((n_layers, d_model), np.float64)
        self.sum_sq = np.zeros((n_layers, d_model), np.float64)
        self.count = np.zeros(n_layers, np.int64)
        self.norm_sum = np.zeros(n_layers, np.float64)
        self.norm_sq_sum = np.zeros(n_layers, np.float64)
        self.nonfinite = np.zeros(n_layers, np.int64)

    def update(self, acts: npt.NDArray[Any], dtype: str, lengths: npt.NDArray[Any] | None) -> None:
        """Add the tokens of ``acts`` (stored dtype, shape (B, L, T, D)); padding excluded by ``lengths``."""
        n_tokens = acts.shape[2]
        positions = np.arange(n_tokens)
        for start in range(0, acts.shape[0], STATS_CHUNK):
            block = acts[start : start + STATS_CHUNK]
            has_nonfinite = dtypes.nonfinite_mask_any(block, dtype)
            for li in range(block.shape[1]):
                x = dtypes.to_float32(block[:, li], dtype)  # (b, T, D) float32
                for b in range(block.shape[0]):  # one example at a time: fixed shapes, fixed order
                    xb = x[b]  # (T, D)
                    valid = None
                    if lengths is not None:
                        valid = positions < lengths[start + b]
                    if has_nonfinite:
                        finite = np.isfinite(xb).all(axis=1)
                        self.nonfinite[li] += int(np.count_nonzero(~finite if valid is None else valid & ~finite))
                        valid = finite if valid is None else valid & finite
                    if valid is not None:
                        xb = np.where(valid[:, None], xb, np.float32(0))
                        self.count[li] += int(np.count_nonzero(valid))
                    else:
                        self.count[li] += n_tokens
                    sq = xb * xb
                    norms_sq = sq.sum(axis=1)  # (T,)
                    self.sum[li] += xb.sum(axis=0)
                    self.sum_sq[li] += sq.sum(axis=0)
                    self.norm_sum[li] += float(np.sqrt(norms_sq).sum(dtype=np.float64))
                    self.norm_sq_sum[li] += float(norms_sq.sum(dtype=np.float64))

    def to_json(self) -> dict[str, Any]:
        return {
            "sum": self.sum.tolist(),
            "sum_sq": self.sum_sq.tolist(),
            "count": self.count.tolist(),
            "norm_sum": self.norm_sum.tolist(),
            "norm_sq_sum": self.norm_sq_sum.tolist(),
            "nonfinite": self.nonfinite.tolist(),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any], n_layers: int, d_model: int) -> _Stats:
        s = cls(n_layers, d_model)
        s.sum[:] = d["sum"]
        s.sum_sq[:] = d["sum_sq"]
        s.count[:] = d["count"]
        s.norm_sum[:] = d["norm_sum"]
        s.norm_sq_sum[:] = d["norm_sq_sum"]
        s.nonfinite[:] = d["nonfinite"]
        return s

    def add(self, other: _Stats) -> None:
        self.sum += other.sum
        self.sum_sq += other.sum_sq
        self.count += other.count
        self.norm_sum += other.norm_sum
        self.norm_sq_sum += other.norm_sq_sum
        self.nonfinite += other.nonfinite

    def summary(self, layers: Sequence[int]) -> dict[str, Any]:
        """The stats.json object (protocol.md section 2.6)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            n = self.count.astype(np.float64)
            mean = self.sum / n[:, None]
            var = np.maximum(self.sum_sq / n[:, None] - mean * mean, 0.0)
            norm_mean = self.norm_sum / n
            norm_sq_mean = self.norm_sq_sum / n
        empty = self.count == 0
        mean[empty] = 0.0
        var[empty] = 0.0
        norm_mean[empty] = 0.0
        norm_sq_mean[empty] = 0.0
        return {
            "layers": list(layers),
            "count": self.count.tolist(),
            "nonfinite": self.nonfinite.tolist(),
            "mean": mean.tolist(),
            "var": var.tolist(),
            "norm_mean": norm_mean.tolist(),
            "norm_sq_mean": norm_sq_mean.tolist(),
        }


# --------------------------------------------------------------------------------------
# streams


class _StreamSpec:
    """What one stream writes per example: dtype and per-example shape (text: none)."""

    def __init__(self, key: str, dtype: np.dtype[Any] | None, tail: tuple[int, ...]) -> None:
        self.key = key
        self.dtype = dtype
        self.tail = tail

    @property
    def is_text(self) -> bool:
        return self.key.startswith("text.")

    def to_json(self) -> dict[str, Any]:
        if self.is_text:
            return {}
        assert self.dtype is not None
        return {"dtype": self.dtype.str, "shape": list(self.tail)}


class _SequentialFile:
    """A file written front to back, through O_DIRECT where the filesystem allows it.

    Whole aligned blocks go to the disk with O_DIRECT from aligned staging buffers: on
    this kind of machine that runs at the disk's sequential rate, while page-cache writes
    flushed by a final fsync reach about half of it (memory copy and writeback end up
    serialised) and evict what readers had cached. The blocks are written by a small
    thread pool, up to `DIRECT_IN_FLIGHT` at once, so copying and hashing the next block
    overlaps the disk. The unaligned tail goes through the page cache. Where O_DIRECT is
    refused (tmpfs, some network filesystems) every write is buffered and synchronous.
    """

    def __init__(self, path: Path, direct: bool) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.direct_fd: int | None = None
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
            except OSError:
                self.direct_fd = None
        # One buffer being filled plus one per write in flight, rotated.
        count = DIRECT_IN_FLIGHT + 1 if self.direct_fd is not None else 0
        self.buffers = [_take_buffer() for _ in range(count)]
        self.current = 0
        self.in_flight: collections.deque[Future[None]] = collections.deque()
        self.fill = 0
        self.offset = 0  # file offset of the current buffer's first byte

    def fileno(self) -> int:
        return self.fd

    def write(self, view: memoryview) -> None:
        if not self.buffers:
            pwrite_all(self.fd, view, self.offset)
            self.offset += view.nbytes
            return
        while view.nbytes:
            n = min(DIRECT_BLOCK - self.fill, view.nbytes)
            self.buffers[self.current][self.fill : self.fill + n] = view[:n]
            self.fill += n
            view = view[n:]
            if self.fill == DIRECT_BLOCK:
                self._submit(DIRECT_BLOCK)

    def _submit(self, nbytes: int) -> None:
        """Hand the current buffer's first ``nbytes`` (a multiple of DIRECT_ALIGN) to the pool."""
        while len(self.in_flight) >= DIRECT_IN_FLIGHT:
            self.in_flight.popleft().result()  # frees the buffer we rotate to next
        buffer = self.buffers[self.current]
        self.in_flight.append(_direct_pool().submit(self._write_direct, buffer, nbytes, self.offset))
        self.offset += nbytes
        self.fill = 0
        self.current = (self.current + 1) % len(self.buffers)

    def _write_direct(self, buffer: mmap.mmap, nbytes: int, offset: int) -> None:
        assert self.direct_fd is not None
        with memoryview(buffer) as whole:
            done = 0
            while done < nbytes:
                try:
                    done += os.pwrite(self.direct_fd, whole[done:nbytes], offset + done)
                except OSError as err:
                    if err.errno != errno.EINVAL:
                        raise
                    # An unaligned remainder after a short write: finish through the page cache.
                    pwrite_all(self.fd, whole[done:nbytes], offset + done)
                    done = nbytes

    def close(self, durable: bool) -> None:
        try:
            if self.buffers:
                rest = self.fill
                aligned = rest - rest % DIRECT_ALIGN
                buffer = self.buffers[self.current]
                if aligned:
                    tail = bytes(buffer[aligned:rest])
                    self._submit(aligned)
                    self.fill = rest = len(tail)
                    self.buffers[self.current][:rest] = tail
                while self.in_flight:
                    self.in_flight.popleft().result()
                with memoryview(self.buffers[self.current]) as whole:
                    pwrite_all(self.fd, whole[:rest], self.offset)
                self.offset += rest
                self.fill = 0
            if durable:
                os.fsync(self.fd)
        finally:
            self.abandon()

    def abandon(self) -> None:
        while self.in_flight:  # never free a buffer a pool thread is still writing from
            with contextlib.suppress(BaseException):
                self.in_flight.popleft().result()
        for fd in (self.direct_fd, self.fd):
            if fd is not None and fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.fd = self.direct_fd = -1
        for buffer in self.buffers:
            _give_buffer(buffer)
        self.buffers = []


# Aligned buffers are reused from file to file: first-touch page faults on fresh
# anonymous memory cost more than the copy itself here (48 MiB per shard file).
_FREE_BUFFERS: dict[int, list[mmap.mmap]] = {}
_MAX_FREE_BUFFERS = DIRECT_IN_FLIGHT + 1  # one file's worth, released when a writer closes


def _take_buffer() -> mmap.mmap:
    free = _FREE_BUFFERS.setdefault(os.getpid(), [])  # per process: never share across fork
    while free:
        buffer = free.pop()
        if len(buffer) == DIRECT_BLOCK:
            return buffer
        buffer.close()
    return mmap.mmap(-1, DIRECT_BLOCK)


def _give_buffer(buffer: mmap.mmap) -> None:
    free = _FREE_BUFFERS.setdefault(os.getpid(), [])
    if len(free) < _MAX_FREE_BUFFERS:
        free.append(buffer)
    else:
        buffer.close()


def _release_buffers() -> None:
    """Return the kept buffers' memory to the system."""
    for buffer in _FREE_BUFFERS.pop(os.getpid(), []):
        buffer.close()


_DIRECT_POOLS: dict[int, ThreadPoolExecutor] = {}


def _direct_pool() -> ThreadPoolExecutor:
    """Threads that issue O_DIRECT writes, shared by the files written in this process.

    Keyed by pid: a forked child must not use its parent's pool, whose threads it lacks.
    """
    pid = os.getpid()
    pool = _DIRECT_POOLS.get(pid)
    if pool is None:  # setdefault is atomic; a losing racer's pool never starts a thread
        pool = _DIRECT_POOLS.setdefault(pid, ThreadPoolExecutor(DIRECT_IN_FLIGHT, "saev-shards-direct-io"))
    return pool


_RESUME_NOTE = "; the shards sealed so far are kept: free some space and resume (ShardWriter(..., resume=True))"
_FINALIZE_NOTE = "; every shard is sealed and kept: free some space and finalize again (or resume the writer)"


class _Cursor:
    """A stream's open part file: the shard it is in, examples written, digest so far."""

    def __init__(self, path: Path, k: int, expected_nbytes: int | None) -> None:
        self.path = path
        self.k = k
        self.count = 0
        self.nbytes = 0
        self.expected_nbytes = expected_nbytes  # None for text, whose size is known only at the end
        self.hasher = xxhash.xxh3_128()
        is_shard = path.name.startswith("acts")
        # O_DIRECT only pays for files of at least one block; small files stay buffered.
        with naming_disk_full(path, expected_nbytes, _RESUME_NOTE):
            self.file = _SequentialFile(path, direct=is_shard and (expected_nbytes or 0) >= DIRECT_BLOCK)
        if is_shard and not try_flock(self.file.fileno()):
            self.file.abandon()
            raise WriterBusyError(f"{path} is being written by another process")

    def write(self, data: bytes | npt.NDArray[Any]) -> None:
        view = _byte_view(data)
        needed, at_least = self._needed(view.nbytes)
        with naming_disk_full(self.path, needed, _RESUME_NOTE, at_least=at_least):
            self.file.write(view)
        self.hasher.update(view)
        self.nbytes += view.nbytes

    def close(self, durable: bool) -> None:
        needed, at_least = self._needed(0)
        with naming_disk_full(self.path, needed, _RESUME_NOTE, at_least=at_least):
            self.file.close(durable)

    def _needed(self, pending: int) -> tuple[int, bool]:
        """``(bytes, is_lower_bound)`` this file needs: its size, or (text) what it has so far."""
        if self.expected_nbytes is not None:
            return self.expected_nbytes, False
        return self.nbytes + pending, True


class _Pipeline:
    """Runs writer operations in order, in one background thread or inline."""

    def __init__(self, background: bool) -> None:
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        if background:
            self.queue: queue.Queue[tuple[Callable[..., None], tuple[Any, ...]] | None] = queue.Queue(maxsize=2)
            self.thread = threading.Thread(target=self._run, name="saev-shards-writer", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            if self.error is None:
                fn, args = item
                try:
                    fn(*args)
                except BaseException as err:
                    self.error = err

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        self.check()
        if self.thread is None:
            fn(*args)
        else:
            self.queue.put((fn, args))

    def drain(self) -> None:
        """Wait for every submitted operation; raise the first error if any."""
        if self.thread is not None:
            self.queue.put(None)
            self.thread.join()
            self.thread = None
        self.check()


# --------------------------------------------------------------------------------------
# the writer


class ShardWriter:
    """Write a cache for ``md`` under ``root``; published as ``root/<md.hash>`` on close.

    >>> with ShardWriter(root, md) as w:           # doctest: +SKIP
    ...     w.write(acts)                          # (B, L, T, D), any B, float numpy or torch
    ...     w.write_labels(labels)                 # (B, patches_per_ex) uint8, optional

    Arguments:
        root: folder holding caches (created if missing).
        md: the cache's metadata; ``md.n_examples`` examples must be written.
        rank, world_size: this writer's share when several processes write one cache
            (default: torchrun or SLURM array variables, else a single writer). Rank ``r``
            writes the contiguous examples `start` to `stop`; only a single writer
            publishes on close, otherwise call `finalize` once all ranks are done.
        resume: keep this rank's sealed shards from an interrupted run; feed examples
            from `next_example` on. Without it a single writer starts over.
        allow_nonfinite: store inf/NaN produced by the cast instead of raising.
        stats: gather per-layer statistics into stats.json (padding excluded when a
            ``lengths`` column is given in the same `write` call).
        labels, columns, text: declare streams up front (needed for ``resume``);
            undeclared streams are also accepted on first use.
        background: write and hash in a background thread, overlapping the caller.
        durable: fsync files and folders (turn off only for throwaway tests).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        md: Metadata,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        resume: bool = False,
        allow_nonfinite: bool = False,
        stats: bool = False,
        labels: bool = False,
        columns: Mapping[str, tuple[Any, tuple[int, ...]]] | None = None,
        text: Iterable[str] = (),
        background: bool = True,
        durable: bool = True,
    ) -> None:
        if not isinstance(md, Metadata):
            raise TypeError(f"md must be a saev_shards.Metadata, found {type(md).__name__}")
        self.md = md
        self.root = Path(root)
        self.rank, self.world_size = world_from_env(rank, world_size)
        self.shards = rank_shards(md.n_shards, self.rank, self.world_size)
        eps = md.examples_per_shard
        self.start = self.shards.start * eps
        self.stop = min(self.shards.stop * eps, md.n_examples)
        self.allow_nonfinite = allow_nonfinite
        self.stats_enabled = stats
        self.durable = durable
        self.path = self.root / md.hash
        self.staging = staging_dir(self.root, md)
        self._closed = False
        self._lock_fd: int | None = None
        self._range_lock_fd: int | None = None
        # True when staging already holds this cache finalized (killed before its rename).
        self._committed = False
        if not md.format.holds_extras and (stats or columns or tuple(text)):
            raise WriterError(
                f"protocol {md.protocol} caches ({md.format.summary}) hold activations and labels only; "
                "use protocol 3.0"
            )
        problems = md.format.write_problems(md)
        if problems:
            raise MetadataError(f"cannot write a {md.format.summary} cache: " + "; ".join(problems))
        if md.format.legacy and self.root.absolute().parts[-2:] != SAEV_ROOT_PARTS:
            warnings.warn(
                f"{self.root.absolute()}: saev's readers look for caches in a folder ending in saev/shards/<name> "
                "(its writers want a root ending in saev/shards); this cache opens here with saev_shards only, "
                "move it (or link it) under .../saev/shards for saev",
                ProtocolWarning,
                stacklevel=2,
            )

        # Streams known so far (caller thread): key -> spec. "acts" always exists.
        self._specs: dict[str, _StreamSpec] = {"acts": _StreamSpec("acts", md.numpy_dtype, md.shard_shape[1:])}
        if labels:
            self._declare("labels", LABELS_DTYPE, (md.patches_per_ex,))
        for name, (dt, tail) in (columns or {}).items():
            self._declare(f"column.{_field(name)}", np.dtype(dt), tuple(tail))
        for name in text:
            self._declare(f"text.{_field(name)}", None, ())
        # Whether statistics see lengths (decided by the first batch; see write()).
        self._stats_lengths: bool | None = None
        # Examples accepted per stream (caller thread), as global example indices.
        self._next: dict[str, int] = {}

        # I/O-thread state. _io_keys mirrors _specs in operation order (declarations are
        # operations too), so the I/O thread never reads a dict the caller is changing.
        self._io_keys: set[str] = set(self._specs)
        self._cursors: dict[str, _Cursor] = {}
        self._done: dict[int, dict[str, dict[str, Any]]] = {}  # shard -> stream -> part info
        self._shard_stats: dict[int, _Stats] = {}
        # Statistics run in their own thread (numpy releases the GIL), in submission order,
        # so they overlap the disk writes; at most _STATS_BACKLOG batches wait for it.
        self._stats_pool = ThreadPoolExecutor(1, "saev-shards-stats") if stats else None
        self._stats_pending: collections.deque[tuple[int, Future[None]]] = collections.deque()

        self.root.mkdir(parents=True, exist_ok=True)
        self._open_staging(resume)
        self.next_example = self._resume_point() if resume else self.start
        for key in self._specs:
            self._next[key] = self.next_example
        self._pipeline = _Pipeline(background)

    # -- set-up ---------------------------------------------------------------------
    def _declare(self, key: str, dtype: np.dtype[Any] | None, tail: tuple[int, ...]) -> _StreamSpec:
        if dtype is not None and key != "acts":
            dtype = dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype
            if dtype.str not in COLUMN_DTYPES:
                raise WriterError(f"{key}: dtype {dtype} is not allowed; use one of {list(COLUMN_DTYPES)}")
        spec = _StreamSpec(key, dtype, tail)
        self._specs[key] = spec
        pipeline = getattr(self, "_pipeline", None)
        if pipeline is not None:
            pipeline.submit(self._io_keys.add, key)
        return spec

    def _open_staging(self, resume: bool) -> None:
        single = self.world_size == 1
        busy = f"{self.staging} is locked by another writer" + ("" if single else " that is finalizing")
        self._lock_fd = _take_writer_lock(self.root, self.md, shared=not single, busy=busy)
        try:
            self.staging.mkdir(exist_ok=True)
            make_owner_writable(self.staging)  # a killed finalize may have frozen it
            if not single and self.shards:
                self._range_lock_fd = take_lock(self.staging / range_lock(self.shards))
                if self._range_lock_fd is None:
                    raise WriterBusyError(
                        f"{self.staging}: shards [{self.shards.start}, {self.shards.stop}) are being written by "
                        "another process (this rank started twice?)"
                    )
            commit = _read_commit(self.staging, self.md)
            if commit is not None:
                if resume and commit.derived == self._derived_files():
                    self._committed = True  # finalized but not renamed: nothing left to write
                else:
                    _unfinalize(self.staging, self.md)  # back to part records (restart, or other streams)
            self._clear_staging(single, resume)
            expected = self.md.to_bytes()
            md_path = self.staging / METADATA_FILE
            if md_path.exists():
                if md_path.read_bytes() != expected:
                    raise WriterError(f"{md_path} does not match this writer's metadata; remove {self.staging}")
            else:
                write_file_atomic(md_path, expected, self.durable)
            fault_point("writer-ready")
        except BaseException:
            self._release_lock()
            raise

    def _clear_staging(self, single: bool, resume: bool) -> None:
        """Without ``resume``: remove what earlier runs left (a single writer: everything;
        one of several: its own shards)."""
        if resume:
            return
        if single:
            for entry in os.scandir(self.staging):
                remove_path(Path(entry.path))
            return
        own = tuple(f"part{k:06d}." for k in self.shards) + tuple(shard_name(k) for k in self.shards)
        for name in os.listdir(self.staging):
            if name.startswith(own):
                remove_path(self.staging / name)

    def _derived_files(self) -> dict[str, str]:
        """The files besides shards that finalizing this writer's streams makes: name -> how
        (a dtype and shape, for comparison with a finalized staging directory's manifest)."""
        out: dict[str, str] = {}
        for key, spec in self._specs.items():
            if key == "acts":
                continue
            kind, _, name = key.partition(".")
            fname = LABELS_FILE if key == "labels" else column_file(name) if kind == "column" else text_file(name)
            out[fname] = "" if spec.dtype is None else f"{spec.dtype.str} {list(spec.tail)}"
        if self.stats_enabled:
            out[STATS_FILE] = ""
        return out

    def _resume_point(self) -> int:
        """First example of this rank's first shard without a valid part record."""
        if self._committed:
            return self.stop
        for k in self.shards:
            record = self._load_record(k)
            if record is None or set(record["streams"]) != set(self._specs) - {"acts"}:
                return k * self.md.examples_per_shard
            for key, spec in self._specs.items():
                if key != "acts" and record["streams"][key].get("dtype") != spec.to_json().get("dtype"):
                    return k * self.md.examples_per_shard
            if self.stats_enabled and record["stats"] is None:
                return k * self.md.examples_per_shard
            self._done[k] = {"acts": record["acts"], **record["streams"]}
            if record["stats"] is not None:
                self._shard_stats[k] = _Stats.from_json(record["stats"], self.md.n_layers, self.md.d_model)
        return self.stop

    def _load_record(self, k: int) -> dict[str, Any] | None:
        """Shard ``k``'s part record if it and every part it names check out, else None."""
        path = self.staging / part_record(k)
        try:
            record = strict_json_loads(path.read_bytes())
            if record["n_examples"] != self.md.shard_n_examples(k):
                return None
            for key, info in [("acts", record["acts"]), *record["streams"].items()]:
                nbytes, digest = hash_file(self.staging / part_file(k, key))
                if nbytes != info["nbytes"] or digest != info["xxh3_128"]:
                    return None
            record["stats"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        return dict(record)

    # -- public writing API (caller thread) -----------------------------------------
    def write(
        self,
        acts: Any,
        *,
        labels: Any = None,
        columns: Mapping[str, Any] | None = None,
        text: Mapping[str, Sequence[Any]] | None = None,
    ) -> None:
        """Append a batch of activations ``(B, L, T, D)``; optionally its labels, columns and text.

        Batches may have any size and may straddle shard boundaries.
        """
        self._check_open()
        arr, owned = self._cast(acts)
        batch = arr.shape[0]
        first = self._reserve("acts", batch)
        lengths = None
        if columns and "lengths" in columns:
            lengths = _to_numpy(columns["lengths"])
            if lengths.shape != (batch,):
                self._next["acts"] -= batch
                raise WriterError(f"lengths: expected shape ({batch},), found {lengths.shape}")
            self._check_lengths(lengths, batch_reserved=batch)
        if self.stats_enabled:
            # Statistics must exclude padding in every batch or in none (protocol.md 2.6).
            if self._stats_lengths is None:
                self._stats_lengths = lengths is not None
            elif self._stats_lengths != (lengths is not None):
                self._next["acts"] -= batch
                raise WriterError(
                    "with stats=True, pass lengths with every batch of activations or with none "
                    "(write(acts, columns={'lengths': ...}))"
                )
        if not self.allow_nonfinite and dtypes.nonfinite_mask_any(arr, self.md.dtype):
            self._next["acts"] -= batch
            raise self._nonfinite_error(acts, arr, first)
        if self._pipeline.thread is not None and not owned:
            arr = arr.copy()  # the caller may reuse its buffer while we write in the background
        self._pipeline.submit(self._io_acts, arr, first, lengths)
        if labels is not None:
            self.write_labels(labels)
        if columns:
            self._write_columns(columns, with_acts=True)
        if text:
            self.write_text(**text)

    def write_labels(self, labels: Any) -> None:
        """Append patch labels ``(B, patches_per_ex)`` uint8 (no [CLS] column)."""
        self._check_open()
        arr = _to_numpy(labels)
        if arr.dtype != np.uint8:
            raise WriterError(f"labels: expected dtype uint8, found {arr.dtype}")
        spec = self._specs.get("labels") or self._declare("labels", LABELS_DTYPE, (self.md.patches_per_ex,))
        self._append_array(spec, arr)

    def write_columns(self, **columns: Any) -> None:
        """Append per-example numeric columns, e.g. ``write_columns(lengths=np.array([...]))``.

        Each column is ``(B, *shape)`` with a fixed dtype and shape per example; its dtype
        and shape are taken from the first call (or the ``columns=`` declaration).
        ``lengths`` has a defined meaning: the number of valid token positions of each
        example (0 <= lengths <= T); loaders skip positions at or beyond it.
        """
        self._write_columns(columns, with_acts=False)

    def _write_columns(self, columns: Mapping[str, Any], with_acts: bool) -> None:
        self._check_open()
        if self.stats_enabled and "lengths" in columns and not with_acts:
            raise WriterError(
                "with stats=True, lengths must come with their activations so statistics can skip "
                "padding: use write(acts, columns={'lengths': ...})"
            )
        for name, values in columns.items():
            key = f"column.{_field(name)}"
            arr = _to_numpy(values)
            if arr.ndim == 0:
                raise WriterError(f"column {name!r}: expected an array with a batch axis, found a scalar")
            spec = self._specs.get(key) or self._declare(key, arr.dtype, arr.shape[1:])
            assert spec.dtype is not None
            if arr.dtype != spec.dtype and np.can_cast(arr.dtype, spec.dtype, "same_kind"):
                cast = arr.astype(spec.dtype)
                if np.array_equal(cast.astype(arr.dtype), arr, equal_nan=arr.dtype.kind == "f"):
                    arr = cast
            if name == "lengths":
                self._check_lengths(arr)
            self._append_array(spec, arr)

    def _check_lengths(self, lengths: npt.NDArray[Any], batch_reserved: int = 0) -> None:
        if lengths.dtype.kind not in "iu":
            bad_msg = f"lengths: expected integers, found dtype {lengths.dtype}"
        elif ((lengths < 0) | (lengths > self.md.tokens_per_ex)).any():
            bad = lengths[(lengths < 0) | (lengths > self.md.tokens_per_ex)]
            bad_msg = f"lengths: values must lie in [0, {self.md.tokens_per_ex}], found {bad[:5].tolist()}"
        else:
            return
        self._next["acts"] -= batch_reserved
        raise WriterError(bad_msg)

    def write_text(self, **fields: Sequence[Any]) -> None:
        """Append per-example text (or any JSON value), one per example, e.g. ``write_text(prompt=[...])``."""
        self._check_open()
        for name, values in fields.items():
            key = f"text.{_field(name)}"
            spec = self._specs.get(key) or self._declare(key, None, ())
            if isinstance(values, (str, bytes)):
                raise WriterError(f"text {name!r}: expected a sequence with one value per example, found a string")
            lines = []
            for v in values:
                try:
                    lines.append(orjson.dumps(v) + b"\n")
                except TypeError as err:
                    raise WriterError(f"text {name!r}: value {v!r} is not JSON-serialisable ({err})") from err
            first = self._reserve(spec.key, len(lines))
            self._pipeline.submit(self._io_text, spec, lines, first)

    def _append_array(self, spec: _StreamSpec, arr: npt.NDArray[Any]) -> None:
        if arr.ndim < 1 or arr.shape[1:] != spec.tail or arr.dtype != spec.dtype:
            raise WriterError(
                f"{spec.key}: expected shape (B, {', '.join(map(str, spec.tail))}) dtype {spec.dtype}, "
                f"found shape {arr.shape} dtype {arr.dtype}"
            )
        first = self._reserve(spec.key, arr.shape[0])
        arr = np.ascontiguousarray(arr, dtype=spec.dtype)
        self._pipeline.submit(self._io_array, spec, arr.copy() if self._pipeline.thread else arr, first)

    def _reserve(self, key: str, count: int) -> int:
        first = self._next.setdefault(key, self.next_example)
        if first + count > self.stop:
            raise WriterError(
                f"{key}: too many examples: {first - self.start} written + {count} in this batch > "
                f"{self.stop - self.start} expected"
                + (f" for rank {self.rank} of {self.world_size}" if self.world_size > 1 else "")
            )
        self._next[key] = first + count
        return first

    def _cast(self, acts: Any) -> tuple[npt.NDArray[Any], bool]:
        try:
            arr, owned = dtypes.to_stored(acts, self.md.dtype)
        except TypeError as err:
            raise WriterError(str(err)) from None
        want = self.md.shard_shape[1:]
        if arr.ndim != 4 or arr.shape[1:] != want:
            raise WriterError(
                f"acts: expected shape (B, {want[0]}, {want[1]}, {want[2]}) = (batch, layers, "
                f"tokens_per_ex, d_model), found {tuple(arr.shape)}"
            )
        return arr, owned

    def _nonfinite_error(self, original: Any, arr: npt.NDArray[Any], first: int) -> NonFiniteError:
        bad = dtypes.nonfinite_elements(arr, self.md.dtype)
        per_example = bad.reshape(arr.shape[0], -1).any(axis=1)
        examples = (np.flatnonzero(per_example) + first).tolist()
        shown = ", ".join(map(str, examples[:10])) + (", ..." if len(examples) > 10 else "")
        detail = ""
        if self.md.dtype == "float16":
            if dtypes.is_torch_tensor(original):
                biggest = float(original.detach().float().abs().nan_to_num(nan=0.0).max())
            else:
                biggest = float(np.nanmax(np.abs(np.asarray(original, np.float64))))
            detail = f"; float16 holds at most 65504, the largest |value| was {biggest:.6g}"
        return NonFiniteError(
            f"{int(bad.sum())} values in {len(examples)} examples (global indices {shown}) are not "
            f"finite after the cast to {self.md.dtype}{detail}; pass allow_nonfinite=True to store them"
        )

    def _check_open(self) -> None:
        if self._closed:
            raise WriterError("this writer is closed")
        self._pipeline.check()

    # -- I/O thread -------------------------------------------------------------------
    def _cursor(self, key: str, example: int, spec: _StreamSpec | None = None) -> _Cursor:
        k = example // self.md.examples_per_shard
        cur = self._cursors.get(key)
        if cur is None:
            # Bytes of the complete part (for O_DIRECT and disk-full messages); None for text.
            expected = None
            if key == "acts":
                expected = self.md.shard_nbytes(k)
            elif spec is not None and spec.dtype is not None:
                expected = self.md.shard_n_examples(k) * spec.dtype.itemsize * math.prod(spec.tail)
            cur = _Cursor(self.staging / part_file(k, key), k, expected)
            self._cursors[key] = cur
        return cur

    def _io_acts(self, arr: npt.NDArray[Any], first: int, lengths: npt.NDArray[Any] | None) -> None:
        pos = 0
        while pos < arr.shape[0]:
            cur = self._cursor("acts", first + pos)
            room = self.md.shard_n_examples(cur.k) - cur.count
            piece = arr[pos : pos + room]
            cur.write(piece)
            if self._stats_pool is not None:
                stats = self._shard_stats.setdefault(cur.k, _Stats(self.md.n_layers, self.md.d_model))
                piece_lengths = None if lengths is None else lengths[pos : pos + room]
                fut = self._stats_pool.submit(stats.update, piece, self.md.dtype, piece_lengths)
                self._stats_pending.append((cur.k, fut))
                while len(self._stats_pending) > _STATS_BACKLOG:
                    self._stats_pending.popleft()[1].result()
            cur.count += piece.shape[0]
            pos += piece.shape[0]
            if cur.count == self.md.shard_n_examples(cur.k):
                self._finish_part("acts", cur, {})

    def _io_array(self, spec: _StreamSpec, arr: npt.NDArray[Any], first: int) -> None:
        pos = 0
        while pos < arr.shape[0]:
            cur = self._cursor(spec.key, first + pos, spec)
            room = self.md.shard_n_examples(cur.k) - cur.count
            piece = arr[pos : pos + room]
            cur.write(piece)
            cur.count += piece.shape[0]
            pos += piece.shape[0]
            if cur.count == self.md.shard_n_examples(cur.k):
                self._finish_part(spec.key, cur, spec.to_json())

    def _io_text(self, spec: _StreamSpec, lines: list[bytes], first: int) -> None:
        pos = 0
        while pos < len(lines):
            cur = self._cursor(spec.key, first + pos, spec)
            room = self.md.shard_n_examples(cur.k) - cur.count
            piece = lines[pos : pos + room]
            cur.write(b"".join(piece))
            cur.count += len(piece)
            pos += len(piece)
            if cur.count == self.md.shard_n_examples(cur.k):
                self._finish_part(spec.key, cur, {"n_lines": cur.count})

    def _finish_part(self, key: str, cur: _Cursor, extra: dict[str, Any]) -> None:
        if key == "acts" and cur.expected_nbytes is not None and cur.nbytes < cur.expected_nbytes:
            # Protocol 2.1: saev memmaps every shard at full size; pad the last so it can read ours.
            pad = cur.expected_nbytes - cur.nbytes
            zeros = bytes(min(pad, IO_CHUNK))
            while pad:
                cur.write(zeros[: min(pad, IO_CHUNK)])
                pad -= min(pad, IO_CHUNK)
        # Only shard files are published as written, so only they need an fsync here. Part
        # files are joined into fresh files that finalize fsyncs, and a resumed writer
        # re-verifies every sealed part against its record, so losing an unsynced part or
        # record to a crash costs a rewrite, never a wrong cache.
        cur.close(self.durable and key == "acts")
        del self._cursors[key]
        fault_point("shard-written" if key == "acts" else "part-written", cur.k)
        self._done.setdefault(cur.k, {})[key] = {"nbytes": cur.nbytes, "xxh3_128": cur.hasher.hexdigest(), **extra}
        self._maybe_seal(cur.k)

    def _maybe_seal(self, k: int) -> None:
        done = self._done.get(k, {})
        if not all(key in done for key in self._io_keys):
            return
        while self._stats_pending and self._stats_pending[0][0] <= k:
            self._stats_pending.popleft()[1].result()
        stats = self._shard_stats.get(k)
        record = {
            "shard": k,
            "n_examples": self.md.shard_n_examples(k),
            "acts": done["acts"],
            "streams": {key: done[key] for key in sorted(self._io_keys) if key != "acts"},
            "stats": stats.to_json() if stats is not None else None,
        }
        record_path = self.staging / part_record(k)
        write_file_atomic(record_path, orjson.dumps(record), durable=False, note=_RESUME_NOTE)  # see _finish_part
        fault_point("record-written", k)

    # -- closing ----------------------------------------------------------------------
    def close(self) -> Path | None:
        """Finish writing; a single writer publishes and returns the cache's path.

        Raises `WriterError` (and publishes nothing) if any stream is incomplete.
        """
        if self._closed:
            return self.path if self.path.exists() else None
        try:
            self._pipeline.drain()
            missing = {key: self._next.get(key, self.next_example) for key in self._specs}
            short = {k: n for k, n in missing.items() if n != self.stop}
            if short:
                parts = ", ".join(
                    f"{k}: {n - self.start} of {self.stop - self.start} examples" for k, n in sorted(short.items())
                )
                raise WriterError(f"closing with missing examples ({parts}); nothing was published")
        except BaseException:
            self._abort()
            raise
        self._closed = True
        _release_buffers()
        if self._stats_pool is not None:
            self._stats_pool.shutdown()
        if self.world_size > 1:
            self._release_lock()
            return None
        try:
            finalize(self.root, self.md, verify=False, _lock_fd=self._lock_fd, durable=self.durable)
        finally:
            self._release_lock()
        return self.path

    def abort(self) -> None:
        """Stop writing and publish nothing. Sealed shards stay in staging for ``resume``."""
        self._abort()

    def _abort(self) -> None:
        self._closed = True
        try:
            pipeline = getattr(self, "_pipeline", None)
            if pipeline is not None:
                with contextlib.suppress(BaseException):
                    pipeline.drain()
            pool = getattr(self, "_stats_pool", None)
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
            for cur in list(getattr(self, "_cursors", {}).values()):
                cur.file.abandon()
        finally:
            _release_buffers()
            self._release_lock()

    def _release_lock(self) -> None:
        for attr in ("_range_lock_fd", "_lock_fd"):  # the range lock is only held under the other
            fd = getattr(self, attr, None)
            if fd is not None:
                os.close(fd)
                setattr(self, attr, None)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._abort()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            with contextlib.suppress(BaseException):
                self._abort()

    def __repr__(self) -> str:
        return (
            f"ShardWriter({str(self.path)!r}, rank={self.rank}/{self.world_size}, "
            f"examples [{self.start}, {self.stop}), next={self._next.get('acts', self.next_example)})"
        )


def _field(name: str) -> str:
    if not FIELD_NAME_RE.fullmatch(name):
        raise WriterError(f"bad column/text name {name!r}: use lower-case letters, digits and _ (max 64)")
    return name


def _to_numpy(x: Any) -> npt.NDArray[Any]:
    if dtypes.is_torch_tensor(x):
        return np.asarray(x.detach().cpu().numpy())
    return np.asarray(x)


# --------------------------------------------------------------------------------------
# finalize and publish
#
# The steps (numbered as in protocol.md section 6), and what a kill after each leaves; a
# resumed writer, or `finalize` alone, continues from every one of them:
#   1. part records checked             -> records and parts intact: finalize again
#   2. streams joined, stats.json,      -> removed and made again from the parts
#      checksums.json (2.1)
#   3. shards.json written              -> the commit point: staging holds the finished cache
#   4. part files and records removed   -> the finished cache: re-check it and publish
#   5. listing and sizes re-checked
#   6. files 0444, folder 0555          -> the same (write permission restored if needed)
#   7. renamed to <root>/<HASH>         -> published, complete and read-only
#   8. lock file removed                -> (before it: a lock file, removed by the next writer)


def _take_writer_lock(root: Path, md: Metadata, *, shared: bool, busy: str) -> int:
    """Lock ``md``'s staging directory for writing (``shared`` among several writers) or
    finalizing; `AlreadyPublishedError` if the cache is published, `WriterBusyError` if held."""
    final = root / md.hash
    fault_point("writer-start")
    if final.exists():
        _forget_lock(root, md)
        raise _already_published(final)
    fd = take_lock(lock_path(root, md), shared=shared)
    if fd is None:
        raise WriterBusyError(busy)
    fault_point("writer-lock")
    if final.exists():  # published while we waited for the lock: every holder sees it from now on
        os.close(fd)
        _forget_lock(root, md)
        raise _already_published(final)
    return fd


def _already_published(final: Path) -> AlreadyPublishedError:
    """What a second write of a published cache is told (in a notebook: re-running a cell)."""
    return AlreadyPublishedError(
        f"{final} is already published; published caches are immutable: read it with ss.open(path) "
        f"(or by a prefix of its hash in the shards root, ss.open({final.name[:8]!r})), or remove it with "
        f"`saev-shards rm {final.name[:12]}` to write it again"
    )


def _forget_lock(root: Path, md: Metadata) -> None:
    """Remove the lock file a published cache no longer needs (left by a kill after the
    rename), if nobody holds it; removing it while it is held would let two processes lock."""
    path = lock_path(root, md)
    if not path.exists():
        return
    with contextlib.suppress(OSError):
        fd = take_lock(path)
        if fd is not None:
            try:
                if not staging_dir(root, md).exists():
                    path.unlink()
            finally:
                os.close(fd)


class _Commit:
    """What a finalized staging directory holds (its shards.json, and the dialect's sidecars)."""

    def __init__(self, files: dict[str, tuple[int, str | None]], derived: dict[str, str]) -> None:
        #: Every file to publish: name -> (nbytes, xxh3_128 or None for the JSON files).
        self.files = files
        #: Files besides shards and JSON, as `ShardWriter._derived_files` describes them.
        self.derived = derived


def _read_commit(staging: Path, md: Metadata) -> _Commit | None:
    """The finished cache in ``staging`` if finalizing reached its commit point (shards.json
    written) and it lists exactly ``md``'s shards, each with its digest; else None (nothing
    committed)."""
    try:
        manifest, problems = md.format.load_manifest(staging, md)
        if manifest is None or problems:
            return None
        files: dict[str, tuple[int, str | None]] = {
            name: (os.lstat(staging / name).st_size, None)
            for name in (METADATA_FILE, MANIFEST_FILE, *md.format.sidecar_names)
        }
    except (OSError, ValueError):
        return None
    listed = manifest.files()
    files.update((name, (nbytes, digest)) for name, nbytes, digest in listed)
    derived: dict[str, str] = {}
    arrays = [*manifest.columns.values(), *([manifest.labels] if manifest.labels else [])]
    derived.update((a.name, f"{a.dtype} {list(a.shape[1:])}") for a in arrays)
    derived.update((t.name, "") for t in manifest.text.values())
    if manifest.stats is not None:
        derived[STATS_FILE] = ""
    expected = [(shard_name(k), md.shard_n_examples(k), md.shard_nbytes(k)) for k in range(md.n_shards)]
    if list(zip(manifest.shards.names, manifest.shards.counts, manifest.shards.sizes, strict=True)) != expected:
        return None
    if list(manifest.empty_shards.names) != _empty_shard_names(md):
        return None
    if any(digest is None for _, _, digest in listed):  # 2.1: checksums.json must list every file
        return None
    return _Commit(files, derived)


def _empty_shard_names(md: Metadata) -> list[str]:
    """The all-zero shard files the dialect's writer leaves after the last shard (protocol.md 9)."""
    return [shard_name(md.n_shards + i) for i in range(md.format.empty_shards(md))]


def _is_derived(name: str, md: Metadata) -> bool:
    """Files finalizing makes from the parts (and may make again): joins, stats, empty shards,
    the manifest and its sidecars."""
    return (
        name in (LABELS_FILE, STATS_FILE, MANIFEST_FILE, *md.format.sidecar_names, *_empty_shard_names(md))
        or (name.startswith("column.") and name.endswith(".bin"))
        or (name.startswith("text.") and name.endswith(".jsonl"))
    )


def _is_staging_only(name: str) -> bool:
    """Files that exist only while writing: parts, part records, temporary files, rank locks."""
    return (
        name.startswith("part")
        or name.endswith(".tmp")
        or name == OLD_LOCK_FILE
        or (name.startswith(".shards-") and name.endswith(LOCK_SUFFIX))
    )


def _unfinalize(staging: Path, md: Metadata) -> None:
    """Take a finalized staging directory back to its shards and part records (restoring
    write permission: a killed finalize may have frozen it)."""
    make_writable(staging)
    for name in os.listdir(staging):
        if _is_derived(name, md):
            remove_path(staging / name)


def finalize(
    root: str | os.PathLike[str],
    md: Metadata,
    *,
    verify: bool = True,
    durable: bool = True,
    _lock_fd: int | None = None,
) -> Path:
    """Check every shard's part record, join the parts, write the manifest and publish.

    Called automatically when a single writer closes. With several writers, call it
    once after every rank has closed; ``verify`` re-reads every part to check its
    digest. Raises `WriterError` naming every missing or broken shard, `WriterBusyError`
    while writers run, `AlreadyPublishedError` once published. Finishes what a killed
    finalize left, from any step.
    """
    root = Path(root)
    staging = staging_dir(root, md)
    final = root / md.hash
    lock_fd = _lock_fd
    if lock_fd is None:
        busy = f"{staging}: writers are still running; finalize after they close"
        lock_fd = _take_writer_lock(root, md, shared=False, busy=busy)
    try:
        if final.exists():
            raise _already_published(final)
        if not staging.is_dir():
            lock_path(root, md).unlink(missing_ok=True)  # we hold it exclusively (see take_lock)
            raise WriterError(f"nothing to finalize: {staging} does not exist")
        fault_point("finalize-start")
        _finalize_locked(root, md, staging, final, verify, durable)
        # Published: the lock file goes while we still hold it, so nobody can hold a stale one.
        lock_path(root, md).unlink(missing_ok=True)
        fault_point("lock-removed")
        return final
    finally:
        if _lock_fd is None:
            os.close(lock_fd)


def _finalize_locked(root: Path, md: Metadata, staging: Path, final: Path, verify: bool, durable: bool) -> None:
    md_path = staging / METADATA_FILE
    if not md_path.is_file() or md_path.read_bytes() != md.to_bytes():
        raise WriterError(f"{md_path} does not match the metadata being finalized")
    make_owner_writable(staging)
    commit = _read_commit(staging, md)
    if commit is None:
        files = _assemble(md, staging, verify, durable)
    else:
        files = commit.files
        if verify:
            bad = [
                f"{staging / name}: xxh3_128 differs from {MANIFEST_FILE}"
                for name, (_, digest) in sorted(files.items())
                if digest is not None and (staging / name).is_file() and hash_file(staging / name)[1] != digest
            ]
            if bad:
                raise WriterError(f"{staging}: cannot finalize:\n  " + "\n  ".join(bad[:50]))
    for name in os.listdir(staging):
        if _is_staging_only(name):
            remove_path(staging / name)
    fault_point("staging-cleaned")
    if not publish_dir(staging, final, durable, expected={name: n for name, (n, _) in files.items()}):
        raise AlreadyPublishedError(f"{final} was published by someone else meanwhile")


def _assemble(md: Metadata, staging: Path, verify: bool, durable: bool) -> dict[str, tuple[int, str | None]]:
    """Steps 1-3: check the part records, join the streams, write stats.json and the
    manifest (shards.json last: its presence means every file is complete). Returns every
    file to publish: name -> (nbytes, xxh3_128 or None)."""
    for name in os.listdir(staging):
        if _is_derived(name, md):  # from a finalize killed before its commit point
            remove_path(staging / name)
    records: list[dict[str, Any]] = []
    problems: list[str] = []
    for k in range(md.n_shards):
        try:
            records.append(strict_json_loads((staging / part_record(k)).read_bytes()))
        except FileNotFoundError:
            problems.append(f"shard {k}: not written (no {part_record(k)})")
        except (OSError, ValueError) as err:
            problems.append(f"shard {k}: unreadable part record ({err})")
    if problems:
        raise WriterError(
            f"{staging}: cannot finalize, {len(problems)} shards incomplete:\n  " + "\n  ".join(problems[:50])
        )
    stream_sets = {tuple(sorted(r["streams"])) for r in records}
    if len(stream_sets) > 1:
        raise WriterError(f"{staging}: shards were written with different streams: {sorted(stream_sets)}")
    streams = sorted(stream_sets.pop()) if records else []
    for r in records:
        k = r["shard"]
        for key, info in [("acts", r["acts"]), *r["streams"].items()]:
            path = staging / part_file(k, key)
            size = path.stat().st_size if path.exists() else -1
            if size != info["nbytes"]:
                problems.append(f"{path}: expected {info['nbytes']} bytes, found {size if size >= 0 else 'no file'}")
            elif verify and hash_file(path)[1] != info["xxh3_128"]:
                problems.append(f"{path}: xxh3_128 differs from its part record")
        if r["acts"]["nbytes"] != md.shard_nbytes(k):
            problems.append(f"shard {k}: expected {md.shard_nbytes(k)} bytes, record says {r['acts']['nbytes']}")
    if problems:
        raise WriterError(f"{staging}: cannot finalize:\n  " + "\n  ".join(problems[:50]))
    fault_point("finalize-checked")

    shards = ShardList.of(
        ShardEntry(shard_name(r["shard"]), r["n_examples"], r["acts"]["nbytes"], r["acts"]["xxh3_128"]) for r in records
    )
    labels = None
    columns: dict[str, ArrayEntry] = {}
    text: dict[str, TextEntry] = {}
    for i, key in enumerate(streams):
        info = records[0]["streams"][key]
        if any(
            r["streams"][key].get("dtype") != info.get("dtype") or r["streams"][key].get("shape") != info.get("shape")
            for r in records
        ):
            raise WriterError(f"{staging}: stream {key!r} has different dtypes or shapes across shards")
        total = sum(r["streams"][key]["nbytes"] for r in records)
        if key == "labels":
            nbytes, digest = _join(staging, md, key, LABELS_FILE, durable, total)
            labels = ArrayEntry(LABELS_FILE, info["dtype"], (md.n_examples, *info["shape"]), nbytes, digest)
        elif key.startswith("column."):
            name = key.split(".", 1)[1]
            nbytes, digest = _join(staging, md, key, column_file(name), durable, total)
            columns[name] = ArrayEntry(
                column_file(name), info["dtype"], (md.n_examples, *info["shape"]), nbytes, digest
            )
        else:
            name = key.split(".", 1)[1]
            nbytes, digest = _join(staging, md, key, text_file(name), durable, total)
            text[name] = TextEntry(text_file(name), md.n_examples, nbytes, digest)
        fault_point("joined", i)
    stats_entry = None
    if records and all(r["stats"] is not None for r in records):
        total_stats = _Stats(md.n_layers, md.d_model)
        for r in records:  # shard order: the sums are the same for any number of writers
            total_stats.add(_Stats.from_json(r["stats"], md.n_layers, md.d_model))
        data = pretty_json(total_stats.summary(md.layers))
        write_file_atomic(staging / STATS_FILE, data, durable, note=_FINALIZE_NOTE)
        stats_entry = FileEntry(STATS_FILE, len(data), xxhash.xxh3_128_hexdigest(data))
        fault_point("stats-written")
    empty = ShardList.of(_write_empty_shard(staging, md, name, durable) for name in _empty_shard_names(md))
    manifest = Manifest(shards=shards, labels=labels, columns=columns, text=text, stats=stats_entry, empty_shards=empty)
    files: dict[str, tuple[int, str | None]] = dict(
        (name, (nbytes, digest)) for name, nbytes, digest in manifest.files()
    )
    files[METADATA_FILE] = ((staging / METADATA_FILE).stat().st_size, None)
    sidecars = md.format.sidecars(manifest, md)
    for name, data in sidecars.items():  # before shards.json: it commits what they say
        write_file_atomic(staging / name, data, durable, note=_FINALIZE_NOTE)
        files[name] = (len(data), None)
    if sidecars:
        fault_point("checksums-written")
    manifest_bytes = md.format.manifest_bytes(manifest, md)
    write_file_atomic(staging / MANIFEST_FILE, manifest_bytes, durable, note=_FINALIZE_NOTE)  # the commit point
    files[MANIFEST_FILE] = (len(manifest_bytes), None)
    fault_point("manifest-written")
    return files


def _write_empty_shard(staging: Path, md: Metadata, name: str, durable: bool) -> ShardEntry:
    """An all-zero, full-size shard file listed with ``n_examples`` 0, as saev's writer leaves one."""
    nbytes = md.examples_per_shard * md.example_nbytes
    h = xxhash.xxh3_128()
    zeros = memoryview(bytes(min(nbytes, IO_CHUNK)))
    path = staging / name
    with naming_disk_full(path, nbytes, _FINALIZE_NOTE), open(path, "wb", buffering=0) as out:
        left = nbytes
        while left:
            piece = zeros[: min(left, IO_CHUNK)]
            write_all(out, piece)
            h.update(piece)
            left -= len(piece)
        if durable:
            os.fsync(out.fileno())
    return ShardEntry(name, 0, nbytes, h.hexdigest())


def _join(staging: Path, md: Metadata, key: str, name: str, durable: bool, expected: int) -> tuple[int, str]:
    """Concatenate stream ``key``'s per-shard parts, in shard order, into ``name``; ``(nbytes, digest)``."""
    h = xxhash.xxh3_128()
    total = 0
    out_path = staging / name
    buffer = memoryview(bytearray(IO_CHUNK))
    with naming_disk_full(out_path, expected, _FINALIZE_NOTE), open(out_path, "wb", buffering=0) as out:
        for k in range(md.n_shards):
            with open(staging / part_file(k, key), "rb", buffering=0) as f:
                total += stream(f, out, h, buffer=buffer)
        if durable:
            os.fsync(out.fileno())
    return total, h.hexdigest()
