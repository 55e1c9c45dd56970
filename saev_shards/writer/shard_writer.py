"""`ShardWriter`: the public writing API. It checks what the caller gives (caller thread)
and hands each batch to the I/O thread (`saev_shards.writer.streams`); a single writer
publishes on close (`saev_shards.writer.finalize`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import world
from ..codecs import dtypes
from ..errors import WriterError
from ..protocol.common import FLOAT8, LABELS_DTYPE
from ..protocol.metadata import Metadata
from ..protocol.staging import SCALES, staging_dir
from .direct import release_buffers
from .finalize import finalize
from .inputs import (
    cast,
    check_writable,
    exact_cast,
    field_name,
    json_lines,
    lengths_problem,
    nonfinite_error,
    parse_columns,
    quantized,
    stream_dtype,
    to_numpy,
)
from .resume import derived_files, open_staging, take_sealed
from .stats import StatsPass
from .streams import Parts, Pipeline, StreamSpec


def rank_shards(n_shards: int, rank: int, world_size: int) -> range:
    """The contiguous block of shard indices writer ``rank`` of ``world_size`` writes."""
    return world.share(n_shards, *world.check(rank, world_size, WriterError))


def world_from_env(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)`` by `saev_shards.world.detect`: explicit values, else an initialised
    torch.distributed group, else torchrun's RANK/WORLD_SIZE, else a SLURM array, else ``(0, 1)``."""
    found = world.detect(rank, world_size, slurm_array=True, error=WriterError)
    return found.rank, found.world_size


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
            undeclared streams are also accepted on first use. ``columns`` maps each
            column's name to ``(dtype, shape)``: the numpy dtype of one value (one of
            `COLUMN_DTYPES`: bool, (u)int8-64, float16-64) and the shape of one example's
            value, ``()`` for a scalar: ``{"lengths": ("int32", ()), "token_ids":
            ("int32", (T,))}``. Anything else raises `WriterError` saying so.
        background: write, hash and sum the statistics in background threads, overlapping
            the caller; without it every batch's work is done in `write` (for a caller whose
            own work keeps every core busy, where threads beside it only slow it down).
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
        columns: Mapping[str, tuple[Any, Sequence[int]]] | None = None,
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
        text = tuple(text)
        check_writable(self.root, md, extras=bool(stats or columns or text))

        # Streams known so far (caller thread): key -> spec. "acts" always exists.
        self._specs: dict[str, StreamSpec] = {"acts": StreamSpec("acts", md.numpy_dtype, md.shard_shape[1:])}
        if labels:
            self._declare("labels", LABELS_DTYPE, (md.patches_per_ex,))
        for name, (dt, tail) in parse_columns(columns).items():
            self._declare(f"column.{field_name(name)}", dt, tail)
        for name in text:
            self._declare(f"text.{field_name(name)}", None, ())
        # Whether statistics see lengths (decided by the first batch; see write()).
        self._stats_lengths: bool | None = None
        # Examples accepted per stream (caller thread), as global example indices.
        self._next: dict[str, int] = {}

        self._stats = StatsPass(md.n_layers, md.d_model, md.dtype, background=background) if stats else None
        keys = set(self._specs) | ({SCALES} if md.dtype == FLOAT8 else set())  # scales seal with their shard
        self._parts = Parts(md, self.staging, keys, self._stats, durable)

        self.root.mkdir(parents=True, exist_ok=True)
        derived = derived_files(self._specs, stats)
        self._lock_fd, self._range_lock_fd, committed = open_staging(
            self.root, md, self.shards, self.world_size, resume, derived, durable
        )
        self.next_example = self.start
        if committed:  # finalized but not renamed: nothing left to write
            self.next_example = self.stop
        elif resume:
            self.next_example = take_sealed(self._parts, self.shards, self.stop, self._specs)
        for key in self._specs:
            self._next[key] = self.next_example
        self._pipeline = Pipeline(background)

    # -- set-up ---------------------------------------------------------------------
    def _declare(self, key: str, dtype: np.dtype[Any] | None, tail: tuple[int, ...]) -> StreamSpec:
        spec = StreamSpec(key, stream_dtype(key, dtype), tail)
        self._specs[key] = spec
        pipeline = getattr(self, "_pipeline", None)
        if pipeline is not None:
            pipeline.submit(self._parts.keys.add, key)
        return spec

    # -- public writing API (caller thread) -----------------------------------------
    def write(
        self,
        acts: Any,
        *,
        labels: Any = None,
        columns: Mapping[str, Any] | None = None,
        text: Mapping[str, Sequence[Any]] | None = None,
        scales: Any = None,
    ) -> None:
        """Append a batch of activations ``(B, L, T, D)``; optionally its labels, columns and text.

        Batches may have any size and may straddle shard boundaries. A float8_e4m3 cache
        quantizes float activations by the rule of protocol.md 5; with ``scales`` ``(B, L, T)``
        it takes ``acts`` as values quantized already (E4M3 values or their bytes, with their
        float32 scales, as another float8_e4m3 cache holds them: `Shards.raw`, `Shards.scales`)
        and stores them as they are.
        """
        self._check_open()
        if scales is not None:
            arr, owned, scales = quantized(self.md, acts, scales)
        else:
            arr, owned, scales = cast(self.md, acts)
        batch = arr.shape[0]
        first = self._reserve("acts", batch)
        lengths = None
        if columns and "lengths" in columns:
            lengths = to_numpy(columns["lengths"])
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
            raise nonfinite_error(self.md, acts, arr, first)
        if self._pipeline.thread is not None and not owned:
            arr = arr.copy()  # the caller may reuse its buffer while we write in the background
        self._pipeline.submit(self._parts.write, self._specs["acts"], arr, first, lengths, scales)
        if labels is not None:
            self.write_labels(labels)
        if columns:
            self._write_columns(columns, with_acts=True)
        if text:
            self.write_text(**text)

    def write_labels(self, labels: Any) -> None:
        """Append patch labels ``(B, patches_per_ex)`` uint8 (no [CLS] column)."""
        self._check_open()
        arr = to_numpy(labels)
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
            key = f"column.{field_name(name)}"
            arr = to_numpy(values)
            if arr.ndim == 0:
                raise WriterError(f"column {name!r}: expected an array with a batch axis, found a scalar")
            spec = self._specs.get(key) or self._declare(key, arr.dtype, arr.shape[1:])
            assert spec.dtype is not None
            arr = exact_cast(arr, spec.dtype)
            if name == "lengths":
                self._check_lengths(arr)
            self._append_array(spec, arr)

    def _check_lengths(self, lengths: npt.NDArray[Any], batch_reserved: int = 0) -> None:
        problem = lengths_problem(lengths, self.md.tokens_per_ex)
        if problem is not None:
            self._next["acts"] -= batch_reserved
            raise WriterError(problem)

    def write_text(self, **fields: Sequence[Any]) -> None:
        """Append per-example text (or any JSON value), one per example, e.g. ``write_text(prompt=[...])``."""
        self._check_open()
        for name, values in fields.items():
            key = f"text.{field_name(name)}"
            spec = self._specs.get(key) or self._declare(key, None, ())
            lines = json_lines(name, values)
            first = self._reserve(spec.key, len(lines))
            self._pipeline.submit(self._parts.write, spec, lines, first, None)

    def _append_array(self, spec: StreamSpec, arr: npt.NDArray[Any]) -> None:
        if arr.ndim < 1 or arr.shape[1:] != spec.tail or arr.dtype != spec.dtype:
            raise WriterError(
                f"{spec.key}: expected shape (B, {', '.join(map(str, spec.tail))}) dtype {spec.dtype}, "
                f"found shape {arr.shape} dtype {arr.dtype}"
            )
        first = self._reserve(spec.key, arr.shape[0])
        arr = np.ascontiguousarray(arr, dtype=spec.dtype)
        self._pipeline.submit(self._parts.write, spec, arr.copy() if self._pipeline.thread else arr, first, None)

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

    def _check_open(self) -> None:
        if self._closed:
            raise WriterError("this writer is closed")
        self._pipeline.check()

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
            self.abort()
            raise
        self._closed = True
        release_buffers()
        if self._stats is not None:
            self._stats.shutdown()
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
        self._closed = True
        try:
            pipeline = getattr(self, "_pipeline", None)
            if pipeline is not None:
                with contextlib.suppress(BaseException):
                    pipeline.drain()
            stats = getattr(self, "_stats", None)
            if stats is not None:
                stats.shutdown(cancel=True)
            parts = getattr(self, "_parts", None)
            if parts is not None:
                parts.abandon()
        finally:
            release_buffers()
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
        (self.close if exc_type is None else self.abort)()  # published only without an error

    def __del__(self) -> None:
        try:  # not contextlib.suppress: None at interpreter shutdown (`Shards.__del__`)
            if not getattr(self, "_closed", True):
                self.abort()
        except BaseException:  # noqa: S110
            pass

    def __repr__(self) -> str:
        return (
            f"ShardWriter({str(self.path)!r}, rank={self.rank}/{self.world_size}, "
            f"examples [{self.start}, {self.stop}), next={self._next.get('acts', self.next_example)})"
        )
