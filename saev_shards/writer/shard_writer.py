"""`ShardWriter`: the public writing API. It checks what the caller gives (caller thread)
and hands each batch to the I/O thread (`saev_shards.writer.streams`); a single writer
publishes on close (`saev_shards.writer.finalize`)."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from .. import world
from ..codecs import dtypes, float8
from ..errors import MetadataError, NonFiniteError, Problems, ProtocolWarning, WriterError
from ..protocol.common import COLUMN_DTYPES, FIELD_NAME_RE, FLOAT8, LABELS_DTYPE
from ..protocol.float8 import FLOAT8_DTYPE, NAN_BYTE, SCALE_RULE, describe_scale, odd_scales, scales_plain
from ..protocol.jsonfile import is_int
from ..protocol.metadata import Metadata
from ..protocol.saev_code import SAEV_ROOT_PARTS
from ..protocol.staging import SCALES, staging_dir
from .direct import _release_buffers
from .finalize import finalize
from .resume import _derived_files, _open_staging, _resume
from .stats import _StatsPass
from .streams import _Parts, _Pipeline, _StreamSpec


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
        _check_writable(self.root, md, extras=bool(stats or columns or text))

        # Streams known so far (caller thread): key -> spec. "acts" always exists.
        self._specs: dict[str, _StreamSpec] = {"acts": _StreamSpec("acts", md.numpy_dtype, md.shard_shape[1:])}
        if labels:
            self._declare("labels", LABELS_DTYPE, (md.patches_per_ex,))
        for name, (dt, tail) in _parse_columns(columns).items():
            self._declare(f"column.{_field(name)}", dt, tail)
        for name in text:
            self._declare(f"text.{_field(name)}", None, ())
        # Whether statistics see lengths (decided by the first batch; see write()).
        self._stats_lengths: bool | None = None
        # Examples accepted per stream (caller thread), as global example indices.
        self._next: dict[str, int] = {}

        self._stats = _StatsPass(md.n_layers, md.d_model, md.dtype) if stats else None
        keys = set(self._specs) | ({SCALES} if md.dtype == FLOAT8 else set())  # scales seal with their shard
        self._parts = _Parts(md, self.staging, keys, self._stats, durable)

        self.root.mkdir(parents=True, exist_ok=True)
        derived = _derived_files(self._specs, stats)
        self._lock_fd, self._range_lock_fd, committed = _open_staging(
            self.root, md, self.shards, self.world_size, resume, derived, durable
        )
        self.next_example = self.start
        if committed:  # finalized but not renamed: nothing left to write
            self.next_example = self.stop
        elif resume:
            self.next_example = _resume(self._parts, self.shards, self.stop, self._specs)
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
            arr, owned, scales = _quantized(self.md, acts, scales)
        else:
            arr, owned, scales = _cast(self.md, acts)
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
            raise _nonfinite_error(self.md, acts, arr, first)
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
            arr = _exact_cast(arr, spec.dtype)
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
            lines = _json_lines(name, values)
            first = self._reserve(spec.key, len(lines))
            self._pipeline.submit(self._parts.write, spec, lines, first, None)

    def _append_array(self, spec: _StreamSpec, arr: npt.NDArray[Any]) -> None:
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
        _release_buffers()
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
            self.abort()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            with contextlib.suppress(BaseException):
                self.abort()

    def __repr__(self) -> str:
        return (
            f"ShardWriter({str(self.path)!r}, rank={self.rank}/{self.world_size}, "
            f"examples [{self.start}, {self.stop}), next={self._next.get('acts', self.next_example)})"
        )


_COLUMNS_EXAMPLE = "{'lengths': ('int32', ()), 'token_ids': ('int32', (64,))}"


def _parse_columns(columns: object) -> dict[str, tuple[np.dtype[Any], tuple[int, ...]]]:
    """``columns=`` checked: name -> (numpy dtype, shape of one example's value); every
    problem in one `WriterError` (a wrong value once gave "too many values to unpack")."""
    if columns is None:
        return {}
    if not isinstance(columns, Mapping):
        raise WriterError(
            f"columns: expected a mapping of column name -> (dtype, shape) such as {_COLUMNS_EXAMPLE}, "
            f"found {type(columns).__name__}"
        )
    problems = Problems(WriterError)
    parsed: dict[str, tuple[np.dtype[Any], tuple[int, ...]]] = {}
    for name, spec in columns.items():
        where = f"columns[{name!r}]"
        if not isinstance(name, str):
            problems.expected(where, "a column name (a string)", type(name).__name__)
            continue
        if isinstance(spec, (str, bytes, np.dtype, type)) or not isinstance(spec, (tuple, list)) or len(spec) != 2:
            problems.expected(where, "(dtype, shape) such as ('int32', ()) or ('int32', (64,))", repr(spec))
            continue
        dt, shape = spec
        try:
            dtype = np.dtype(dt)
        except TypeError:
            problems.expected(f"{where} dtype", f"a numpy dtype of {list(COLUMN_DTYPES)}", repr(dt))
            continue
        if isinstance(shape, int) or not isinstance(shape, (tuple, list)):
            problems.expected(f"{where} shape", "a tuple of sizes, () for one value per example", repr(shape))
            continue
        if not all(is_int(n, numpy_ok=True) and n >= 0 for n in shape):
            problems.expected(f"{where} shape", "sizes >= 0", repr(shape))
            continue
        parsed[name] = (dtype, tuple(int(n) for n in shape))
    problems.raise_if_any()
    return parsed


def _field(name: str) -> str:
    if not FIELD_NAME_RE.fullmatch(name):
        raise WriterError(f"bad column/text name {name!r}: use lower-case letters, digits and _ (max 64)")
    return name


def _to_numpy(x: Any) -> npt.NDArray[Any]:
    if dtypes.is_torch_tensor(x):
        return np.asarray(x.detach().cpu().numpy())
    return np.asarray(x)


def _nonfinite_error(md: Metadata, original: Any, arr: npt.NDArray[Any], first: int) -> NonFiniteError:
    if md.dtype == FLOAT8:  # whole vectors are stored as NaN: count the values given instead
        given = original.detach().float().cpu().numpy() if dtypes.is_torch_tensor(original) else original
        with np.errstate(over="ignore"):
            bad = ~np.isfinite(np.asarray(given, np.float32))
    else:
        bad = dtypes.nonfinite_elements(arr, md.dtype)
    per_example = bad.reshape(arr.shape[0], -1).any(axis=1)
    examples = (np.flatnonzero(per_example) + first).tolist()
    shown = ", ".join(map(str, examples[:10])) + (", ..." if len(examples) > 10 else "")
    detail = ""
    if md.dtype == FLOAT8:
        detail = " (float8_e4m3 stores a vector holding inf or NaN as NaN)"
    if md.dtype == "float16":
        if dtypes.is_torch_tensor(original):
            biggest = float(original.detach().float().abs().nan_to_num(nan=0.0).max())
        else:
            biggest = float(np.nanmax(np.abs(np.asarray(original, np.float64))))
        detail = f"; float16 holds at most 65504, the largest |value| was {biggest:.6g}"
    return NonFiniteError(
        f"{int(bad.sum())} values in {len(examples)} examples (global indices {shown}) are not "
        f"finite after the cast to {'float32' if md.dtype == FLOAT8 else md.dtype}{detail}; pass "
        "allow_nonfinite=True to store them"
    )


def _check_writable(root: Path, md: Metadata, extras: bool) -> None:
    """Raise if ``md``'s dialect cannot hold this cache; warn where saev would not find it."""
    if not md.rules.holds_extras and extras:
        raise WriterError(
            f"protocol {md.protocol} caches ({md.rules.summary}) hold activations and labels only; use protocol 3.0"
        )
    with Problems(MetadataError, head=f"cannot write a {md.rules.summary} cache: ") as problems:
        md.rules.check_writable(md, problems)
    if md.rules.legacy and root.absolute().parts[-2:] != SAEV_ROOT_PARTS:
        warnings.warn(
            f"{root.absolute()}: saev's readers look for caches in a folder ending in saev/shards/<name> "
            "(its writers want a root ending in saev/shards); this cache opens here with saev_shards only, "
            "move it (or link it) under .../saev/shards for saev",
            ProtocolWarning,
            stacklevel=3,
        )


def _cast(md: Metadata, acts: Any) -> tuple[npt.NDArray[Any], bool, npt.NDArray[Any] | None]:
    """``acts`` in the stored dtype, whether that is a fresh array (not the caller's memory),
    and for float8_e4m3 the scale of each vector ``(B, L, T)`` (`float8.quantize`)."""
    want = md.shard_shape[1:]
    shape = tuple(getattr(acts, "shape", np.shape(acts)))
    if len(shape) != 4 or shape[1:] != want:
        raise WriterError(
            f"acts: expected shape (B, {want[0]}, {want[1]}, {want[2]}) = (batch, layers, "
            f"tokens_per_ex, d_model), found {shape}"
        )
    try:
        if md.dtype == FLOAT8:
            values, scales = float8.quantize(acts)
            return values, True, scales
        arr, owned = dtypes.to_stored(acts, md.dtype)
    except TypeError as err:
        raise WriterError(str(err)) from None
    return arr, owned, None


def _quantized(md: Metadata, values: Any, scales: Any) -> tuple[npt.NDArray[Any], bool, npt.NDArray[Any]]:
    """Values quantized already, with their scales, checked against ``md`` (`ShardWriter.write`)."""
    if md.dtype != FLOAT8:
        raise WriterError(f"scales: a {md.dtype} cache has no scales (only float8_e4m3 caches take quantized values)")
    arr = _to_numpy(values)
    if arr.dtype == np.uint8:
        arr = arr.view(FLOAT8_DTYPE)
    want = md.shard_shape[1:]
    if arr.dtype != FLOAT8_DTYPE or arr.ndim != 4 or arr.shape[1:] != want:
        raise WriterError(
            f"acts: with scales, expected float8_e4m3fn values (or their uint8 bytes) of shape (B, {want[0]}, "
            f"{want[1]}, {want[2]}), found {arr.dtype} {tuple(arr.shape)}"
        )
    s = _to_numpy(scales)
    if s.dtype != np.float32 or s.shape != arr.shape[:3]:
        raise WriterError(f"scales: expected float32 of shape {arr.shape[:3]}, found {s.dtype} {tuple(s.shape)}")
    if not scales_plain(s):  # the scale rule's (protocol.md 5), as every reader checks it
        odd, nan = odd_scales(s)
        if odd.size:
            at = tuple(int(i) for i in np.unravel_index(int(odd[0]), s.shape))
            raise WriterError(
                f"scales: {SCALE_RULE}, found {describe_scale(s.reshape(-1)[odd[0]])} at (example, "
                f"layer, token) {at} of the batch ({odd.size} such scales)"
            )
        rows = arr.view(np.uint8).reshape(-1, arr.shape[-1])[nan]
        if not (rows == NAN_BYTE).all():
            raise WriterError("scales: a NaN scale is that of a vector stored as NaN, whose bytes are all 0x7f")
    # Fresh copies: the caller may reuse its buffers while the writer writes in the background.
    return np.array(arr, order="C"), True, np.array(s, order="C")


def _json_lines(name: str, values: Sequence[Any]) -> list[bytes]:
    """One JSON line per example of text field ``name``."""
    if isinstance(values, (str, bytes)):
        raise WriterError(f"text {name!r}: expected a sequence with one value per example, found a string")
    lines = []
    for v in values:
        try:
            lines.append(orjson.dumps(v) + b"\n")
        except TypeError as err:
            raise WriterError(f"text {name!r}: value {v!r} is not JSON-serialisable ({err})") from err
    return lines


def _exact_cast(arr: npt.NDArray[Any], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """``arr`` as ``dtype`` where the cast keeps every value (int64 lengths into int32), else as is."""
    if arr.dtype != dtype and np.can_cast(arr.dtype, dtype, "same_kind"):
        cast = arr.astype(dtype)
        if np.array_equal(cast.astype(arr.dtype), arr, equal_nan=arr.dtype.kind == "f"):
            return cast
    return arr
