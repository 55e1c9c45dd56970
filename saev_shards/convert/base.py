"""What every source kind shares: the options, the plan, the chunks, the report, and small helpers.

A source kind is one module of this package with two functions:

* ``detect(path) -> bool``: cheap (file names and small JSON files only; never imports an
  optional dependency), so every kind can be asked in turn;
* ``open_source(path, options) -> Source``: reads the source's index (and, where the
  source does not say how long its longest example is, scans it), and returns a `Source`
  whose `SourcePlan` says exactly what the cache will hold before a byte is written.

`Source.chunks(start, report)` then yields the examples from ``start`` on, in order, one
bounded `Chunk` at a time; the machinery in `run` writes them (`saev_shards.convert.run`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from ..errors import ConvertError, ConvertOptionError, SourceChecksumError, SourceNotFoundError
from ..protocol.common import COLUMN_DTYPES, FIELD_NAME_RE
from ..protocol.jsonfile import is_int, short_repr
from ..protocol.metadata import Metadata
from . import files

#: Version of the mapping from sources to caches; part of every converted cache's `data`, so a
#: change in how a source is mapped gives new hashes instead of silently different bytes.
CONVERT_VERSION = 1
#: Bytes of source activations per chunk: bounds the memory of a conversion (one chunk is
#: in hand, the writer holds at most a few more) while keeping per-call overheads small.
CHUNK_BYTES = 64 << 20
#: Read size for hashing source files.
_HASH_BLOCK = 8 << 20


@dataclasses.dataclass(frozen=True)
class Options:
    """How the source's examples become the cache's (parsed from the command line or given).

    ``max_tokens``: keep at most this many token positions per example (longer ones are
    truncated and counted); ``layers``: the layer numbers of the stored layers, in order,
    for sources that do not name them; ``cls_token``: token 0 of every example is a [CLS]
    token; ``family`` and ``ckpt``: the model, where the source does not say;
    ``memory_bytes``: what the source's data may take in memory at once (default: half the
    machine's memory, `default_memory`): a pickle shard may expand to a quarter of it (it is
    held with the next one, each as pickle bytes and as arrays), a zarr chunk to half.
    """

    max_tokens: int | None = None
    layers: tuple[int, ...] | None = None
    cls_token: bool = False
    family: str | None = None
    ckpt: str | None = None
    memory_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and not (is_int(self.max_tokens) and 1 <= self.max_tokens < 2**31):
            raise ConvertOptionError(f"max_tokens: expected a positive number of tokens, found {self.max_tokens!r:.40}")
        if self.layers is not None:
            if not all(is_int(v, numpy_ok=True) and -(2**63) <= v < 2**63 for v in self.layers):
                raise ConvertOptionError(f"layers: expected integers, found {list(self.layers)!r:.80}")
            object.__setattr__(self, "layers", tuple(int(v) for v in self.layers))
            if not self.layers or len(set(self.layers)) != len(self.layers):
                raise ConvertOptionError(f"layers: expected distinct layer numbers, found {list(self.layers)}")
        if self.memory_bytes is not None and not (is_int(self.memory_bytes) and self.memory_bytes >= MIN_MEMORY):
            raise ConvertOptionError(
                f"memory_bytes (--max-memory): expected at least {MIN_MEMORY:,} bytes, found {self.memory_bytes!r:.40}"
            )

    @property
    def memory(self) -> int:
        """``memory_bytes``, or `default_memory`."""
        return self.memory_bytes if self.memory_bytes is not None else default_memory()

    @property
    def shard_bytes(self) -> int:
        """The most a pickle shard may expand to (a quarter of `memory`: see the class)."""
        return self.memory // 4


#: Smallest ``memory_bytes`` accepted: one chunk (`CHUNK_BYTES`) and some room.
MIN_MEMORY = 4 * (64 << 20)
#: Said with every refusal for size: how to allow more.
MEMORY_HINT = " (raise --max-memory, memory_bytes, to allow more)"


def default_memory() -> int:
    """Half the machine's physical memory (8 GiB where the system does not say)."""
    try:
        return max(MIN_MEMORY, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2)
    except (OSError, ValueError):
        return 8 << 30


