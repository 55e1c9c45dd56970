"""Zarr activation logs (the zarr activation logger's format), read with the ``zarr`` library (zarr v2 or v3 stores).

Layouts: one store ``activations.zarr/`` (or the folder holding it), or a run folder with
``shards/shard-XXXX.zarr`` (+ ``manifest.json``), read shard after shard in number order,
each shard's own arrays giving its sample count. In a store, the arrays live under
``arrays/`` (or at the top): either ``prompt_activations`` ``(N, L, P_max, H)`` and/or
``response_activations`` ``(N, L, R_max, H)`` with ``prompt_len``/``response_len``, or
``activations`` ``(N, L, T_max, H)`` with ``seq_len``.

Prompt and response become ONE cache whose examples are the sequences the model saw:
example ``i``'s tokens are its ``prompt_len[i]`` prompt tokens, then its
``response_len[i]`` response tokens, then zeros; ``T = P_max + R_max`` (or
``--max-tokens``), ``lengths = prompt_len + response_len``, and the columns
``prompt_len`` and ``response_len`` say where the response starts. Padding stored between
the two parts is dropped (counted when it is not zero). Every other per-sample numeric
array becomes a column, ``sample_key`` and other byte or string arrays become text
fields, and each ``text/*.jsonl`` and ``meta/*.jsonl`` file becomes a text field holding
each line's JSON object, placed by its ``"i"`` (else by line number).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import ConvertError, JSONFileError
from ..optional import require
from ..protocol.jsonfile import is_int, short_repr, strict_json_loads
from . import files
from .base import (
    MEMORY_HINT,
    Chunk,
    Options,
    Report,
    SourcePlan,
    column_dtype,
    field_name,
    pick_layers,
    plain,
    stat_identity,
)

KIND = "zarr"
_SHARD_RE = re.compile(r"shard-(\d+)\.zarr")
#: The sequence parts, in token order, and the array names of their activations and lengths.
_SPLIT = (("prompt", "prompt_activations", "prompt_len"), ("response", "response_activations", "response_len"))
_SINGLE = (("seq", "activations", "seq_len"),)
#: The row (axis 0) of a chunk file's key: ``3.0.1.0`` (zarr v2), ``3/0/1/0`` or ``c/3/0/1/0`` (zarr v3).
_CHUNK_ROW = re.compile(r"(\d+)(?:[./]|$)")
#: Samples past the last row of chunks whose lengths are read to tell they are empty (more: refused).
_MAX_EMPTY_TAIL = 1 << 20
#: Metadata files of a store, read by zarr itself: each at most this long.
_METADATA_NAMES = (".zarray", ".zgroup", ".zattrs", ".zmetadata", "zarr.json")


def _is_group(path: Path) -> bool:
    return (path / ".zgroup").is_file() or (path / "zarr.json").is_file()


def _stores(path: Path) -> tuple[str, list[Path]]:
    """``("store" | "sharded", store folders)``; empty when ``path`` is neither layout."""
    if _is_group(path):
        return "store", [path]
    if _is_group(path / "activations.zarr"):
        return "store", [path / "activations.zarr"]
    shards_dir = path / "shards"
    if shards_dir.is_dir():
        found = [(int(m.group(1)), p) for p in shards_dir.iterdir() if (m := _SHARD_RE.fullmatch(p.name))]
        stores = [p for _, p in sorted(found) if _is_group(p)]
        if stores:
            return "sharded", stores
    return "store", []


def detect(path: Path) -> bool:
    """A zarr group (or a folder with ``activations.zarr`` or ``shards/shard-XXXX.zarr``) with activation arrays."""
    if not path.is_dir():
        return False
    _, stores = _stores(path)
    if not stores:
        return False
    first = stores[0]
    names = ("prompt_activations", "response_activations", "activations")
    return any((first / "arrays" / n).is_dir() or (first / n).is_dir() for n in names)


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    activations: str
    lengths: str | None  # the lengths array, or None: every position is valid
    max_len: int


@dataclasses.dataclass
class Store:
    path: Path
    arrays: Any  # the zarr group holding the arrays
    n: int
    offset: int  # global index of its first sample


def _arrays(zarr: Any, store: Path) -> tuple[Any, Any]:
    try:
        group = zarr.open_group(store, mode="r")
    except Exception as err:  # zarr raises several kinds for a broken store
        raise ConvertError(f"{store}: not a readable zarr group ({type(err).__name__}: {err})") from None
    return group.get("arrays", group), group


def _schema(arrays: Any, where: Path) -> list[Part]:
    names = set(arrays.array_keys())
    spec = _SPLIT if any(a in names for _, a, _ in _SPLIT) else _SINGLE
    parts = []
    for name, acts, lengths in spec:
        if acts not in names:
            continue
        shape = arrays[acts].shape
        if len(shape) != 4:
            raise ConvertError(f"{where}: expected {acts} of shape (N, L, T, H), found {shape}")
        parts.append(Part(name, acts, lengths if lengths in names else None, int(shape[2])))
    if not parts:
        raise ConvertError(
            f"{where}: expected arrays prompt_activations / response_activations or activations, found {sorted(names)}"
        )
    return parts


def _text_files(store: Path) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for folder in ("text", "meta"):
        for p in sorted((store / folder).glob("*.jsonl")) if (store / folder).is_dir() else []:
            name = field_name(p.stem)
            if name is None:
                continue
            if name in out:
                name = field_name(f"{folder}_{p.stem}")
            if name is not None and name not in out:
                out[name] = p
    return out


def _line_index(path: Path, n: int, offset: int) -> npt.NDArray[np.int64]:
    """Byte offset of each sample's line (-1: no line): placed by ``"i"`` when lines have it
    (then every line must: an integer, not a fraction, never guessed), else by line number."""
    starts: list[int] = []
    keys: list[int] = []
    placed: bool | None = None  # whether lines carry "i" (decided by the first line)
    pos = 0
    number = 0
    with files.open_lines(path, "a text file of the store") as f:
        while line := files.read_line(f, path, number + 1):
            number += 1
            if line.strip():
                obj = _json_line(line, path, number)
                has_i = isinstance(obj, dict) and "i" in obj
                if placed is None:
                    placed = has_i
                elif has_i != placed:
                    raise ConvertError(
                        f"{path}: line {number} {'has' if has_i else 'has no'} 'i' where line {starts and 1} "
                        f"{'does not' if has_i else 'does'}: samples cannot be placed"
                    )
                if placed:
                    i = obj["i"]
                    if not (is_int(i) and -(2**63) <= i < 2**63):
                        raise ConvertError(f"{path}: line {number}: expected 'i' as an integer, found {short_repr(i)}")
                    keys.append(i)
                starts.append(pos)
                if len(starts) > n:
                    raise ConvertError(f"{path}: expected at most {n} lines (one per sample), found more")
            pos += len(line)
    index = np.full(n, -1, np.int64)
    if placed:
        ids = np.asarray(keys, np.int64)
        if ids.min() >= 0 and ids.max() < n:
            pass  # local indices
        elif ids.min() >= offset and ids.max() < offset + n:
            ids = ids - offset  # global indices of a sharded run
        else:
            raise ConvertError(f"{path}: expected 'i' values in [0, {n}), found {int(ids.min())}..{int(ids.max())}")
        if len(np.unique(ids)) != len(ids):
            raise ConvertError(f"{path}: repeated 'i' values")
        index[ids] = starts
    else:
        index[: len(starts)] = starts
    return index


def _json_line(line: bytes, path: Path, number: int) -> Any:
    """One line of a JSON Lines file, parsed by the strict loader of caches (it becomes cache text)."""
    try:
        return strict_json_loads(line.strip())
    except JSONFileError as err:
        raise ConvertError(f"{path}: line {number}: {err}") from None


@dataclasses.dataclass
class ZarrSource:
    plan: SourcePlan
    stores: list[Store]
    parts: list[Part]
    columns: dict[str, str]  # column name -> array name
    text_arrays: dict[str, str]  # text field -> byte/string array name
    text_files: list[dict[str, Path]]  # per store: text field -> jsonl file

    def chunks(self, start: int, report: Report) -> Iterator[Chunk]:
        for k, store in enumerate(self.stores):
            if store.offset + store.n <= start:
                continue
            indexes = {name: _line_index(p, store.n, store.offset) for name, p in self.text_files[k].items()}
            for name, index in indexes.items():
                report.count(f"samples without a line in {name}.jsonl (stored as null)", int((index < 0).sum()))
            for name in self.plan.text:
                if name not in self.text_arrays and name not in indexes:
                    report.count(f"samples without a {name} text file in their shard (stored as null)", store.n)
            step = self.plan.chunk_examples
            for a in range(max(0, start - store.offset), store.n, step):
                b = min(store.n, a + step)
                with _reading(store.path):
                    chunk = self._chunk(store, a, b, indexes, k, report)
                yield chunk

    def _chunk(
        self, store: Store, a: int, b: int, indexes: dict[str, npt.NDArray[np.int64]], k: int, report: Report
    ) -> Chunk:
        tokens = self.plan.tokens
        count = b - a
        blocks = [store.arrays[p.activations][a:b] for p in self.parts]
        lens = []
        for p in self.parts:
            if p.lengths is None:
                lens.append(np.full(count, p.max_len, np.int64))
                continue
            raw = np.asarray(store.arrays[p.lengths][a:b]).astype(np.int64)
            over = raw > p.max_len
            if over.any():
                report.count(f"{p.lengths} values above their array's {p.max_len} positions (capped)", int(over.sum()))
            if (raw < 0).any():
                raise ConvertError(f"{store.path}: {p.lengths}[{a}:{b}] holds negative lengths")
            lens.append(np.minimum(raw, p.max_len))
        dtype = np.result_type(*(blk.dtype for blk in blocks))
        n_layers, d_model = self.plan.layers, self.plan.d_model
        acts = np.zeros((count, len(n_layers), tokens, d_model), dtype)
        total = np.zeros(count, np.int64)
        for j in range(count):
            pos = 0
            for p, block, length in zip(self.parts, blocks, lens, strict=True):
                n = int(length[j])
                keep = max(0, min(n, tokens - pos))
                if keep:
                    acts[j, :, pos : pos + keep] = block[j, :, :keep]
                if n < p.max_len and np.any(block[j, :, n:]):
                    report.count(f"samples with nonzero values in {p.name} padding (dropped)")
                pos += n
            total[j] = pos
        lengths = np.minimum(total, tokens).astype(np.int32)
        cut = total > tokens
        if cut.any():
            report.count(f"samples longer than T={tokens} truncated", int(cut.sum()))
            report.count("token positions dropped by that truncation", int((total - lengths).sum()))
        columns: dict[str, npt.NDArray[Any]] = {"lengths": lengths, "true_lengths": total.astype(np.int32)}
        for p, length in zip(self.parts, lens, strict=True):
            if p.lengths is not None:
                columns[p.lengths] = length.astype(self.plan.columns[p.lengths][0])
        for name, array in self.columns.items():
            columns[name] = np.asarray(store.arrays[array][a:b]).astype(self.plan.columns[name][0])
        text: dict[str, list[Any]] = {}
        for name, array in self.text_arrays.items():
            values = np.asarray(store.arrays[array][a:b])
            text[name] = [_decode(v) for v in values.tolist()]
        for name in self.plan.text:
            if name in self.text_arrays:
                continue
            index = indexes.get(name)
            text[name] = _lines(self.text_files[k].get(name), index, a, b)
        nbytes = sum(int(blk.nbytes) for blk in blocks)
        return Chunk(acts, columns, text, source_nbytes=nbytes)


def _decode(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.rstrip(b"\x00").decode("utf-8", "replace")
    return plain(value)


def _lines(path: Path | None, index: npt.NDArray[np.int64] | None, a: int, b: int) -> list[Any]:
    if path is None or index is None:
        return [None] * (b - a)
    out: list[Any] = []
    with files.open_lines(path, "a text file of the store") as f:
        for off in index[a:b].tolist():
            if off < 0:
                out.append(None)
                continue
            f.seek(off)
            out.append(_json_line(files.read_line(f, path, 0), path, 0))
    return out


def _reading(where: Path) -> contextlib.AbstractContextManager[None]:
    return files.library_errors(where, "zarr store")


def _check_chunks(array: Any, name: str, where: Path, max_bytes: int) -> None:
    """A chunk of ``array`` is decoded whole whenever any of it is read: it must fit ``max_bytes``."""
    chunks = getattr(array, "shards", None) or array.chunks
    nbytes = math.prod(int(c) for c in chunks) * np.dtype(array.dtype).itemsize
    if nbytes > max_bytes:
        raise ConvertError(
            f"{where}: {name}: chunks of {tuple(int(c) for c in chunks)} are {nbytes:,} bytes each, more than the "
            f"{max_bytes:,} a chunk may take{MEMORY_HINT}"
        )


#: How far a codec's output can grow beyond its input, where a bound exists: deflate (gzip,
#: zlib) at most 1032 times (RFC 1951: a 258-byte match in under two bits), LZ4 blocks about
#: 255 times. Blosc and Zstandard chunks declare their output size in a header, checked instead.
_RATIOS = {"gzip": 1032, "zlib": 1032, "lz4": 256}
#: Codecs that never make a chunk larger than the chunk's declared bytes.
_SIZE_KEEPING = frozenset(
    ["bytes", "endian", "transpose", "shuffle", "delta", "crc32c", "fixedscaleoffset", "astype", "quantize",
     "packbits", "sharding", "shardingindexed"]
)  # fmt: skip
_BLOSC_MAGIC_LEN = 16
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _codec_name(codec: Any) -> str:
    name = getattr(codec, "codec_id", None) or type(codec).__name__
    return str(name).lower().removesuffix("codec")


def _check_codecs(store: Path, name: str, array: Any, max_bytes: int) -> None:
    """Bound what decoding any chunk of ``array`` can allocate, before zarr decodes one: a
    compressed chunk expands to whatever its codec says, and zarr checks the size only after
    (a chunk of a few KB can ask for gigabytes). Each chunk file's worst case, from its size
    and the codec's ratio or from the size its header declares, must fit ``max_bytes``;
    a codec whose output cannot be bounded so (bz2, lzma, one this library does not know) is
    refused."""
    codecs = [_codec_name(c) for c in (*getattr(array, "filters", ()), *getattr(array, "compressors", ()))]
    compressing = [c for c in codecs if c not in _SIZE_KEEPING]
    if not compressing:
        return
    unknown = [c for c in compressing if c not in _RATIOS and c not in ("blosc", "zstd")]
    if unknown:
        raise ConvertError(
            f"{store}: {name}: codec {unknown[0]!r}: its output cannot be bounded before it is decoded; "
            "save the store uncompressed or with zstd, blosc, gzip or lz4"
        )
    folder = _array_dir(store, name)
    ratio = math.prod(_RATIOS.get(c, 1) for c in compressing)
    for path, size in _chunk_files(folder):
        bound = size * ratio
        if "blosc" in compressing or "zstd" in compressing:
            declared = _declared_size(path, compressing)
            bound = max(bound, declared) if declared is not None else bound
        if bound > max_bytes:
            raise ConvertError(
                f"{path}: a chunk of {name} ({size:,} bytes, {'+'.join(compressing)}) may decode to {bound:,} bytes, "
                f"more than the {max_bytes:,} a chunk may take{MEMORY_HINT}"
            )


def _chunk_files(folder: Path) -> Iterator[tuple[Path, int]]:
    """Every chunk file under an array's folder, with its size (metadata files skipped)."""
    todo = [folder]
    while todo:
        here = todo.pop()
        with os.scandir(here) as it:
            for entry in it:
                if entry.name in _METADATA_NAMES:
                    continue
                if entry.is_dir():
                    todo.append(Path(entry.path))
                elif entry.is_file():
                    yield Path(entry.path), entry.stat().st_size


