"""A zarr activation log's stores as `zarr_logs` reads them: where the stores are (one, or
``shards/shard-XXXX.zarr``), which arrays hold the sequence parts (`Part`), and the checks
made before zarr decodes any chunk: a chunk must fit the memory allowed, a compressed one
even at its codec's worst expansion, and the samples an array declares must be held by its
chunk files (zarr reads a missing chunk as zeros).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConvertError
from . import files
from .base import MEMORY_HINT

_SHARD_RE = re.compile(r"shard-(\d+)\.zarr")
#: The sequence parts, in token order, and the array names of their activations and lengths.
_SPLIT = (("prompt", "prompt_activations", "prompt_len"), ("response", "response_activations", "response_len"))
_SINGLE = (("seq", "activations", "seq_len"),)
#: The row (axis 0) of a chunk file's key: ``3.0.1.0`` (zarr v2), ``3/0/1/0`` or ``c/3/0/1/0`` (zarr v3).
_CHUNK_ROW = re.compile(r"(\d+)(?:[./]|$)")
#: Samples past the last row of chunks whose lengths are read to tell they are empty (more: refused).
_MAX_EMPTY_TAIL = 1 << 20
#: Metadata files of a store, read by zarr itself: each at most this long.
METADATA_NAMES = (".zarray", ".zgroup", ".zattrs", ".zmetadata", "zarr.json")


def is_group(path: Path) -> bool:
    return (path / ".zgroup").is_file() or (path / "zarr.json").is_file()


def find_stores(path: Path) -> tuple[str, list[Path]]:
    """``("store" | "sharded", store folders)``; empty when ``path`` is neither layout."""
    if is_group(path):
        return "store", [path]
    if is_group(path / "activations.zarr"):
        return "store", [path / "activations.zarr"]
    shards_dir = path / "shards"
    if shards_dir.is_dir():
        found = [(int(m.group(1)), p) for p in shards_dir.iterdir() if (m := _SHARD_RE.fullmatch(p.name))]
        stores = [p for _, p in sorted(found) if is_group(p)]
        if stores:
            return "sharded", stores
    return "store", []


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


def open_arrays(zarr: Any, store: Path) -> tuple[Any, Any]:
    try:
        group = zarr.open_group(store, mode="r")
    except Exception as err:  # zarr raises several kinds for a broken store
        raise ConvertError(f"{store}: not a readable zarr group ({type(err).__name__}: {err})") from None
    return group.get("arrays", group), group


def schema(arrays: Any, where: Path) -> list[Part]:
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


def check_chunks(array: Any, name: str, where: Path, max_bytes: int) -> None:
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


def check_codecs(store: Path, name: str, array: Any, max_bytes: int) -> None:
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
    folder = array_dir(store, name)
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
                if entry.name in METADATA_NAMES:
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


def check_held(store: Store, parts: list[Part], lengths: Any) -> None:
    """Refuse, before anything is written, a store whose activation arrays declare samples
    their chunks do not hold (a few KB declaring 10^9 samples would be written as zeros
    until the disk is full): samples past the last row of chunks written must be empty,
    by their lengths arrays (zarr 3 writes no chunk that is all fill value)."""
    for p in parts:
        folder = array_dir(store.path, p.activations)
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


def array_dir(store: Path, name: str) -> Path:
    return store / "arrays" / name if (store / "arrays" / name).is_dir() else store / name
