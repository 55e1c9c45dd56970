"""`shards.json`: the manifest of every data file in a cache (protocol.md section 2.2).

Parse at the edge: `parse_manifest` turns JSON into frozen dataclasses and reports every
problem it finds; the rest of the library works on `Manifest`.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import chain
from typing import Any, NamedTuple, overload

import numpy as np
import numpy.typing as npt

from .errors import ManifestError, Problem, StatsFileError
from .format import (
    COLUMN_DTYPES,
    FIELD_NAME_RE,
    LABELS_DTYPE,
    LABELS_FILE,
    LEGACY_PROTOCOL,
    STATS_FILE,
    XXH3_RE,
    column_file,
    is_int,
    short_list,
    short_repr,
    text_file,
    type_name,
)


class ShardEntry(NamedTuple):
    """One activation shard: ``acts<06d>.bin`` with its example count, size and digest.

    A NamedTuple, not a dataclass: caches have up to 10^6 of these, built on every open.
    """

    name: str
    n_examples: int
    nbytes: int
    xxh3_128: str | None  # None only in a protocol 2.1 cache without checksums.json


class ShardList(Sequence[ShardEntry]):
    """The shards of a manifest, held as four columns; a `ShardEntry` is built when indexed.

    Opening a cache of 10^4 shards then creates no per-shard object at all.
    """

    __slots__ = ("counts", "digests", "names", "sizes")

    def __init__(self, names: list[str], counts: list[int], sizes: list[int], digests: Sequence[str | None]) -> None:
        self.names = names
        self.counts = counts
        self.sizes = sizes
        self.digests = list(digests)

    @classmethod
    def of(cls, entries: Iterable[ShardEntry]) -> ShardList:
        rows = list(entries)
        return cls(
            [e.name for e in rows], [e.n_examples for e in rows], [e.nbytes for e in rows], [e.xxh3_128 for e in rows]
        )

    def __len__(self) -> int:
        return len(self.names)

    @overload
    def __getitem__(self, i: int) -> ShardEntry: ...
    @overload
    def __getitem__(self, i: slice) -> list[ShardEntry]: ...
    def __getitem__(self, i: int | slice) -> ShardEntry | list[ShardEntry]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return ShardEntry(self.names[i], self.counts[i], self.sizes[i], self.digests[i])

    def __iter__(self) -> Iterator[ShardEntry]:
        return map(ShardEntry, self.names, self.counts, self.sizes, self.digests)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ShardList):
            return (self.names, self.counts, self.sizes, self.digests) == (
                other.names, other.counts, other.sizes, other.digests
            )  # fmt: skip
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ShardList({len(self)} shards)"

    def __reduce__(self) -> tuple[Any, ...]:
        return (ShardList, (self.names, self.counts, self.sizes, self.digests))


@dataclasses.dataclass(frozen=True)
class ArrayEntry:
    """A raw C-order array file (labels or a per-example column)."""

    name: str
    dtype: str  # numpy dtype.str, e.g. "|u1", "<i4"
    shape: tuple[int, ...]
    nbytes: int
    xxh3_128: str | None


@dataclasses.dataclass(frozen=True)
class TextEntry:
    """A JSON Lines file with one line per example."""

    name: str
    n_lines: int
    nbytes: int
    xxh3_128: str


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """A plain file with a size and a digest (the statistics file)."""

    name: str
    nbytes: int
    xxh3_128: str


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Everything shards.json records."""

    shards: ShardList
    labels: ArrayEntry | None = None
    # Plain dicts (picklable, for DataLoader workers); treat them as read-only.
    columns: Mapping[str, ArrayEntry] = dataclasses.field(default_factory=dict)
    text: Mapping[str, TextEntry] = dataclasses.field(default_factory=dict)
    stats: FileEntry | None = None

    def __post_init__(self) -> None:
        given: object = self.shards  # any sequence of ShardEntry is accepted
        if not isinstance(given, ShardList):
            object.__setattr__(self, "shards", ShardList.of(given))  # type: ignore[arg-type]

    def files(self) -> list[tuple[str, int, str | None]]:
        """``(name, nbytes, xxh3_128)`` of every data file, shards first."""
        shards = self.shards
        return list(zip(shards.names, shards.sizes, shards.digests, strict=True)) + self.other_files()

    def other_files(self) -> list[tuple[str, int, str | None]]:
        """``(name, nbytes, xxh3_128)`` of the data files that are not shards."""
        out: list[tuple[str, int, str | None]] = []
        if self.labels is not None:
            out.append((self.labels.name, self.labels.nbytes, self.labels.xxh3_128))
        out.extend((c.name, c.nbytes, c.xxh3_128) for c in self.columns.values())
        out.extend((t.name, t.nbytes, t.xxh3_128) for t in self.text.values())
        if self.stats is not None:
            out.append((self.stats.name, self.stats.nbytes, self.stats.xxh3_128))
        return out

    def to_json(self, protocol: str) -> Any:
        """The JSON value written as shards.json for ``protocol``."""
        if protocol == LEGACY_PROTOCOL:
            return [{"name": s.name, "n_examples": s.n_examples} for s in self.shards]
        return {
            "shards": [s._asdict() for s in self.shards],
            "labels": _array_json(self.labels) if self.labels else None,
            "columns": {k: _array_json(v) for k, v in sorted(self.columns.items())},
            "text": {k: dataclasses.asdict(v) for k, v in sorted(self.text.items())},
            "stats": dataclasses.asdict(self.stats) if self.stats else None,
        }

    def to_bytes(self, protocol: str) -> bytes:
        """shards.json as written: sorted keys, 2-space indent, one compact line per shard.

        Deterministic, and a 10^4-shard manifest stays 10^4 lines a person can read and diff.
        """
        obj = self.to_json(protocol)
        if protocol == LEGACY_PROTOCOL:
            return ("[\n" + _entry_lines(obj, "  ") + ("\n]\n" if obj else "]\n")).encode("utf-8")
        parts = []
        for key in sorted(obj):
            if key == "shards":
                body = ("[\n" + _entry_lines(obj[key], "    ") + "\n  ]") if obj[key] else "[]"
            else:
                body = json.dumps(obj[key], sort_keys=True, indent=2, ensure_ascii=False).replace("\n", "\n  ")
            parts.append(f'  "{key}": {body}')
        return ("{\n" + ",\n".join(parts) + "\n}\n").encode("utf-8")

    def checksums_json(self) -> Any:
        """Protocol 2.1 only: the checksums.json sidecar."""
        return {"files": {name: {"nbytes": n, "xxh3_128": h} for name, n, h in self.files()}}


