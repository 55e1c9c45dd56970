"""The one strict JSON loader every JSON file of a cache goes through (protocol.md section 2),
and the helpers that quote JSON values in messages.

`read_json_file` reads a file (regular files only, size-capped) and `strict_json_loads`
parses it; `json_value_problem` applies the same rules to values built in Python.
"""

from __future__ import annotations

import json
import math
import operator
import os
import reprlib
from itertools import chain, compress, repeat
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from ..errors import CacheNotFoundError, InvalidCacheError, JSONFileError, NotRegularFileError, Problem
from ..fileio import open_regular

#: Deepest nesting of arrays and objects accepted. Real files nest a few levels (shards.json
#: 4); 64 stays far below every recursive consumer of a parsed value (repr, copy.deepcopy and
#: json.dumps recurse up to Python's ~1000-frame limit, orjson.dumps stops at 254 levels), so
#: none of them can raise RecursionError on anything a cache holds.
MAX_JSON_DEPTH = 64
#: Integers must fit 64 bits, signed or unsigned: what orjson, numpy and C readers hold.
#: (orjson parses larger integer literals as floats, which would change the metadata hash.)
JSON_INT_MIN = -(2**63)
JSON_INT_MAX = 2**64 - 1


def read_json_file(path: Path, max_bytes: int, *, every_number: bool = True) -> Any:
    """Read and parse one JSON file of a cache under the rules of `strict_json_loads`.

    The file must be a regular file, not a symbolic link (`NotRegularFileError`; a FIFO or a
    device is never opened), of at most ``max_bytes`` bytes (`JSONFileError`; at most
    ``max_bytes + 1`` bytes are ever read, so a file that grows cannot exhaust memory).
    `FileNotFoundError` when it does not exist; other `OSError`s (permissions) pass through.
    ``every_number``: as for `strict_json_loads`.
    """
    data = read_capped(path, max_bytes)
    try:
        return strict_json_loads(data, every_number=every_number)
    except JSONFileError as err:
        raise JSONFileError(f"{path}: {err}") from None


def read_capped(path: Path, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path`` if it holds at most ``max_bytes`` (the reading
    half of `read_json_file`, with its errors: it never reads more than ``max_bytes + 1``)."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise JSONFileError(f"{path}: expected at most {max_bytes:,} bytes, found {size:,}")
        chunks = []
        left = max_bytes + 1
        while left > 0:
            chunk = f.read(min(left, size + 1))  # a regular file: the whole of it, then b""
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise JSONFileError(f"{path}: expected at most {max_bytes:,} bytes, found more (the file grew while read)")
    return data


def load_json(
    path: Path, max_bytes: int, kind: type[InvalidCacheError], *, every_number: bool = True
) -> tuple[Any, list[Problem]]:
    """`read_json_file` for a file of a cache: ``(parsed value, [])``, or ``(None, [the problem])``
    worded for a file of ``kind`` (a missing file as `CacheNotFoundError`)."""
    try:
        return read_json_file(path, max_bytes, every_number=every_number), []
    except FileNotFoundError:
        return None, [Problem(CacheNotFoundError, f"{path}: missing")]
    except (JSONFileError, NotRegularFileError) as err:
        return None, [Problem(kind, str(err))]


def strict_json_loads(data: bytes, *, every_number: bool = True) -> Any:
    """Parse ``data`` as one strict JSON document, or raise `JSONFileError` saying why.

    Strict: UTF-8 (no byte-order mark), RFC 8259 (no NaN or Infinity, no number that
    overflows a double), no object repeating a key, strings of valid Unicode (no lone
    surrogate escapes), nesting at most `MAX_JSON_DEPTH` deep, integers within
    [`JSON_INT_MIN`, `JSON_INT_MAX`].

    The fast path is orjson (it refuses nesting beyond 1024 by itself, so no input can
    exhaust the stack) and one scan of the parsed value, level by level, whose work runs
    in C. orjson keeps the last of repeated keys, so the scan counts keys: a document has
    no repeated key when it has as many ``:`` bytes as parsed keys (each key brings one
    ``:``; any other ``:`` is inside a string). Only when the counts differ (a ``:`` in a
    string, as in ``"hf-hub:..."``) or a float of magnitude >= 2**63 appears (orjson's
    reading of a larger integer) is the document parsed again by Python's exact parser,
    which names the repeated key or the integer. The depth is known to be bounded by then,
    so that parser cannot recurse too deep either.

    ``every_number=False`` lets the scan stop as soon as it has met as many arrays and
    objects as the text has ``[`` and ``{`` bytes (then no container is left unseen and no
    bracket sits in a string), without looking at the scalars below: for a 10^4-shard
    manifest 1.7 ms on top of orjson's 3, instead of 3.9 (CPU time, this machine). An
    integer beyond 64 bits among those scalars then stays the float orjson made of it, so
    this is only for files whose schema type-checks every integer (shards.json,
    stats.json), where such a float is rejected as "expected an integer".
    """
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as err:
        hint = "; NaN and Infinity are not JSON numbers" if data.startswith((b"NaN", b"Infinity"), err.pos) else ""
        raise JSONFileError(f"not valid JSON ({err}{hint})") from None
    # Byte counts by numpy compares: 0.4 ms for 1 MB where three bytes.count take 1.2.
    text = np.frombuffer(data, np.uint8)
    containers = (
        None if every_number else int(np.count_nonzero(text == _OPEN_BRACE) + np.count_nonzero(text == _OPEN_BRACKET))
    )
    keys, huge_float = _scan_parsed(value, containers)
    if huge_float or keys != np.count_nonzero(text == _COLON):
        try:
            value = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates)
        except JSONFileError:
            raise
        except ValueError as err:  # e.g. an integer of more than 4300 digits
            raise JSONFileError(f"not valid JSON ({err})") from None
        problem = json_value_problem(value)
        if problem is not None:
            raise JSONFileError(problem)
    return value