def _declared_size(path: Path, codecs: list[str]) -> int | None:
    """The output size a Blosc or Zstandard chunk declares in its header (the size numcodecs
    allocates); a Zstandard frame that declares none is refused (it would grow without bound)."""
    with files.open_file(path, "a chunk") as f:
        head = f.read(32)
    if "blosc" in codecs and len(head) >= _BLOSC_MAGIC_LEN and not head.startswith(_ZSTD_MAGIC):
        return int.from_bytes(head[4:8], "little")  # nbytes: the uncompressed size
    if "zstd" in codecs and head.startswith(_ZSTD_MAGIC) and len(head) >= 6:
        descriptor = head[4]
        fcs_flag, single = descriptor >> 6, (descriptor >> 5) & 1
        dict_len = (0, 1, 2, 4)[descriptor & 3]
        at = 5 + (0 if single else 1) + dict_len
        width = (1 if single else 0, 2, 4, 8)[fcs_flag]
        if width == 0:
            raise ConvertError(
                f"{path}: a Zstandard chunk that does not declare its size (it could grow without bound)"
            )
        value = int.from_bytes(head[at : at + width], "little")
        return value + 256 if width == 2 else value
    return None


def _held_rows(array_dir: Path, array: Any) -> int:
    """Samples (rows of axis 0) up to the last row of chunks that has a file: what the array
    holds, whatever its shape declares (zarr reads a missing chunk as its fill value)."""
    chunk_rows = int((getattr(array, "shards", None) or array.chunks)[0])
    folder = array_dir / "c" if (array_dir / "c").is_dir() else array_dir  # zarr v3 keys, else v2 keys
    last = -1
    with os.scandir(folder) as it:
        for entry in it:
            head = _CHUNK_ROW.match(entry.name)
            if head is None:
                continue
            if "." in entry.name and entry.is_dir():  # "3.0.1.0" names a chunk file, never a folder
                raise ConvertError(f"{entry.path}: expected a chunk file, found a directory (zarr would read zeros)")
            last = max(last, int(head.group(1)))
    return min(int(array.shape[0]), (last + 1) * chunk_rows)