def _entry_lines(entries: list[dict[str, Any]], indent: str) -> str:
    return ",\n".join(indent + json.dumps(e, sort_keys=True, separators=(", ", ": ")) for e in entries)


def _array_json(a: ArrayEntry) -> dict[str, Any]:
    d = dataclasses.asdict(a)
    d["shape"] = list(a.shape)
    return d


class _Collector:
    def __init__(self, path: str) -> None:
        self.path = path
        self.problems: list[Problem] = []

    def add(self, message: str) -> None:
        self.problems.append(Problem(ManifestError, f"{self.path}: {message}"))

    def keys(self, where: str, obj: object, required: tuple[str, ...]) -> bool:
        if not isinstance(obj, dict):
            self.add(f"{where}: expected an object, found {type_name(obj)}")
            return False
        missing = [k for k in required if k not in obj]
        unknown = sorted(set(obj) - set(required))
        if missing:
            self.add(f"{where}: missing keys {missing}")
        if unknown:
            self.add(f"{where}: unknown keys {short_list(unknown)}")
        return not missing

    def count(self, where: str, value: object) -> int | None:
        if not is_int(value) or value < 0:  # type: ignore[operator]
            self.add(f"{where}: expected an integer >= 0, found {type_name(value)} {short_repr(value)}")
            return None
        return value  # type: ignore[return-value]

    def digest(self, where: str, value: object) -> str | None:
        if not isinstance(value, str) or not XXH3_RE.fullmatch(value):
            self.add(f"{where}: expected 32 lower-case hex digits (xxh3_128), found {short_repr(value)}")
            return None
        return value

    def name(self, where: str, value: object, expected: str) -> str | None:
        if value != expected:
            self.add(f"{where}: expected name {expected!r}, found {short_repr(value)}")
            return None
        return expected


