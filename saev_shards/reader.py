"""`open` a cache and read it: validation up front, memmaps opened lazily per process."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import orjson

from . import layout
from ._indexing import getitem
from .dtypes import to_float32
from .errors import (
    CacheNotFoundError,
    ChecksumMismatchError,
    FileSizeError,
    HashMismatchError,
    InvalidCacheError,
    LayerIndexError,
    ManifestError,
    MetadataError,
    MetadataFileError,
    NameNotFoundError,
    NotRegularFileError,
    Problem,
    ProtocolVersionError,
    StatsFileError,
    UnexpectedFileError,
    raise_problems,
)
from .fileio import IO_CHUNK, file_kind, hash_file, pread_exact
from .manifest import Manifest
from .metadata import Metadata, parse_metadata
from .progress import Progress
from .protocol import is_cache_name
from .protocol.common import (
    CHECKSUMS_FILE,
    LABELS_FILE,
    MANIFEST_FILE,
    MAX_METADATA_BYTES,
    METADATA_FILE,
    SHARD_NAME_RE,
    STATS_FILE,
    ProtocolWarning,
    stats_max_bytes,
)
from .protocol.jsonfile import load_json, short_repr
from .protocol.v3 import parse_stats
from .units import human_bytes

PathLike = str | os.PathLike[str]


def open(path: PathLike, *, check_hash: bool = True, roots: PathLike | Sequence[PathLike] | None = None) -> Shards:
    """Open the cache at ``path``, checking everything that can be checked without reading shards.

    ``path`` may also be a full hash or a unique hash prefix (at least 4 hex digits) of a
    cache in the shards roots (``roots``, else ``$SAEV_SHARDS_ROOT``, else
    ``$SAEV_SCRATCH/saev/shards``; see `saev_shards.store.resolve`). An existing path
    always wins. A path through symbolic links (a run's ``links/train-shards``) is resolved
    once; `Shards.path` is the real directory, and its name is what must equal the hash.

    Checks (protocol.md section 7): both JSON files are strict JSON (`format.strict_json_loads`)
    of bounded size with exact key sets and types, a known protocol version, the directory
    name equals the metadata hash (unless ``check_hash=False``), shard names and counts,
    every listed file exists, is a regular file (not a symbolic link) and has exactly the
    expected size, and no unlisted data file exists. Every problem is collected and raised
    at once (see `errors`).
    """
    root = Path(path).absolute()
    if not root.exists():
        from . import store  # only when `path` is not a path: a hash, a prefix, or a mistake

        root = store.resolve(path, roots)
    root = Path(os.path.realpath(root))
    where = str(root)
    if not root.is_dir():
        raise CacheNotFoundError(f"{where} is not a directory")
    md, problems = _load_metadata(root, check_hash)
    if md is None:
        raise_problems(problems, where)
        raise AssertionError("unreachable")
    manifest, more = _load_manifest(root, md)
    problems.extend(more)
    raise_problems(problems, where)
    assert manifest is not None
    if md.format.legacy:
        warnings.warn(
            f"{where}: a protocol {md.protocol} cache ({md.format.summary}, float32), read with the "
            f"compatibility rules of protocol.md section 9 (no checksums unless {CHECKSUMS_FILE} is "
            "there; the last shard may be padded to a full shard)",
            ProtocolWarning,
            stacklevel=2,
        )
    return Shards(root, md, manifest)


def _load_metadata(root: Path, check_hash: bool) -> tuple[Metadata | None, list[Problem]]:
    path = root / METADATA_FILE
    obj, problems = load_json(path, MAX_METADATA_BYTES, MetadataFileError)
    if problems:
        return None, problems
    try:
        md = parse_metadata(obj, root.name)
    except ProtocolVersionError as err:
        raise ProtocolVersionError(f"{path}: {err}") from None
    except MetadataError as err:
        return None, [Problem(MetadataFileError, f"{path}: {err}")]
    if check_hash and root.name != md.hash:
        detail = "" if is_cache_name(root.name) else f" (the directory name is not a {len(md.hash)}-digit hash)"
        problems.append(
            Problem(
                HashMismatchError,
                f"{root}: directory name is not the hash of its metadata.json{detail}; "
                f"expected {md.hash}, found {short_repr(root.name)}",
            )
        )
    return md, problems


def _load_manifest(root: Path, md: Metadata) -> tuple[Manifest | None, list[Problem]]:
    manifest, problems = md.format.load_manifest(root, md)
    if manifest is None or problems:
        return manifest, problems
    problems.extend(_check_shards(root, md, manifest))
    empty = manifest.empty_shards
    problems.extend(_check_files(root, empty.names, empty.sizes))
    problems.extend(_check_other_files(root, md, manifest))
    return manifest, problems


def _check_shards(root: Path, md: Metadata, manifest: Manifest) -> list[Problem]:
    problems: list[Problem] = []
    where = root / MANIFEST_FILE
    expected = md.n_shards
    if len(manifest.shards) != expected:
        problems.append(
            Problem(
                ManifestError,
                f"{where}: expected {expected} shards for n_examples={md.n_examples} and "
                f"examples_per_shard={md.examples_per_shard}, found {len(manifest.shards)}",
            )
        )
    eps = md.examples_per_shard
    example_nbytes = md.example_nbytes
    # One pass of list comparisons for the common, valid manifest (10^4 shards in a few ms);
    # entry-by-entry messages only for entries that differ.
    count = len(manifest.shards)
    want_names = _shard_names(min(count, 1_000_000))
    last = md.n_examples - (expected - 1) * eps
    extra = [0] * max(0, count - expected)
    want_counts = (([eps] * (expected - 1) + [last] if expected else []) + extra)[:count]
    names, counts, sizes = manifest.shards.names, manifest.shards.counts, manifest.shards.sizes
    # list arithmetic, not a loop: 10^4 shards
    full = eps * example_nbytes
    want_sizes = (([full] * (expected - 1) + [last * example_nbytes] if expected else []) + extra)[:count]
    if md.format.padded_last and count == expected and expected and sizes[-1] == full:
        want_sizes[-1] = full  # 2.1: the last shard's file padded to a full shard
    if names == want_names and counts == want_counts and sizes == want_sizes:
        problems.extend(_check_files(root, names, sizes))
        return problems
    ok_names: list[str] = []
    ok_sizes: list[int] = []
    for i, s in enumerate(manifest.shards):
        if i >= len(want_names) or s.name != want_names[i]:
            want = want_names[i] if i < len(want_names) else "(none: too many shards)"
            hint = "" if SHARD_NAME_RE.fullmatch(s.name) else " (shard names are plain acts<06d>.bin, no paths)"
            problems.append(
                Problem(ManifestError, f"{where}: shard {i}: expected name {want!r}, found {short_repr(s.name)}{hint}")
            )
        elif s.n_examples != want_counts[i]:
            problems.append(
                Problem(ManifestError, f"{where}: {s.name}: expected n_examples={want_counts[i]}, found {s.n_examples}")
            )
        elif s.nbytes != want_sizes[i]:
            problems.append(
                Problem(ManifestError, f"{where}: {s.name}: expected nbytes={want_sizes[i]}, found {s.nbytes}")
            )
        else:
            ok_names.append(s.name)
            ok_sizes.append(s.nbytes)
    problems.extend(_check_files(root, ok_names, ok_sizes))
    return problems


_SHARD_NAMES: list[str] = []


def _shard_names(count: int) -> list[str]:
    """``[acts000000.bin, ...]`` of length ``count``, built once per process and extended as needed."""
    if len(_SHARD_NAMES) < count:
        _SHARD_NAMES.extend(f"acts{i:06d}.bin" for i in range(len(_SHARD_NAMES), count))
    return _SHARD_NAMES[:count]


def _check_files(root: Path, names: Sequence[str], sizes: Sequence[int]) -> list[Problem]:
    """``lstat`` each file ``names[i]`` in ``root`` (relative to a directory fd: no path parsing)
    and check it is a regular file (a symbolic link is not) of ``sizes[i]`` bytes; one pass,
    problems worded only on failure. ``names`` are validated names: plain ``acts<06d>.bin``."""
    if not names:
        return []
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        regular = stat.S_ISREG
        bad = [
            i
            for i, (name, nbytes) in enumerate(zip(names, sizes, strict=True))
            if (st := os.stat(name, dir_fd=dir_fd, follow_symlinks=False)).st_size != nbytes or not regular(st.st_mode)
        ]
    except OSError:
        bad = list(range(len(names)))  # something is missing: the slow path words each problem
    finally:
        os.close(dir_fd)
    problems: list[Problem] = []
    for i in bad:
        problems.extend(_check_file(root / names[i], sizes[i]))
    return problems


def _check_file(path: Path, nbytes: int) -> list[Problem]:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return [Problem(CacheNotFoundError, f"{path}: missing")]
    except OSError as err:
        return [Problem(CacheNotFoundError, f"{path}: cannot stat ({err.strerror})")]
    if not stat.S_ISREG(st.st_mode):
        return [Problem(ManifestError, f"{path}: expected a regular file, found {file_kind(st.st_mode)}")]
    if st.st_size != nbytes:
        hint = " (file seems not fully written?)" if st.st_size < nbytes else ""
        return [Problem(FileSizeError, f"{path}: expected {nbytes} bytes, found {st.st_size}{hint}")]
    return []


def _check_other_files(root: Path, md: Metadata, manifest: Manifest) -> list[Problem]:
    problems: list[Problem] = []
    where = root / MANIFEST_FILE
    if manifest.labels is not None:
        want = (md.n_examples, md.patches_per_ex)
        lab = manifest.labels
        if lab.shape != want or lab.nbytes != md.n_examples * md.patches_per_ex:
            problems.append(
                Problem(ManifestError, f"{where}: labels: expected shape {list(want)} uint8, found {list(lab.shape)}")
            )
        else:
            problems.extend(_check_file(root / lab.name, lab.nbytes))
    for name, col in manifest.columns.items():
        itemsize = np.dtype(col.dtype).itemsize
        want_nbytes = int(np.prod(col.shape, dtype=object)) * itemsize
        if col.shape[0] != md.n_examples or col.nbytes != want_nbytes:
            problems.append(
                Problem(
                    ManifestError,
                    f"{where}: columns.{name}: expected shape ({md.n_examples}, ...) and nbytes = "
                    f"prod(shape) * {itemsize}, found shape {list(col.shape)} nbytes {col.nbytes}",
                )
            )
        else:
            problems.extend(_check_file(root / col.name, col.nbytes))
    for name, txt in manifest.text.items():
        if txt.n_lines != md.n_examples:
            problems.append(
                Problem(ManifestError, f"{where}: text.{name}: expected n_lines={md.n_examples}, found {txt.n_lines}")
            )
        else:
            problems.extend(_check_file(root / txt.name, txt.nbytes))
    if manifest.stats is not None:
        cap = stats_max_bytes(md.n_layers, md.d_model)
        if manifest.stats.nbytes > cap:
            problems.append(
                Problem(
                    ManifestError,
                    f"{where}: stats.nbytes: expected at most {cap:,} bytes for {md.n_layers} layers of "
                    f"{md.d_model} dimensions, found {manifest.stats.nbytes:,}",
                )
            )
        else:
            problems.extend(_check_file(root / manifest.stats.name, manifest.stats.nbytes))
    present = set(os.listdir(root))
    unlisted = present.difference(manifest.shards.names)  # set operations in C: 10^4 names
    unlisted.difference_update(manifest.empty_shards.names)
    unlisted.difference_update(name for name, _, _ in manifest.other_files())
    problems.extend(
        Problem(UnexpectedFileError, f"{root / name}: data file not listed in {MANIFEST_FILE}")
        for name in sorted(unlisted)
        if SHARD_NAME_RE.fullmatch(name)
        or name in (LABELS_FILE, STATS_FILE)
        or (name.startswith(("column.", "text.")) and name.endswith((".bin", ".jsonl")))
    )
    return problems


class TextColumn(Sequence[Any]):
    """Per-example JSON values of one text field, read lazily from its JSON Lines file."""

    def __init__(self, path: Path, n_lines: int) -> None:
        self.path = path
        self.n_lines = n_lines
        self._offsets: npt.NDArray[np.int64] | None = None

    def _index(self) -> npt.NDArray[np.int64]:
        if self._offsets is None:
            data = np.fromfile(self.path, dtype=np.uint8)
            ends = np.flatnonzero(data == ord("\n")) + 1
            if len(ends) != self.n_lines:
                raise ManifestError(f"{self.path}: expected {self.n_lines} lines, found {len(ends)}")
            self._offsets = np.concatenate([[0], ends]).astype(np.int64)
        return self._offsets

    def __len__(self) -> int:
        return self.n_lines

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n_lines))]
        i = int(i)
        if i < 0:
            i += self.n_lines
        if not 0 <= i < self.n_lines:
            raise IndexError(f"example {i} out of range [0, {self.n_lines})")
        offsets = self._index()
        with self.path.open("rb") as f:
            f.seek(int(offsets[i]))
            return self._value(f.read(int(offsets[i + 1] - offsets[i])), i)

    def __iter__(self) -> Iterator[Any]:
        count = 0
        with self.path.open("rb") as f:
            for count, line in enumerate(f, 1):
                if count > self.n_lines:
                    break
                yield self._value(line, count - 1)
        if count != self.n_lines:
            found = "more" if count > self.n_lines else str(count)
            raise ManifestError(f"{self.path}: expected {self.n_lines} lines, found {found}")

    def _value(self, line: bytes, i: int) -> Any:
        try:
            return orjson.loads(line)
        except orjson.JSONDecodeError as err:  # damaged since written: `verify` names the file
            raise InvalidCacheError(f"{self.path}: line {i + 1}: not valid JSON ({err})") from None


V = TypeVar("V")


class Fields(Mapping[str, V]):
    """A cache's per-example columns or text fields by name (`Shards.columns`, `Shards.text`).

    ``fields["name"]`` is the one spelling for both; ``fields("name")`` works too (earlier
    versions had ``shards.text("name")``). A name the cache does not have raises
    `NameNotFoundError` (a `KeyError` and a `ShardsError`) listing the names it has.
    Values are opened on first use and kept.
    """

    def __init__(self, kind: str, where: Path, names: Sequence[str], load: Callable[[str], V]) -> None:
        self._kind = kind
        self._where = where
        self._names = tuple(names)
        self._load = load
        self._values: dict[str, V] = {}

    def __getitem__(self, name: str) -> V:
        value = self._values.get(name) if isinstance(name, str) else None
        if value is None:
            if not isinstance(name, str) or name not in self._names:
                raise NameNotFoundError(
                    f"{self._where}: no {self._kind} {short_repr(name)}; this cache has "
                    + (f"{self._kind}s {sorted(self._names)}" if self._names else f"no {self._kind}s")
                )
            value = self._values[name] = self._load(name)
        return value

    def __call__(self, name: str) -> V:
        return self[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        return f"<{self._kind}s {list(self._names)}>"


class Shards:
    """An open cache: the logical tensor ``(n_examples, L, T, D)`` and everything beside it.

    Layers are named two ways, and each method says which it takes:

    * ``shards[i, j, t]`` indexes the logical tensor like a numpy array: ``j`` is a layer
      *position*, ``0..L-1`` in the order of ``metadata.layers``. A position out of range
      that is a recorded layer value raises `LayerIndexError` saying so.
    * `get`, `example`, `locate` and `layer_index` take layer *values* (the block numbers
      in ``metadata.layers``, e.g. 11); ``shards[:, shards.layer_index(11)]`` selects a
      layer by value in an index. `read_example` and `read_vectors` (the fast paths) take
      positions.

    Results are read-only views into the memmapped shards whenever numpy would return a
    view, copies otherwise. bfloat16 caches return raw uint16 bits; `to_float32` widens them.
    Per-example columns and text fields are mappings by name: ``shards.columns["lengths"]``,
    ``shards.text["prompt"]`` (`Fields`).

    Memmaps and file handles open lazily and per process: a pickled `Shards` carries no
    data and no handles, and a forked or unpickled copy opens its own.
    """

    def __init__(self, path: Path, metadata: Metadata, manifest: Manifest) -> None:
        self.path = path
        self.metadata = metadata
        self.manifest = manifest
        md = metadata
        self.shape = md.shape
        self.dtype = md.dtype
        self.numpy_dtype = md.numpy_dtype
        self.n_examples = md.n_examples
        self.examples_per_shard = md.examples_per_shard
        self.n_shards = len(manifest.shards)
        self._layer_idx = {layer: i for i, layer in enumerate(md.layers)}
        self._slice_nbytes = md.tokens_per_ex * md.d_model * md.itemsize  # one (example, layer) slice
        self._reset()

    # -- per-process handles -------------------------------------------------------------
    def _reset(self) -> None:
        self._pid = os.getpid()
        self._maps: dict[int, npt.NDArray[Any]] = {}
        self._fds: dict[int, int] = {}
        self._aux: dict[str, Any] = {}
        self._lock = threading.Lock()  # guards opening handles; a new one after fork or unpickling
        # The last `out` buffer given to read_example and its byte view (reused while it is).
        self._out_cache: tuple[npt.NDArray[Any], memoryview] | None = None

    def _check_pid(self) -> None:
        if self._pid != os.getpid():  # forked: never use the parent's handles
            self._reset()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_maps", "_fds", "_aux", "_pid", "_out_cache", "_lock"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def close(self) -> None:
        """Drop this process's memmaps and file descriptors (reopened on next use)."""
        if self._pid == os.getpid():
            for fd in self._fds.values():
                os.close(fd)
        self._reset()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter shutdown os may be gone
            self.close()

    def shard(self, k: int) -> npt.NDArray[Any]:
        """Shard ``k`` as a read-only array backed by a memory map, shape ``(n_examples_k, L, T, D)``."""
        self._check_pid()
        mm = self._maps.get(k)
        if mm is None:
            with self._lock:
                mm = self._maps.get(k)
                if mm is None:
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
                    fd = os.open(self.path / self.manifest.shards[k].name, os.O_RDONLY)
                    self._fds[k] = fd
        return fd

    # -- notebook API --------------------------------------------------------------------
    def __len__(self) -> int:
        return self.n_examples

    def __repr__(self) -> str:
        md = self.metadata
        n, l_, t, d = md.shape
        cls = "CLS + " if md.cls_token else ""
        extras = []
        if self.manifest.labels is not None:
            extras.append("labels")
        extras += [f"column {c}" for c in self.manifest.columns]
        extras += [f"text {t_}" for t_ in self.manifest.text]
        if self.manifest.stats is not None:
            extras.append("stats")
        return (
            f"<saev_shards.Shards {md.hash[:12]} {md.family}:{md.ckpt} shape=({n}, {l_}, {t}, {d}) "
            f"{md.dtype} layers={list(md.layers)} tokens={cls}{md.patches_per_ex} "
            f"shards={self.n_shards}x{md.examples_per_shard} {human_bytes(md.nbytes)} protocol={md.protocol}"
            + (f" [{', '.join(extras)}]" if extras else "")
            + f" at {self.path}>"
        )

    def layer_index(self, layer: int) -> int:
        """Position (``0..L-1``) of layer *value* ``layer``; `NameNotFoundError` (a `KeyError`)
        naming the recorded layer values if absent."""
        try:
            return self._layer_idx[layer]
        except (KeyError, TypeError):
            layers = list(self.metadata.layers)
            hint = ""
            integer = isinstance(layer, (int, np.integer)) and not isinstance(layer, bool)
            if integer and -len(layers) <= layer < len(layers):
                hint = f" ({layer} is a layer position: shards[:, {layer}] takes positions)"
            raise NameNotFoundError(
                f"layer {short_repr(layer)} was not recorded; recorded layer values are {layers}{hint}"
            ) from None

    def _example(self, example: int) -> tuple[int, int]:
        example = int(example)
        if example < 0:
            example += self.n_examples
        if not 0 <= example < self.n_examples:
            raise IndexError(f"example {example} out of range for a cache of {self.n_examples} examples")
        return layout.shard_of(example, self.examples_per_shard)

    def get(self, example: int, layer: int, token: int) -> npt.NDArray[Any]:
        """The ``(D,)`` activation of ``example`` at layer *value* ``layer`` and token ``token``."""
        k, i = self._example(example)
        t = int(token)
        if not -self.shape[2] <= t < self.shape[2]:
            raise IndexError(f"token {token} out of range [0, {self.shape[2]})")
        return np.asarray(self.shard(k)[i, self.layer_index(layer), t])

    def example(self, example: int, layer: int) -> npt.NDArray[Any]:
        """The ``(T, D)`` view of ``example`` at layer *value* ``layer``; reads nothing else."""
        k, i = self._example(example)
        return np.asarray(self.shard(k)[i, self.layer_index(layer)])

    def locate(self, example: int, layer: int, token: int) -> tuple[int, int]:
        """``(shard_index, byte_offset)`` of a vector; pure arithmetic, no I/O."""
        md = self.metadata
        return layout.locate(
            int(example),
            self.layer_index(layer),
            int(token),
            n_examples=md.n_examples,
            eps=md.examples_per_shard,
            n_layers=md.n_layers,
            tokens=md.tokens_per_ex,
            d_model=md.d_model,
            itemsize=md.itemsize,
        )

    def __getitem__(self, key: Any) -> npt.NDArray[Any]:
        """``logical[key]``: the layer axis takes positions ``0..L-1`` (class docstring)."""
        try:
            return getitem(self, key)
        except IndexError as err:
            value = self._layer_value_given_as_position(key)
            if value is None:
                raise
            layers = list(self.metadata.layers)
            raise LayerIndexError(
                f"layer position {value} is out of range for {len(layers)} layers (positions 0..{len(layers) - 1}); "
                f"{value} is a recorded layer value (layers {layers}): select it by value with "
                f"shards[..., shards.layer_index({value}), ...] (position {self._layer_idx[value]}), "
                f"or shards.example(i, {value})"
            ) from err

    def _layer_value_given_as_position(self, key: Any) -> int | None:
        """The first recorded layer value that ``key``'s layer component (``key[1]``) holds out of
        the position range, or None (only looked at once an index has failed)."""
        if not isinstance(key, tuple) or len(key) < 2 or key[0] is Ellipsis or key[1] is Ellipsis:
            return None
        n_layers = self.shape[1]
        try:
            values = np.asarray(key[1]).reshape(-1)
        except (TypeError, ValueError):
            return None
        if values.dtype.kind not in "iu":
            return None
        for v in values.tolist():
            if not -n_layers <= v < n_layers and v in self._layer_idx:
                return int(v)
        return None

    def to_float32(self, values: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
        """Values read from this cache as float32 (widens bfloat16 bits exactly)."""
        return to_float32(values, self.dtype)

    # -- fast copying reads (pread; used by loaders and benchmarks) ----------------------
    def read_example(self, example: int, layer_idx: int, out: npt.NDArray[Any] | None = None) -> npt.NDArray[Any]:
        """Copy ``[example, layer_idx]`` ``(T, D)`` into ``out`` with one ``pread``.

        ``layer_idx`` is a position in ``metadata.layers``. Reusing one ``out`` buffer is
        the fast path (its byte view is kept between calls).
        """
        n = self.n_examples
        if not 0 <= example < n:
            if not -n <= example < 0:
                raise IndexError(f"example {example} out of range for a cache of {n} examples")
            example += n
        n_layers = self.shape[1]
        if not 0 <= layer_idx < n_layers:
            raise IndexError(f"layer index {layer_idx} out of range [0, {n_layers})")
        if out is None:
            out = np.empty(self.shape[2:], self.numpy_dtype)
        cached = self._out_cache  # one attribute read: threads never pair a buffer with another's view
        view = cached[1] if cached is not None and cached[0] is out else self._byte_view_of(out)
        k, i = divmod(example, self.examples_per_shard)
        fd = self._fds.get(k) if self._pid == os.getpid() else None
        if fd is None:
            fd = self._fd(k)
        nbytes = self._slice_nbytes
        if os.preadv(fd, [view], (i * n_layers + layer_idx) * nbytes) != nbytes:
            pread_exact(fd, view, (i * n_layers + layer_idx) * nbytes)  # a short read: finish it
        return out

    def _byte_view_of(self, out: npt.NDArray[Any]) -> memoryview:
        if not out.flags.c_contiguous or out.dtype != self.numpy_dtype or out.nbytes != self._slice_nbytes:
            raise ValueError(
                f"out must be a C-contiguous {self.numpy_dtype} array of {self._slice_nbytes} bytes "
                f"(shape {self.shape[2:]}), found {out.dtype} {out.shape}"
            )
        view = out.reshape(-1).view(np.uint8).data
        self._out_cache = (out, view)
        return view

    def read_range(self, start: int, stop: int, out: npt.NDArray[Any] | None = None) -> npt.NDArray[Any]:
        """Copy examples ``[start, stop)`` ``(stop - start, L, T, D)`` into ``out``: one large
        sequential ``pread`` per shard touched (the fast path for streaming readers)."""
        md = self.metadata
        if not 0 <= start <= stop <= self.n_examples:
            raise IndexError(f"range [{start}, {stop}) is not within [0, {self.n_examples}]")
        if out is None:
            out = np.empty((stop - start, *md.shard_shape[1:]), self.numpy_dtype)
        if out.shape != (stop - start, *md.shard_shape[1:]) or out.dtype != self.numpy_dtype:
            raise ValueError(f"out must have shape {(stop - start, *md.shard_shape[1:])} and dtype {self.numpy_dtype}")
        if not out.flags.c_contiguous:
            raise ValueError("out must be C-contiguous")
        view = out.reshape(-1).view(np.uint8).data
        eps, example_nbytes = md.examples_per_shard, md.example_nbytes
        e = start
        pos = 0
        while e < stop:
            k, local = layout.shard_of(e, eps)
            count = min(stop, (k + 1) * eps) - e
            nbytes = count * example_nbytes
            pread_exact(self._fd(k), view[pos : pos + nbytes], local * example_nbytes)
            pos += nbytes
            e += count
        return out

    def read_vectors(
        self,
        examples: npt.ArrayLike,
        layer_idx: npt.ArrayLike,
        tokens: npt.ArrayLike,
        out: npt.NDArray[Any] | None = None,
    ) -> npt.NDArray[Any]:
        """Copy the ``(n, D)`` vectors ``[examples[j], layer_idx[j], tokens[j]]`` (positions, broadcast).

        Reads go in file order (sorted by shard and offset), and vectors that sit next to
        each other in a file are fetched by one ``preadv`` scattering into their rows. From a
        cold cache this reads only the bytes asked for, where memmap indexing pulls in a
        whole readahead window per vector.
        """
        md = self.metadata
        ex, li, tok = (np.asarray(a, dtype=np.int64) for a in np.broadcast_arrays(examples, layer_idx, tokens))
        ex, li, tok = ex.reshape(-1), li.reshape(-1), tok.reshape(-1)
        n = ex.size
        for name, values, size in (
            ("example", ex, md.n_examples),
            ("layer index", li, md.n_layers),
            ("token", tok, md.tokens_per_ex),
        ):
            if n and (values.min() < 0 or values.max() >= size):
                bad = values[(values < 0) | (values >= size)][0]
                raise IndexError(f"{name} {bad} out of range [0, {size})")
        if out is None:
            out = np.empty((n, md.d_model), self.numpy_dtype)
        if out.shape != (n, md.d_model) or out.dtype != self.numpy_dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous {self.numpy_dtype} array of shape {(n, md.d_model)}")
        if n == 0:
            return out
        shard, offset = layout.locate_many(
            ex, li, tok, eps=md.examples_per_shard, n_layers=md.n_layers, tokens=md.tokens_per_ex,
            d_model=md.d_model, itemsize=md.itemsize,
        )  # fmt: skip
        vec = md.d_model * md.itemsize
        order = np.lexsort((offset, shard))
        s_sorted, o_sorted = shard[order], offset[order]
        # A new run starts where the shard changes or the next vector is not adjacent in the file.
        starts = np.flatnonzero(np.r_[True, (np.diff(s_sorted) != 0) | (np.diff(o_sorted) != vec)])
        ends = np.r_[starts[1:], n]
        rows = out.reshape(n, -1).view(np.uint8)
        row_views = [memoryview(rows[j]) for j in order.tolist()]
        for a, b, k, off in zip(
            starts.tolist(), ends.tolist(), s_sorted[starts].tolist(), o_sorted[starts].tolist(), strict=True
        ):
            fd = self._fd(k)
            for c in range(a, b, _IOV_MAX):
                part = row_views[c : min(b, c + _IOV_MAX)]
                got = os.preadv(fd, part, off + (c - a) * vec)
                if got != len(part) * vec:
                    raise FileSizeError(f"{self.shard_path(k)}: short read at byte {off} (file truncated after open?)")
        return out

    def shard_path(self, k: int) -> Path:
        """Absolute path of shard file ``k``."""
        return self.path / self.manifest.shards[k].name

    def read_examples(
        self,
        examples: npt.ArrayLike,
        layer_idx: npt.ArrayLike,
        out: npt.NDArray[Any] | None = None,
    ) -> npt.NDArray[Any]:
        """Copy ``(n, T, D)`` slices for pairs ``(examples[j], layer_idx[j])`` (positions)."""
        ex = np.asarray(examples, dtype=np.int64).reshape(-1)
        li = np.broadcast_to(np.asarray(layer_idx, dtype=np.int64), ex.shape)
        md = self.metadata
        if out is None:
            out = np.empty((len(ex), *md.shard_shape[2:]), self.numpy_dtype)
        for j in range(len(ex)):
            self.read_example(int(ex[j]), int(li[j]), out[j])
        return out

    # -- what lives beside the activations -----------------------------------------------
    @property
    def labels(self) -> np.memmap[Any, Any] | None:
        """``(n_examples, patches_per_ex)`` uint8 memmap of patch labels, or None."""
        lab = self.manifest.labels
        if lab is None:
            return None
        self._check_pid()
        if "labels" not in self._aux:
            self._aux["labels"] = _map(self.path / lab.name, np.dtype(lab.dtype), lab.shape)
        return self._aux["labels"]  # type: ignore[no-any-return]

    @property
    def columns(self) -> Fields[npt.NDArray[Any]]:
        """Per-example numeric columns by name (``shards.columns["lengths"]``), as read-only
        memmaps; a missing name raises `NameNotFoundError` listing the columns."""
        self._check_pid()
        if "columns" not in self._aux:
            cols = self.manifest.columns

            def load(name: str) -> npt.NDArray[Any]:
                c = cols[name]
                return _map(self.path / c.name, np.dtype(c.dtype), c.shape)

            self._aux["columns"] = Fields("column", self.path, list(cols), load)
        return self._aux["columns"]  # type: ignore[no-any-return]

    @property
    def lengths(self) -> npt.NDArray[Any] | None:
        """The ``lengths`` column (valid token positions per example), or None."""
        return self.columns.get("lengths")

    @property
    def text(self) -> Fields[TextColumn]:
        """Per-example JSON values of each text field by name (``shards.text["prompt"]``; lazy,
        indexable); ``shards.text("prompt")``, the spelling of earlier versions, works too. A
        missing name raises `NameNotFoundError` listing the text fields."""
        self._check_pid()
        if "text" not in self._aux:
            entries = self.manifest.text

            def load(name: str) -> TextColumn:
                return TextColumn(self.path / entries[name].name, entries[name].n_lines)

            self._aux["text"] = Fields("text field", self.path, list(entries), load)
        return self._aux["text"]  # type: ignore[no-any-return]

    @property
    def stats(self) -> dict[str, Any] | None:
        """Per-layer statistics gathered while writing (numpy arrays), else those of the
        sidecar `saev-shards stats` wrote (`store.sidecar`), else None.

        stats.json is read, and checked against its schema (protocol.md 2.6: exact keys,
        one entry per layer, ``mean`` and ``var`` of shape ``(L, D)``), on first use, not
        by `open` (it can be tens of MB for a large model); `StatsFileError` if it fails.
        """
        entry = self.manifest.stats
        if entry is None:  # computed later by `saev-shards stats`, beside the cache (protocol.md 2.9)?
            from .store.sidecar import find_stats

            return find_stats(self)
        if "stats" not in self._aux:
            md = self.metadata
            path = self.path / entry.name
            # parse_stats type-checks every integer; a float is a float whatever its spelling.
            cap = stats_max_bytes(md.n_layers, md.d_model)
            raw, problems = load_json(path, cap, StatsFileError, every_number=False)
            raise_problems(problems, str(self.path))
            self._aux["stats"] = parse_stats(raw, md.layers, md.d_model, str(path))
        return self._aux["stats"]  # type: ignore[no-any-return]

    def _stats_problems(self) -> list[Problem]:
        self._aux.pop("stats", None)
        try:
            self.stats  # noqa: B018 - read and checked against the schema
        except InvalidCacheError as err:
            return err.problems
        return []

    # -- views for other tools (saev_shards.views; dask and xarray are optional) -------------
    def to_dask(self, examples_per_chunk: int | None = None) -> Any:
        """A ``dask.array`` of the logical ``(N, L, T, D)`` tensor over the shard memmaps (no copy);
        one chunk per shard, or ``examples_per_chunk`` examples (never across shards)."""
        from .views import to_dask

        return to_dask(self, examples_per_chunk)

    def to_xarray(self, examples_per_chunk: int | None = None) -> Any:
        """An ``xarray.DataArray`` (dims example, layer, token, dim) over `to_dask`, layer values and
        columns as coordinates."""
        from .views import to_xarray

        return to_xarray(self, examples_per_chunk)

    # -- integrity -----------------------------------------------------------------------
    def verify(self, *, progress: bool | None = False, on_bytes: Callable[[int], None] | None = None) -> int:
        """Recompute every file's size and xxh3_128 digest, and the metadata hash; check
        stats.json against its schema.

        Returns the number of bytes checked. Raises `ChecksumMismatchError` (or
        `InvalidCacheError` for several kinds) listing every problem.
        """
        md_path = self.path / METADATA_FILE
        obj, problems = load_json(md_path, MAX_METADATA_BYTES, MetadataFileError)
        if not problems:
            try:
                current = parse_metadata(obj, self.path.name)
            except MetadataError as err:
                problems.append(Problem(MetadataFileError, f"{md_path}: {err}"))
            else:
                if current != self.metadata:
                    problems.append(Problem(HashMismatchError, f"{md_path}: changed since the cache was opened"))
                elif self.path.name != current.hash:
                    problems.append(
                        Problem(HashMismatchError, f"{self.path}: directory name is not the hash {current.hash}")
                    )
        files = self.manifest.files()
        total = sum(n for _, n, _ in files)
        unchecked = [name for name, _, digest in files if digest is None]
        checked = 0
        buffer = memoryview(bytearray(IO_CHUNK))
        with Progress(total, f"verify {self.path.name[:12]}", enabled=progress) as bar:
            for name, nbytes, digest in files:
                path = self.path / name

                def tick(n: int) -> None:
                    bar.update(n)
                    if on_bytes is not None:
                        on_bytes(n)

                try:
                    size, found = hash_file(path, tick, regular_only=True, buffer=buffer)
                except NotRegularFileError as err:
                    problems.append(Problem(ManifestError, str(err)))
                    continue
                except OSError as err:
                    problems.append(Problem(CacheNotFoundError, f"{path}: {err.strerror}"))
                    continue
                checked += size
                if size != nbytes:
                    problems.append(Problem(FileSizeError, f"{path}: expected {nbytes} bytes, found {size}"))
                    continue
                if digest is not None and found != digest:
                    problems.append(
                        Problem(ChecksumMismatchError, f"{path}: xxh3_128 expected {digest}, found {found}")
                    )
                    continue
                if name == STATS_FILE:  # its bytes are intact: check what they say
                    problems.extend(self._stats_problems())
        raise_problems(problems, str(self.path))
        if unchecked:
            warnings.warn(
                f"{self.path}: {len(unchecked)} files have no recorded checksum (protocol 2.1 without "
                f"{CHECKSUMS_FILE}); only their sizes were checked",
                stacklevel=2,
            )
        return checked


#: Buffers one preadv call may take (Linux's IOV_MAX).
_IOV_MAX = 1024


def _map(path: Path, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.memmap[Any, Any]:
    if int(np.prod(shape, dtype=object)) * dtype.itemsize == 0:
        return np.zeros(shape, dtype).view(np.memmap)
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)