_COLON, _OPEN_BRACE, _OPEN_BRACKET = b":{["


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise JSONFileError(f"duplicate key {short_repr(key)} in an object")
            seen.add(key)
    return out


def _scan_parsed(value: Any, containers: int | None = None) -> tuple[int, bool]:
    """``(number of object keys, whether a float of magnitude >= 2**63 occurs)`` of a value
    orjson parsed; `JSONFileError` when nested deeper than `MAX_JSON_DEPTH`. Given the
    number of ``containers`` in the text, stop once that many were found.

    Level by level, never recursing: each level's containers are split from their children
    with map/compress/set, which run in C, instead of a Python loop per value.
    """
    keys = 0
    found = 0
    huge_float = False
    dicts: list[dict[str, Any]] = [value] if type(value) is dict else []
    lists: list[list[Any]] = [value] if type(value) is list else []
    depth = 0
    while dicts or lists:
        depth += 1
        if depth > MAX_JSON_DEPTH:
            raise JSONFileError(f"nested deeper than {MAX_JSON_DEPTH} levels of arrays and objects")
        keys += sum(map(len, dicts))
        found += len(dicts) + len(lists)
        if found == containers:
            break
        children = list(chain(chain.from_iterable(map(dict.values, dicts)), chain.from_iterable(lists)))
        types = list(map(type, children))
        kinds = set(types)
        if dict not in kinds and list not in kinds and float not in kinds:
            break
        dicts = list(compress(children, map(operator.is_, types, repeat(dict)))) if dict in kinds else []
        lists = list(compress(children, map(operator.is_, types, repeat(list)))) if list in kinds else []
        if float in kinds:
            floats = compress(children, map(operator.is_, types, repeat(float)))
            huge_float = huge_float or max(map(abs, floats)) >= 2.0**63
    return keys, huge_float


def json_value_problem(value: object) -> str | None:
    """What keeps a Python value from being stored in a cache's JSON, or None when nothing does.

    The rules `strict_json_loads` enforces on files, for values built in Python (`Metadata`):
    only dicts with string keys, lists or tuples, strings, ints, floats, bools and None;
    nesting at most `MAX_JSON_DEPTH` deep, integers within 64 bits, finite floats, strings
    that are valid Unicode (encodable as UTF-8). Iterative: a value nested a million levels
    deep is reported, not a `RecursionError`.
    """
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list, tuple)):
            if depth >= MAX_JSON_DEPTH:
                return f"nested deeper than {MAX_JSON_DEPTH} levels of arrays and objects"
            if isinstance(item, dict):
                for key in item:
                    if not isinstance(key, str):
                        return f"object keys must be strings, found {type_name(key)} {short_repr(key)}"
                    problem = _string_problem(key)
                    if problem:
                        return problem
                stack.extend((v, depth + 1) for v in item.values())
            else:
                stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, str):
            problem = _string_problem(item)
            if problem:
                return problem
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, int):
            if not JSON_INT_MIN <= item <= JSON_INT_MAX:
                return f"integer {short_repr(item)} does not fit 64 bits (expected -2**63 to 2**64-1)"
        elif isinstance(item, float):
            if not math.isfinite(item):
                return f"{item} is not a JSON number (expected a finite float)"
        else:
            return f"{type_name(item)} {short_repr(item)} is not a JSON value"
    return None


def _string_problem(text: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"string {short_repr(text)} is not valid Unicode ({err.reason}: {text[err.start]!r})"
    return None


class _ShortRepr(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 128:  # repr of an int beyond 4300 digits raises; long ones are noise
            return f"<integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_SHORT = _ShortRepr()
_SHORT.maxlevel = 3
_SHORT.maxstring = 60
_SHORT.maxother = 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 6


def short_repr(value: object, limit: int = 80) -> str:
    """``repr`` for error messages, bounded in length and depth whatever ``value`` is.

    Control characters and lone surrogates come out escaped, as ``repr`` writes them.
    """
    text = _SHORT.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short_list(items: list[Any], limit: int = 8) -> str:
    """A list for a message: at most ``limit`` items, each a `short_repr`, and the count if cut."""
    shown = ", ".join(short_repr(item, 40) for item in items[:limit])
    return f"[{shown}, ...] ({len(items)} in all)" if len(items) > limit else f"[{shown}]"


def type_name(value: object) -> str:
    """JSON-flavoured name of a value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def is_int(value: object, *, numpy_ok: bool = False) -> bool:
    """True for JSON integers (Python ints that are not bools); with ``numpy_ok``, numpy
    integer scalars too (an index into a cache may be one; a JSON value never is)."""
    if numpy_ok and isinstance(value, np.integer):
        return True
    return isinstance(value, int) and not isinstance(value, bool)