SHARD_KEYS = ("name", "n_examples", "nbytes", "xxh3_128")
ARRAY_KEYS = ("name", "dtype", "shape", "nbytes", "xxh3_128")
TEXT_KEYS = ("name", "n_lines", "nbytes", "xxh3_128")
FILE_KEYS = ("name", "nbytes", "xxh3_128")
TOP_KEYS = ("shards", "labels", "columns", "text", "stats")


def parse_manifest(obj: object, protocol: str, path: str) -> tuple[Manifest | None, list[Problem]]:
    """Parse shards.json of a ``protocol`` cache; returns the manifest and every problem found."""
    c = _Collector(path)
    if protocol == LEGACY_PROTOCOL:
        return _parse_legacy(obj, c), c.problems
    if not c.keys("top level", obj, TOP_KEYS):
        return None, c.problems
    assert isinstance(obj, dict)
    shards_obj = obj["shards"]
    if not isinstance(shards_obj, list):
        c.add(f"shards: expected an array, found {type_name(shards_obj)}")
        return None, c.problems
    shards = _fast_shards(shards_obj)
    if shards is None:
        shards = ShardList.of(_slow_shards(shards_obj, c))
    labels = None
    if obj["labels"] is not None:
        labels = _parse_array(c, "labels", obj["labels"], LABELS_FILE)
        if labels is not None and labels.dtype != LABELS_DTYPE.str:
            c.add(f"labels.dtype: expected {LABELS_DTYPE.str!r}, found {short_repr(labels.dtype)}")
    columns: dict[str, ArrayEntry] = {}
    if isinstance(obj["columns"], dict):
        for key, e in obj["columns"].items():
            if not FIELD_NAME_RE.fullmatch(key):
                c.add(f"columns: bad column name {short_repr(key)} (expected {FIELD_NAME_RE.pattern})")
                continue
            entry = _parse_array(c, f"columns.{key}", e, column_file(key))
            if entry is not None:
                columns[key] = entry
    else:
        c.add(f"columns: expected an object, found {type_name(obj['columns'])}")
    text: dict[str, TextEntry] = {}
    if isinstance(obj["text"], dict):
        for key, e in obj["text"].items():
            where = f"text.{key}"
            if not FIELD_NAME_RE.fullmatch(key):
                c.add(f"text: bad field name {short_repr(key)} (expected {FIELD_NAME_RE.pattern})")
                continue
            if not c.keys(where, e, TEXT_KEYS):
                continue
            name = c.name(f"{where}.name", e["name"], text_file(key))
            n_lines = c.count(f"{where}.n_lines", e["n_lines"])
            nbytes = c.count(f"{where}.nbytes", e["nbytes"])
            digest = c.digest(f"{where}.xxh3_128", e["xxh3_128"])
            if name is not None and n_lines is not None and nbytes is not None and digest is not None:
                text[key] = TextEntry(name, n_lines, nbytes, digest)
    else:
        c.add(f"text: expected an object, found {type_name(obj['text'])}")
    stats = None
    if obj["stats"] is not None and c.keys("stats", obj["stats"], FILE_KEYS):
        s = obj["stats"]
        name = c.name("stats.name", s["name"], STATS_FILE)
        nbytes = c.count("stats.nbytes", s["nbytes"])
        digest = c.digest("stats.xxh3_128", s["xxh3_128"])
        if name is not None and nbytes is not None and digest is not None:
            stats = FileEntry(name, nbytes, digest)
    manifest = Manifest(
        shards=shards,
        labels=labels,
        columns=columns,
        text=text,
        stats=stats,
    )
    return manifest, c.problems


_SHARD_KEYSET = frozenset(SHARD_KEYS)
_DIGESTS_RE = re.compile(r"(?:[0-9a-f]{32}\n)*")


