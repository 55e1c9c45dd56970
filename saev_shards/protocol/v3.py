"""Protocol 3.0, this library's own (protocol.md sections 1 to 7): every byte rule.

metadata.json holds the twelve keys of protocol.md 2.1 (sorted, indented, a final newline)
and names the directory by the sha256 of its canonical JSON (all 64 digits); shards.json
is an object recording every data file with its size and xxh3_128 digest; shard files are
exactly as long as their data; labels, per-example columns, text and statistics may sit
beside the activations. Protocol 3.1 (`v31`) adds to these rules and reuses them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import operator
import re
from collections.abc import Callable
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..errors import ManifestError, Problem, Problems, StatsFileError
from .checks import JSONChecks, check_keys
from .common import (
    COLUMN_DTYPES,
    FIELD_NAME_RE,
    LABELS_DTYPE,
    LABELS_FILE,
    MANIFEST_FILE,
    PROTOCOL_30,
    STATS_FILE,
    XXH3_RE,
    column_file,
    manifest_max_bytes,
    text_file,
)
from .dialect import Dialect
from .jsonfile import is_int, load_json, short_repr, type_name
from .manifest import ArrayEntry, FileEntry, Manifest, ShardEntry, ShardList, TextEntry

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .metadata import Metadata

#: metadata.json's keys (protocol.md 2.1), in the order saev's protocol lists them.
KEYS = (
    "family",
    "ckpt",
    "layers",
    "patches_per_ex",
    "cls_token",
    "d_model",
    "n_examples",
    "patches_per_shard",
    "data",
    "dataset",
    "dtype",
    "protocol",
)


def canonical_json(obj: object) -> bytes:
    """The bytes the content hash is taken of: ``json.dumps(obj, sort_keys=True, separators=(',', ':'))``.

    ``ensure_ascii`` keeps its default (True), so non-ASCII text is hashed as ``\\uXXXX``
    escapes, exactly as the seed formula does.
    """
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")


def content_hash(metadata: dict[str, Any]) -> str:
    """``sha256(canonical_json(metadata)).hexdigest()``: all 64 hex digits."""
    return hashlib.sha256(canonical_json(metadata)).hexdigest()


def pretty_json(obj: object) -> bytes:
    """Deterministic, human-readable JSON (sorted keys, 2-space indent, UTF-8, final newline)."""
    text = json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False)
    return (text + "\n").encode("utf-8")


class V3(Dialect):
    """Protocol 3.0."""

    name = PROTOCOL_30
    summary = "protocol 3.0"
    protocols = (PROTOCOL_30,)
    keys: tuple[str, ...] = KEYS
    holds_extras = True

    def metadata_bytes(self, md: Metadata) -> bytes:
        return pretty_json(self.to_json(md))

    def directory_name(self, md: Metadata) -> str:
        return content_hash(self.to_json(md))

    def load_manifest(self, folder: Path, md: Metadata) -> tuple[Manifest | None, list[Problem]]:
        path = folder / MANIFEST_FILE
        # Every integer of shards.json is type-checked by parse_manifest: the scan may skip scalars.
        obj, problems = load_json(path, manifest_max_bytes(md.n_shards), ManifestError, every_number=False)
        if problems:
            return None, problems
        return parse_manifest(obj, str(path))

    def manifest_bytes(self, manifest: Manifest, md: Metadata) -> bytes:
        return manifest_bytes(manifest)


DIALECT = V3()


# -- shards.json ------------------------------------------------------------------------------


def manifest_json(manifest: Manifest) -> dict[str, Any]:
    """The JSON object written as a 3.0 shards.json."""
    return {
        "shards": [s._asdict() for s in manifest.shards],
        "labels": _array_json(manifest.labels) if manifest.labels else None,
        "columns": {k: _array_json(v) for k, v in sorted(manifest.columns.items())},
        "text": {k: dataclasses.asdict(v) for k, v in sorted(manifest.text.items())},
        "stats": dataclasses.asdict(manifest.stats) if manifest.stats else None,
    }


#: Keys of shards.json whose value is an array of per-shard entries, written one line each.
_PER_SHARD_KEYS = ("shards", "scales")


def manifest_bytes(manifest: Manifest, obj: dict[str, Any] | None = None) -> bytes:
    """shards.json as written: sorted keys, 2-space indent, one compact line per shard entry
    (``obj``: the object to write, by default the 3.0 one of ``manifest``).

    Deterministic, and a 10^4-shard manifest stays 10^4 lines a person can read and diff.
    """
    obj = manifest_json(manifest) if obj is None else obj
    parts = []
    for key in sorted(obj):
        if key in _PER_SHARD_KEYS and isinstance(obj[key], list):
            body = ("[\n" + _entry_lines(obj[key], "    ") + "\n  ]") if obj[key] else "[]"
        else:
            body = json.dumps(obj[key], sort_keys=True, indent=2, ensure_ascii=False).replace("\n", "\n  ")
        parts.append(f'  "{key}": {body}')
    return ("{\n" + ",\n".join(parts) + "\n}\n").encode("utf-8")


def _entry_lines(entries: list[dict[str, Any]], indent: str) -> str:
    return ",\n".join(indent + json.dumps(e, sort_keys=True, separators=(", ", ": ")) for e in entries)


def _array_json(a: ArrayEntry) -> dict[str, Any]:
    d = dataclasses.asdict(a)
    d["shape"] = list(a.shape)
    return d


SHARD_KEYS = ("name", "n_examples", "nbytes", "xxh3_128")
ARRAY_KEYS = ("name", "dtype", "shape", "nbytes", "xxh3_128")
TEXT_KEYS = ("name", "n_lines", "nbytes", "xxh3_128")
FILE_KEYS = ("name", "nbytes", "xxh3_128")
TOP_KEYS = ("shards", "labels", "columns", "text", "stats")


def parse_manifest(
    obj: object,
    path: str,
    more_keys: tuple[str, ...] = (),
    more: Callable[[JSONChecks, dict[str, Any]], dict[str, Any]] | None = None,
) -> tuple[Manifest | None, list[Problem]]:
    """Parse a 3.0 shards.json; returns the manifest and every problem found.

    A later version's parser (`v31`) names its top-level keys in ``more_keys`` and parses them
    with ``more(checks, obj)``, which returns the `Manifest` fields they give."""
    c = JSONChecks(path)
    if not c.keys("top level", obj, TOP_KEYS + more_keys):
        return None, c.problems
    assert isinstance(obj, dict)
    shards_obj = obj["shards"]
    if not isinstance(shards_obj, list):
        c.expected("shards", "an array", type_name(shards_obj))
        return None, c.problems
    shards = _fast_shards(shards_obj)
    if shards is None:
        shards = ShardList.of(_slow_shards(shards_obj, c))
    labels = None
    if obj["labels"] is not None:
        labels = _parse_array(c, "labels", obj["labels"], LABELS_FILE)
        if labels is not None and labels.dtype != LABELS_DTYPE.str:
            c.expected("labels.dtype", repr(LABELS_DTYPE.str), short_repr(labels.dtype))
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
        c.expected("columns", "an object", type_name(obj["columns"]))
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
        c.expected("text", "an object", type_name(obj["text"]))
    stats = None if obj["stats"] is None else parse_file_entry(c, "stats", obj["stats"], STATS_FILE)
    manifest = Manifest(
        shards=shards,
        labels=labels,
        columns=columns,
        text=text,
        stats=stats,
        **(more(c, obj) if more is not None else {}),
    )
    return manifest, c.problems


def parse_file_entry(c: JSONChecks, where: str, e: object, expected_name: str) -> FileEntry | None:
    """A file entry (``name``, ``nbytes``, ``xxh3_128``) named ``expected_name``; None after
    adding its problems to ``c``."""
    if not c.keys(where, e, FILE_KEYS):
        return None
    assert isinstance(e, dict)
    name = c.name(f"{where}.name", e["name"], expected_name)
    nbytes = c.count(f"{where}.nbytes", e["nbytes"])
    digest = c.digest(f"{where}.xxh3_128", e["xxh3_128"])
    if name is None or nbytes is None or digest is None:
        return None
    return FileEntry(name, nbytes, digest)


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
            # Lengths first: a digest holding a newline could otherwise pass the joined match.
            or set(map(len, digests)) - {32}
            or not _DIGESTS_RE.fullmatch("\n".join(digests) + "\n" if digests else "")
        ):
            return None
    except (TypeError, KeyError):
        return None
    return ShardList(names, counts, sizes, digests)


def _slow_shards(entries: list[Any], c: JSONChecks) -> list[ShardEntry]:
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
                c.expected(f"{where}.name", "a string", type_name(name))
            c.count(f"{where}.n_examples", n_ex)
            c.count(f"{where}.nbytes", nbytes)
            c.digest(f"{where}.xxh3_128", digest)
            continue
        shards.append(ShardEntry(name, n_ex, nbytes, digest))
    return shards


def _parse_array(c: JSONChecks, where: str, e: object, expected_name: str) -> ArrayEntry | None:
    if not c.keys(where, e, ARRAY_KEYS):
        return None
    assert isinstance(e, dict)
    name = c.name(f"{where}.name", e["name"], expected_name)
    dtype = e["dtype"]
    if dtype not in COLUMN_DTYPES:
        c.expected(f"{where}.dtype", f"one of {list(COLUMN_DTYPES)}", short_repr(dtype))
        dtype = None
    shape = e["shape"]
    if not (isinstance(shape, list) and shape and all(is_int(x) and x >= 0 for x in shape)):
        c.expected(f"{where}.shape", "a non-empty array of integers >= 0", short_repr(shape))
        shape = None
    nbytes = c.count(f"{where}.nbytes", e["nbytes"])
    digest = c.digest(f"{where}.xxh3_128", e["xxh3_128"])
    if name is None or dtype is None or shape is None or nbytes is None or digest is None:
        return None
    return ArrayEntry(name, dtype, tuple(shape), nbytes, digest)


STATS_KEYS = ("layers", "count", "nonfinite", "mean", "var", "norm_mean", "norm_sq_mean")
_INT64_MAX = 2**63 - 1


def parse_stats(
    obj: object, layers: Sequence[int], d_model: int, path: str, tokens: int | None = None
) -> dict[str, npt.NDArray[Any]]:
    """Check parsed stats.json against protocol.md 2.6 and return its arrays (integer counts
    as int64, the rest as float64); `StatsFileError` listing every problem.

    Ranges too: variances and norms non-negative, a layer with no included token all zeros,
    and, given ``tokens`` (the cache's token positions, ``n_examples * tokens_per_ex``),
    ``count + nonfinite`` at most that many per layer (statistics of other data otherwise)."""
    if not isinstance(obj, dict):
        raise StatsFileError(f"{path}: expected an object, found {type_name(obj)}")
    problems = Problems(StatsFileError, head=f"{path}: ")
    check_keys(problems, obj, STATS_KEYS)
    n_layers = len(layers)
    out: dict[str, npt.NDArray[Any]] = {}
    given_layers = obj.get("layers")
    if "layers" in obj and not (
        isinstance(given_layers, list) and all(map(is_int, given_layers)) and given_layers == list(layers)
    ):
        problems.expected("layers", f"{list(layers)} (metadata.json's layers)", short_repr(given_layers))
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
            problems.expected(key, f"{n_layers} integers >= 0 (one per layer)", short_repr(value))
        else:
            out[key] = np.asarray(value, dtype=np.int64)
    for key, shape in (("norm_mean", (n_layers,)), ("norm_sq_mean", (n_layers,)), ("mean", (n_layers, d_model)),
                       ("var", (n_layers, d_model))):  # fmt: skip
        if key not in obj:
            continue
        array = _numbers(obj[key], shape)
        if array is None:
            what = f"{n_layers} numbers" if len(shape) == 1 else f"{n_layers} arrays of {d_model} numbers"
            problems.expected(key, f"{what} (shape {list(shape)})", short_repr(obj[key]))
        else:
            out[key] = array
    if not problems:
        _check_ranges(out, problems, tokens)
    problems.raise_if_any()
    return out


def _check_ranges(out: dict[str, npt.NDArray[Any]], problems: Problems, tokens: int | None) -> None:
    """The value rules of protocol.md 2.6 on arrays that passed the schema."""
    for key in ("var", "norm_mean", "norm_sq_mean"):
        if key in out and (out[key] < 0).any():
            where = np.argwhere(out[key] < 0)[0].tolist()
            problems.expected(
                f"{key}{where}", "a number >= 0 (a variance or a norm)", repr(float(out[key][tuple(where)]))
            )
    if "count" in out and "nonfinite" in out and tokens is not None:
        seen = out["count"] + out["nonfinite"]
        over = np.flatnonzero(seen > tokens)
        if len(over):
            i = int(over[0])
            problems.expected(
                f"count[{i}] + nonfinite[{i}]",
                f"at most {tokens:,} (the cache's token positions)",
                f"{int(out['count'][i]):,} + {int(out['nonfinite'][i]):,}",
            )
    if "count" in out:
        empty = out["count"] == 0
        for key in ("mean", "var", "norm_mean", "norm_sq_mean"):
            if key not in out or not empty.any():
                continue
            nonzero = out[key] != 0
            bad = np.flatnonzero(empty & (nonzero if nonzero.ndim == 1 else nonzero.any(axis=1)))
            if len(bad):
                problems.expected(f"{key}[{int(bad[0])}]", "zeros (its count is 0: no token included)", "other values")


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