def _check_held(store: Store, parts: list[Part], lengths: Any) -> None:
    """Refuse, before anything is written, a store whose activation arrays declare samples
    their chunks do not hold (a few KB declaring 10^9 samples would be written as zeros
    until the disk is full): samples past the last row of chunks written must be empty,
    by their lengths arrays (zarr 3 writes no chunk that is all fill value)."""
    for p in parts:
        folder = _array_dir(store.path, p.activations)
        held = _held_rows(folder, store.arrays[p.activations])
        if held >= store.n:
            continue
        missing = store.n - held
        empty = False
        if p.lengths is not None and missing <= _MAX_EMPTY_TAIL:
            empty = not np.any(np.asarray(lengths[p.lengths][held : store.n]))
        if not empty:
            raise ConvertError(
                f"{store.path}: {p.activations} declares {store.n:,} samples, but its chunks hold at most the first "
                f"{held:,}: the store declares more than it holds (a damaged or unfinished store); nothing was written"
            )


def _array_dir(store: Path, name: str) -> Path:
    return store / "arrays" / name if (store / "arrays" / name).is_dir() else store / name


def open_source(path: Path, options: Options, scan: Callable[[int, int], None] | None = None) -> ZarrSource:
    zarr = require("zarr", "convert", "converting zarr activation logs")
    with warnings.catch_warnings(), _reading(path):
        # Seed 000 keeps text/ and meta/ folders (JSON Lines) inside the store, on purpose.
        warnings.filterwarnings("ignore", message=".*not recognized as a component of a Zarr hierarchy")
        return _open(zarr, path, options)