def _fast_shards(entries: list[Any]) -> ShardList | None:
    """Validate the common, well-formed manifest in a few passes; None if anything is off."""
    try:
        # set(map(type, ...)) and min() run in C: a few ms for 10^4 entries.
        if set(map(type, entries)) - {dict} or set(map(len, entries)) - {len(SHARD_KEYS)}:
            return None
        # KeyError: some key is missing (the slow path says which). One column at a time:
        # faster than rows of tuples transposed by zip.
        names, counts, sizes, digests = (list(map(operator.itemgetter(key), entries)) for key in SHARD_KEYS)
        if (
            set(map(type, names)) - {str}
            or set(map(type, counts)) - {int}
            or set(map(type, sizes)) - {int}
            or set(map(type, digests)) - {str}
            or min(counts, default=0) < 0
            or min(sizes, default=0) < 0
            or not _DIGESTS_RE.fullmatch("\n".join(digests) + "\n" if digests else "")
        ):
            return None
    except (TypeError, KeyError):
        return None
    return ShardList(names, counts, sizes, digests)


def _slow_shards(entries: list[Any], c: _Collector) -> list[ShardEntry]:
    """Entry-by-entry validation that names every problem."""
    shards: list[ShardEntry] = []
    for i, e in enumerate(entries):
        where = f"shards[{i}]"
        if not isinstance(e, dict) or e.keys() != _SHARD_KEYSET:
            c.keys(where, e, SHARD_KEYS)
            continue
        name, n_ex, nbytes, digest = e["name"], e["n_examples"], e["nbytes"], e["xxh3_128"]
        # Report each bad field of this entry.
        if not (
            isinstance(name, str)
            and is_int(n_ex)
            and is_int(nbytes)
            and n_ex >= 0
            and nbytes >= 0
            and isinstance(digest, str)
            and len(digest) == 32
            and XXH3_RE.fullmatch(digest)
        ):
            if not isinstance(name, str):
                c.add(f"{where}.name: expected a string, found {type_name(name)}")
            c.count(f"{where}.n_examples", n_ex)
            c.count(f"{where}.nbytes", nbytes)
            c.digest(f"{where}.xxh3_128", digest)
            continue
        shards.append(ShardEntry(name, n_ex, nbytes, digest))
    return shards


def _parse_array(c: _Collector, where: str, e: object, expected_name: str) -> ArrayEntry | None:
    if not c.keys(where, e, ARRAY_KEYS):
        return None
    assert isinstance(e, dict)
    name = c.name(f"{where}.name", e["name"], expected_name)
    dtype = e["dtype"]
    if dtype not in COLUMN_DTYPES:
        c.add(f"{where}.dtype: expected one of {list(COLUMN_DTYPES)}, found {short_repr(dtype)}")
        dtype = None
    shape = e["shape"]
    if not (isinstance(shape, list) and shape and all(is_int(x) and x >= 0 for x in shape)):
        c.add(f"{where}.shape: expected a non-empty array of integers >= 0, found {short_repr(shape)}")
        shape = None
    nbytes = c.count(f"{where}.nbytes", e["nbytes"])
    digest = c.digest(f"{where}.xxh3_128", e["xxh3_128"])
    if name is None or dtype is None or shape is None or nbytes is None or digest is None:
        return None
    return ArrayEntry(name, dtype, tuple(shape), nbytes, digest)


def _parse_legacy(obj: object, c: _Collector) -> Manifest | None:
    if not isinstance(obj, list):
        c.add(f"expected an array of shard objects (protocol 2.1), found {type_name(obj)}")
        return None
    shards: list[ShardEntry] = []
    for i, e in enumerate(obj):
        where = f"[{i}]"
        if not c.keys(where, e, ("name", "n_examples")):
            continue
        assert isinstance(e, dict)
        n_ex = c.count(f"{where}.n_examples", e["n_examples"])
        if not isinstance(e["name"], str):
            c.add(f"{where}.name: expected a string, found {type_name(e['name'])}")
        elif n_ex is not None:
            shards.append(ShardEntry(e["name"], n_ex, -1, None))
    return Manifest(shards=ShardList.of(shards))