@dataclasses.dataclass(frozen=True)
class SourcePlan:
    """What the cache will hold, known before anything is written.

    ``source`` describes the source (its own metadata, path and identity: checksums where
    it has them, sizes and modification times otherwise) and goes into the cache's
    ``data``, so converting the same, unchanged source again gives the same hash.
    ``columns`` and ``text`` declare the per-example streams every chunk carries (``lengths``
    among the columns when examples have fewer valid tokens than ``tokens``). ``layout``
    lines say how the source was mapped (printed); ``notes`` what is known, before any
    data is read, not to be carried over (reported); ``checksums`` what is verified.
    """

    kind: str
    path: Path
    family: str
    ckpt: str
    dataset: str
    layers: tuple[int, ...]
    tokens: int
    cls_token: bool
    d_model: int
    n_examples: int
    source: Mapping[str, Any]
    columns: Mapping[str, tuple[np.dtype[Any], tuple[int, ...]]]
    text: tuple[str, ...]
    source_nbytes: int
    checksums: str
    layout: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    labels: bool = False
    #: A cache source's own metadata (kind "cache"): the target keeps its fields (`cache`).
    cache: Metadata | None = None

    @property
    def example_nbytes_float32(self) -> int:
        return len(self.layers) * self.tokens * self.d_model * 4

    @property
    def chunk_examples(self) -> int:
        """Examples per chunk: `CHUNK_BYTES` of float32 activations, at least one."""
        return max(1, CHUNK_BYTES // max(1, self.example_nbytes_float32))


#: The name `SourcePlan` had before (kept for imports written then).
Plan = SourcePlan


@dataclasses.dataclass
class Chunk:
    """Consecutive examples: activations ``(B, L, T, D)`` (any float dtype) and their streams."""

    acts: npt.NDArray[Any]
    columns: dict[str, npt.NDArray[Any]]
    text: dict[str, list[Any]]
    labels: npt.NDArray[Any] | None = None
    #: Bytes of the source this chunk consumed (for the progress line).
    source_nbytes: int = 0
    #: A float8_e4m3 cache source: ``acts`` are its stored values and these their scales
    #: ``(B, L, T)``, copied as they are into a float8_e4m3 cache, dequantized for another dtype.
    scales: npt.NDArray[Any] | None = None


class Report:
    """What the conversion could not carry over or changed: counts by description, and notes
    (each a whole sentence: the command line prints one warning line per entry)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.notes: list[str] = []

    def count(self, what: str, n: int = 1) -> None:
        """Add ``n`` to the count described by ``what`` (e.g. ``"examples truncated to 64 tokens"``)."""
        if n:
            self.counts[what] = self.counts.get(what, 0) + int(n)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def lines(self) -> list[str]:
        return [*self.notes, *(f"{n:,} {what}" for what, n in self.counts.items())]


class Source(Protocol):
    """An opened source: its plan, and its examples chunk by chunk."""

    plan: SourcePlan

    def chunks(self, start: int, report: Report) -> Iterator[Chunk]:
        """Examples ``start`` to ``plan.n_examples``, in order, in bounded chunks."""
        ...


# --------------------------------------------------------------------------------------
# helpers shared by the source kinds


def field_name(raw: str) -> str | None:
    """A column or text field name for ``raw`` (lower case, other characters as ``_``), or None."""
    name = re.sub(r"[^a-z0-9_]", "_", raw.lower()).strip("_")
    if name and not name[0].isalpha():
        name = f"f_{name}"
    return name if FIELD_NAME_RE.fullmatch(name) else None


def column_dtype(dtype: np.dtype[Any]) -> np.dtype[Any] | None:
    """The little-endian column dtype for a numeric ``dtype``, or None if columns cannot hold it."""
    if dtype.kind not in "biuf":
        return None
    little = dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype
    return little if little.str in COLUMN_DTYPES else None


def fit_tokens(acts: npt.NDArray[Any], tokens: int) -> npt.NDArray[Any]:
    """``acts`` ``(B, L, T_src, D)`` cut or zero-padded to ``tokens`` positions."""
    have = acts.shape[2]
    if have == tokens:
        return acts
    if have > tokens:
        return acts[:, :, :tokens]
    out = np.zeros((*acts.shape[:2], tokens, acts.shape[3]), acts.dtype)
    out[:, :, :have] = acts
    return out


def pick_layers(found: Sequence[int] | None, count: int, options: Options, what: str) -> tuple[int, ...]:
    """Layer numbers: ``options.layers`` if given, else ``found`` (the source's own), else ``0..count-1``."""
    if options.layers is not None:
        if len(options.layers) != count:
            raise ConvertOptionError(
                f"--layers: expected {count} layer numbers ({what} has {count} layers), "
                f"found {len(options.layers)}: {list(options.layers)}"
            )
        return options.layers
    if found is not None:
        return tuple(found)
    return tuple(range(count))


def token_count(longest: int, options: Options) -> int:
    """T: the longest example, or ``--max-tokens`` when given."""
    return options.max_tokens if options.max_tokens is not None else max(1, longest)


#: Checksum algorithms a source's index may name: hashlib's fixed-length digests.
CHECKSUM_ALGORITHMS = frozenset(
    ["md5", "sha1", "sha224", "sha256", "sha384", "sha512", "blake2b", "blake2s", "sha3_224", "sha3_256",
     "sha3_384", "sha3_512"]
)  # fmt: skip


def parse_checksum(value: object, where: str) -> tuple[str, str] | None:
    """``"sha256:<hex>"`` -> ``("sha256", hex)``; None when absent. `CHECKSUM_ALGORITHMS` are accepted,
    with exactly as many hex digits as the algorithm's digest has."""
    if value is None:
        return None
    if not isinstance(value, str) or ":" not in value:
        raise ConvertError(f"{where}: expected a checksum like 'sha256:<hex digits>', found {short_repr(value)}")
    algorithm, digest = value.split(":", 1)
    algorithm = algorithm.lower()
    if algorithm not in CHECKSUM_ALGORITHMS:
        known = ", ".join(sorted(CHECKSUM_ALGORITHMS))
        raise ConvertError(f"{where}: unknown checksum algorithm {short_repr(algorithm)} (known: {known})")
    digits = 2 * hashlib.new(algorithm).digest_size
    if not re.fullmatch(rf"[0-9a-fA-F]{{{digits}}}", digest):
        raise ConvertError(f"{where}: expected {digits} hex digits after '{algorithm}:', found {short_repr(digest)}")
    return algorithm, digest.lower()


def read_verified(path: Path, checksum: tuple[str, str] | None, size: int | None, max_bytes: int) -> bytes:
    """The bytes of ``path`` (a regular file of at most ``max_bytes``), after checking them
    against the size and checksum the source records."""
    try:
        data = files.read_bytes(path, max_bytes, hint=MEMORY_HINT)
    except SourceNotFoundError:
        raise SourceNotFoundError(f"{path}: listed in the source's index but missing") from None
    if size is not None and len(data) != size:
        raise SourceChecksumError(f"{path}: expected {size:,} bytes (size_bytes in the index), found {len(data):,}")
    if checksum is not None:
        algorithm, digest = checksum
        h = hashlib.new(algorithm)
        view = memoryview(data)
        for start in range(0, len(data), _HASH_BLOCK):
            h.update(view[start : start + _HASH_BLOCK])
        if h.hexdigest() != digest:
            raise SourceChecksumError(
                f"{path}: {algorithm} expected {digest}, found {h.hexdigest()} "
                "(the file changed or was damaged since the index was written); nothing was converted from it"
            )
    return data


def stat_identity(paths: Sequence[Path], base: Path) -> list[list[Any]]:
    """``[[relative name, size, mtime_ns], ...]``: the identity of files that carry no checksum."""
    out = []
    for p in paths:
        try:
            st = p.stat()
        except OSError as err:
            raise ConvertError(f"{p}: cannot be read ({err.strerror or err})") from None
        out.append([str(p.relative_to(base)) if p != base else p.name, st.st_size, st.st_mtime_ns])
    return out


#: Deepest nesting `plain` keeps (a source's own description and text values): beyond it, a
#: value is written as its bounded repr (`short_repr`), so nothing can recurse without end.
PLAIN_DEPTH = 32


def plain(value: Any, _depth: int = 0) -> Any:
    """``value`` as plain JSON types (numpy scalars and arrays become numbers and lists,
    non-finite floats None, integers beyond 64 bits their decimal strings, anything else or
    nested deeper than `PLAIN_DEPTH` its bounded repr)."""
    if _depth > PLAIN_DEPTH:
        return short_repr(value)
    if isinstance(value, dict):
        return {str(k): plain(v, _depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, _depth + 1) for v in value]
    if isinstance(value, np.ndarray):
        return plain(value.tolist(), _depth) if value.size <= 1 << 16 else short_repr(value)
    if isinstance(value, np.generic):
        return plain(value.item(), _depth)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value if -(2**63) <= value < 2**64 else str(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None  # NaN and Infinity are not JSON
    return short_repr(value)
