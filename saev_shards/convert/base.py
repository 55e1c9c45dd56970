"""What every source kind shares: the options, the plan, the chunks, the report, and small helpers.

A source kind is one module of this package with two functions:

* ``detect(path) -> bool``: cheap (file names and small JSON files only; never imports an
  optional dependency), so every kind can be asked in turn;
* ``open_source(path, options) -> Source``: reads the source's index (and, where the
  source does not say how long its longest example is, scans it), and returns a `Source`
  whose `Plan` says exactly what the cache will hold before a byte is written.

`Source.chunks(start, report)` then yields the examples from ``start`` on, in order, one
bounded `Chunk` at a time; the machinery in `run` writes them (`saev_shards.convert.run`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from ..errors import ConvertError, ConvertOptionError, SourceChecksumError
from ..format import COLUMN_DTYPES, FIELD_NAME_RE
from ..metadata import Metadata

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
    token; ``family`` and ``ckpt``: the model, where the source does not say.
    """

    max_tokens: int | None = None
    layers: tuple[int, ...] | None = None
    cls_token: bool = False
    family: str | None = None
    ckpt: str | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConvertOptionError(f"max_tokens: expected a positive number of tokens, found {self.max_tokens}")
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(int(v) for v in self.layers))
            if not self.layers or len(set(self.layers)) != len(self.layers):
                raise ConvertOptionError(f"layers: expected distinct layer numbers, found {list(self.layers)}")


@dataclasses.dataclass(frozen=True)
class Plan:
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


@dataclasses.dataclass
class Chunk:
    """Consecutive examples: activations ``(B, L, T, D)`` (any float dtype) and their streams."""

    acts: npt.NDArray[Any]
    columns: dict[str, npt.NDArray[Any]]
    text: dict[str, list[Any]]
    labels: npt.NDArray[Any] | None = None
    #: Bytes of the source this chunk consumed (for the progress line).
    source_nbytes: int = 0


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

    plan: Plan

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


def parse_checksum(value: object, where: str) -> tuple[str, str] | None:
    """``"sha256:<hex>"`` -> ``("sha256", hex)``; None when absent. Any hashlib algorithm is accepted."""
    if value is None:
        return None
    if not isinstance(value, str) or ":" not in value:
        raise ConvertError(f"{where}: expected a checksum like 'sha256:<hex digits>', found {value!r}")
    algorithm, digest = value.split(":", 1)
    algorithm = algorithm.lower()
    if algorithm not in hashlib.algorithms_available:
        raise ConvertError(f"{where}: unknown checksum algorithm {algorithm!r} (known: sha256, sha1, md5, ...)")
    if not re.fullmatch(r"[0-9a-fA-F]+", digest):
        raise ConvertError(f"{where}: expected hex digits after '{algorithm}:', found {digest!r}")
    return algorithm, digest.lower()


def read_verified(path: Path, checksum: tuple[str, str] | None, size: int | None) -> bytes:
    """The bytes of ``path``, after checking them against the size and checksum the source records."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        from ..errors import SourceNotFoundError

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
        st = p.stat()
        out.append([str(p.relative_to(base)) if p != base else p.name, st.st_size, st.st_mtime_ns])
    return out


def plain(value: Any) -> Any:
    """``value`` as plain JSON types (numpy scalars and arrays become numbers and lists)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, float) and np.isnan(value):
        return None  # NaN is not JSON
    return value