def parse_checksums(obj: object, path: str) -> tuple[dict[str, tuple[int, str]], list[Problem]]:
    """Parse the protocol 2.1 checksums.json sidecar into ``{name: (nbytes, xxh3_128)}``."""
    c = _Collector(path)
    out: dict[str, tuple[int, str]] = {}
    if not c.keys("top level", obj, ("files",)):
        return out, c.problems
    assert isinstance(obj, dict)
    files = obj["files"]
    if not isinstance(files, dict):
        c.add(f"files: expected an object, found {type_name(files)}")
        return out, c.problems
    for name, e in files.items():
        where = f"files[{short_repr(name)}]"
        if not c.keys(where, e, ("nbytes", "xxh3_128")):
            continue
        nbytes = c.count(f"{where}.nbytes", e["nbytes"])
        digest = c.digest(f"{where}.xxh3_128", e["xxh3_128"])
        if nbytes is not None and digest is not None:
            out[name] = (nbytes, digest)
    return out, c.problems


STATS_KEYS = ("layers", "count", "nonfinite", "mean", "var", "norm_mean", "norm_sq_mean")
_INT64_MAX = 2**63 - 1


def parse_stats(obj: object, layers: Sequence[int], d_model: int, path: str) -> dict[str, npt.NDArray[Any]]:
    """Check parsed stats.json against protocol.md 2.6 and return its arrays (integer counts
    as int64, the rest as float64); `StatsFileError` listing every problem."""
    problems: list[str] = []
    if not isinstance(obj, dict):
        raise StatsFileError(f"{path}: expected an object, found {type_name(obj)}")
    missing = [k for k in STATS_KEYS if k not in obj]
    unknown = sorted(set(obj) - set(STATS_KEYS))
    if missing:
        problems.append(f"missing keys {missing}")
    if unknown:
        problems.append(f"unknown keys {short_list(unknown)}")
    n_layers = len(layers)
    out: dict[str, npt.NDArray[Any]] = {}
    given_layers = obj.get("layers")
    if "layers" in obj and not (
        isinstance(given_layers, list) and all(map(is_int, given_layers)) and given_layers == list(layers)
    ):
        problems.append(f"layers: expected {list(layers)} (metadata.json's layers), found {short_repr(given_layers)}")
    elif "layers" in obj:
        out["layers"] = np.asarray(layers, dtype=np.int64)
    for key in ("count", "nonfinite"):
        value = obj.get(key)
        if key not in obj:
            continue
        if not (
            isinstance(value, list)
            and len(value) == n_layers
            and all(is_int(x) and 0 <= x <= _INT64_MAX for x in value)
        ):
            problems.append(f"{key}: expected {n_layers} integers >= 0 (one per layer), found {short_repr(value)}")
        else:
            out[key] = np.asarray(value, dtype=np.int64)
    for key, shape in (("norm_mean", (n_layers,)), ("norm_sq_mean", (n_layers,)), ("mean", (n_layers, d_model)),
                       ("var", (n_layers, d_model))):  # fmt: skip
        if key not in obj:
            continue
        array = _numbers(obj[key], shape)
        if array is None:
            what = f"{n_layers} numbers" if len(shape) == 1 else f"{n_layers} arrays of {d_model} numbers"
            problems.append(f"{key}: expected {what} (shape {list(shape)}), found {short_repr(obj[key])}")
        else:
            out[key] = array
    if problems:
        raise StatsFileError(f"{path}: " + "; ".join(problems))
    return out


def _numbers(value: object, shape: tuple[int, ...]) -> npt.NDArray[np.float64] | None:
    """``value`` as a float64 array of ``shape`` if it is nested lists of JSON numbers of that shape."""
    rows = [value] if len(shape) == 1 else value
    if not isinstance(rows, list) or len(rows) != (1 if len(shape) == 1 else shape[0]):
        return None
    width = shape[-1]
    if not all(isinstance(row, list) and len(row) == width for row in rows):
        return None
    # Type checks in C: numpy would turn strings and bools into numbers without a word.
    if not set(map(type, chain.from_iterable(rows))) <= {int, float}:
        return None
    return np.asarray(value, dtype=np.float64).reshape(shape)