def _open(zarr: Any, path: Path, options: Options) -> ZarrSource:
    layout, paths = _stores(path)
    if not paths:
        raise ConvertError(f"{path}: expected a zarr group, activations.zarr/ or shards/shard-XXXX.zarr")
    stores: list[Store] = []
    parts: list[Part] | None = None
    attrs: dict[str, Any] = {}
    offset = 0
    for store_path in paths:
        # zarr opens the files itself: everything in the store must be a regular file first.
        files.check_tree(store_path, "in a zarr store", {name: files.MAX_JSON_BYTES for name in _METADATA_NAMES})
        arrays, group = _arrays(zarr, store_path)
        these = _schema(arrays, store_path)
        if parts is None:
            parts = these
            attrs = plain(dict(group.attrs))
        elif [(p.name, p.max_len, p.lengths is not None) for p in these] != [
            (p.name, p.max_len, p.lengths is not None) for p in parts
        ]:
            raise ConvertError(f"{store_path}: its arrays differ from the first shard's ({paths[0]})")
        n = int(arrays[these[0].activations].shape[0])
        for p in these:
            for name in (p.activations, p.lengths):
                if name is not None and int(arrays[name].shape[0]) != n:
                    raise ConvertError(f"{store_path}: {name} holds {arrays[name].shape[0]} samples, expected {n}")
                if name is not None:
                    _check_chunks(arrays[name], name, store_path, options.memory // 2)
                    _check_codecs(store_path, name, arrays[name], options.memory // 2)
            if p.lengths is not None and (
                len(arrays[p.lengths].shape) != 1 or arrays[p.lengths].dtype.kind not in "iu"
            ):
                raise ConvertError(
                    f"{store_path}: {p.lengths}: expected integers of shape (N,), found "
                    f"{arrays[p.lengths].shape} {arrays[p.lengths].dtype}"
                )
        store = Store(store_path, arrays, n, offset)
        _check_held(store, these, arrays)
        stores.append(store)
        offset += n
    assert parts is not None
    first = stores[0].arrays
    shape = first[parts[0].activations].shape
    n_layers, d_model = int(shape[1]), int(shape[3])
    for p in parts:
        for s in stores:
            sh = s.arrays[p.activations].shape
            if int(sh[1]) != n_layers or int(sh[3]) != d_model or s.arrays[p.activations].dtype.kind != "f":
                raise ConvertError(
                    f"{s.path}: expected {p.activations} as float (N, {n_layers}, T, {d_model}), "
                    f"found {sh} {s.arrays[p.activations].dtype}"
                )
    notes: list[str] = []
    columns: dict[str, str] = {}
    text_arrays: dict[str, str] = {}
    col_types: dict[str, tuple[np.dtype[Any], tuple[int, ...]]] = {
        "lengths": (np.dtype("<i4"), ()),
        "true_lengths": (np.dtype("<i4"), ()),
    }
    used = {p.activations for p in parts} | {p.lengths for p in parts if p.lengths}
    for p in parts:
        if p.lengths is not None:
            col_types[p.lengths] = (column_dtype(np.dtype(first[p.lengths].dtype)) or np.dtype("<i4"), ())
    for array_name in sorted(set(first.array_keys()) - used):
        arr = first[array_name]
        name = field_name(array_name)
        dt: np.dtype[Any] | None = np.dtype(arr.dtype) if isinstance(arr.dtype, np.dtype) else None
        if name is None or name in col_types or len(arr.shape) == 0 or int(arr.shape[0]) != stores[0].n:
            notes.append(f"array {array_name!r} {arr.shape} not carried over (not one value per sample)")
            continue
        if dt is not None and column_dtype(dt) is not None:
            col = column_dtype(dt)
            assert col is not None
            columns[name] = array_name
            col_types[name] = (col, tuple(int(v) for v in arr.shape[1:]))
        elif dt is not None and dt.kind in "SU" and len(arr.shape) == 1:
            text_arrays[name] = array_name
        else:
            notes.append(f"array {array_name!r} of dtype {arr.dtype} not carried over (not numeric or text)")
    for s in stores:
        missing = [a for a in [*columns.values(), *text_arrays.values()] if a not in set(s.arrays.array_keys())]
        if missing:
            raise ConvertError(f"{s.path}: missing the per-sample arrays {missing} that the first shard has")
        for a in [*columns.values(), *text_arrays.values()]:
            arr, want = s.arrays[a], first[a]
            if tuple(arr.shape) != (s.n, *want.shape[1:]) or np.dtype(arr.dtype) != np.dtype(want.dtype):
                raise ConvertError(
                    f"{s.path}: {a}: expected {np.dtype(want.dtype)} of shape {(s.n, *want.shape[1:])} "
                    f"(one value per sample, as in {stores[0].path}), found {np.dtype(arr.dtype)} {arr.shape}"
                )
            _check_chunks(arr, a, s.path, options.memory // 2)
            _check_codecs(s.path, a, arr, options.memory // 2)
    text_files = [_text_files(s.path) for s in stores]
    text_names = list(text_arrays)
    for found_files in text_files:
        text_names += [n for n in found_files if n not in text_names]
    total = sum(p.max_len for p in parts)
    tokens = min(total, options.max_tokens) if options.max_tokens is not None else total
    found_layers = attrs.get("layers")
    if found_layers is not None and not (
        isinstance(found_layers, list)
        and len(found_layers) == n_layers
        and all(is_int(v) and -(2**63) <= v < 2**63 for v in found_layers)
        and len(set(found_layers)) == n_layers
    ):
        if options.layers is None:  # never numbered by position instead without a word
            raise ConvertError(
                f"{paths[0]}: attrs layers: expected {n_layers} distinct integers of 64 bits (one per layer), "
                f"found {short_repr(found_layers)}; give the layer numbers with --layers"
            )
        found_layers = None
    layers = pick_layers(found_layers, n_layers, options, "the store")
    config_file = paths[0] / "meta" / "config.json"
    has_config = os.path.lexists(config_file)
    config = plain(files.read_json(config_file, "the store's configuration")) if has_config else None
    manifest = path / "manifest.json"
    manifest_bytes = (
        files.read_bytes(manifest, files.MAX_JSON_BYTES, "the run's manifest") if os.path.lexists(manifest) else None
    )
    identity_files: list[Path] = []
    for s in stores:
        folder = s.path / "arrays" if (s.path / "arrays").is_dir() else s.path
        # sorted: the order of a set's strings varies from process to process, the hash must not
        identity_files.extend(folder / name for name in [*sorted(used), *columns.values(), *text_arrays.values()])
        identity_files += list(_text_files(s.path).values())
    source = {
        "path": str(path),
        "layout": layout,
        "stores": [str(s.path.relative_to(path)) if s.path != path else "." for s in stores],
        "parts": [{"name": p.name, "array": p.activations, "lengths": p.lengths, "max_len": p.max_len} for p in parts],
        "attrs": attrs,
        "config": config,
        "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest() if manifest_bytes is not None else None,
        "identity": stat_identity([p for p in identity_files if p.exists()], path),
    }
    names = [p.name for p in parts]
    if names == ["prompt", "response"]:
        layout_lines = [
            "prompt and response: ONE cache; each example is its prompt tokens then its response tokens, "
            f"then zeros (T = P_max {parts[0].max_len} + R_max {parts[1].max_len} = {total}"
            + (f", cut to {tokens} by --max-tokens" if tokens < total else "")
            + "); lengths = prompt_len + response_len; the response starts at prompt_len",
        ]
    else:
        layout_lines = [
            f"tokens: {', '.join(p.activations for p in parts)} (T = {tokens})"
            + "".join(f"; valid positions from {p.lengths}" for p in parts if p.lengths)
        ]
    notes.extend(
        f"no {p.name}_len array: every {p.name} position is taken as valid" for p in parts if p.lengths is None
    )
    layout_lines.append(
        f"layers {list(layers)}" + (" (--layers)" if options.layers else " (attrs)" if found_layers else " (positions)")
    )
    layout_lines.append(
        f"one store, {offset:,} samples" if layout == "store" else f"sharded: {len(stores)} stores, {offset:,} samples"
    )
    cols_shown = [c for c in col_types if c not in ("lengths", "true_lengths")]
    if cols_shown:
        layout_lines.append("columns: " + ", ".join(cols_shown))
    if text_names:
        layout_lines.append("text: " + ", ".join(text_names))
    plan = SourcePlan(
        kind=KIND,
        path=path,
        family=options.family or str(attrs.get("model_family") or attrs.get("family") or "unknown"),
        ckpt=options.ckpt or str(attrs.get("model_id") or attrs.get("model") or "unknown"),
        dataset=str(attrs.get("dataset") or attrs.get("dataset_name") or path),
        layers=layers,
        tokens=tokens,
        cls_token=options.cls_token,
        d_model=d_model,
        n_examples=offset,
        source=source,
        columns=col_types,
        text=tuple(text_names),
        source_nbytes=sum(int(s.arrays[p.activations].nbytes) for s in stores for p in parts),
        checksums="none: zarr stores carry no checksums",
        layout=tuple(layout_lines),
        notes=tuple(notes),
    )
    return ZarrSource(plan, stores, parts, columns, text_arrays, text_files)
