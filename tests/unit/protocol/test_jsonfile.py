"""The one strict JSON loader (`format.strict_json_loads`, `format.read_json_file`), the value
rules for metadata built in Python (`format.json_value_problem`) and bounded reprs."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import saev_shards as ss
from saev_shards.protocol.jsonfile import (
    JSON_INT_MAX,
    JSON_INT_MIN,
    MAX_JSON_DEPTH,
    json_value_problem,
    read_json_file,
    short_repr,
    strict_json_loads,
)

from ...support.caches import small_metadata, write_cache
from ...support.hostile import Raw, render, writable


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
        (b'{"a": "x:y", "a": 1}', "duplicate key 'a'"),  # a ':' in a string: the exact parser decides
        (b'[{"name": "acts000000.bin", "name": "acts000000.bin"}]', "duplicate key 'name'"),
        (b'{"a": NaN}', "NaN and Infinity are not JSON numbers"),
        (b"[-Infinity]", "NaN and Infinity are not JSON numbers"),
        (b"[1e400]", "number is infinity"),
        (b'"\\ud800"', "surrogate"),
        (b'"\xff"', "not valid UTF-8"),
        (b"\xef\xbb\xbf{}", "byte order mark"),
        (b"[" * 65 + b"]" * 65, "nested deeper than 64 levels"),
        # orjson >= 3.10 stops at its own depth limit; older ones parse it, and the depth check names it
        (b"[" * 100_000 + b"]" * 100_000, "depth limit exceeded|nested deeper than 64 levels"),
        (b"[18446744073709551616]", "integer 18446744073709551616 does not fit 64 bits"),
        (b"[-9223372036854775809]", "does not fit 64 bits"),
        (b"[1" + b"0" * 5000 + b"]", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"{} {}", "not valid JSON"),
    ],
)
def test_strict_json_rejects(text: bytes, message: str) -> None:
    with pytest.raises(ss.JSONFileError, match=message):
        strict_json_loads(text)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        (b"[18446744073709551615, -9223372036854775808]", [JSON_INT_MAX, JSON_INT_MIN]),
        (b'{"ckpt": "hf-hub:timm/x", "k:": {"a": 1}}', {"ckpt": "hf-hub:timm/x", "k:": {"a": 1}}),
        (b"[1e19, -1e300, 0.5]", [1e19, -1e300, 0.5]),
        (b'"a\\u0000b"', "a\x00b"),
        (b"[" * 64 + b"]" * 64, json.loads("[" * 64 + "]" * 64)),
    ],
)
def test_strict_json_accepts(text: bytes, value: Any) -> None:
    assert strict_json_loads(text) == value


@given(st.recursive(st.none() | st.booleans() | st.integers(JSON_INT_MIN, JSON_INT_MAX)
                    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                    max_leaves=20))  # fmt: skip
def test_strict_json_reads_what_python_writes(value: Any) -> None:
    """Any value within the rules round-trips exactly (the fast path and the exact one agree)."""
    for text in (json.dumps(value), json.dumps(value, indent=2, ensure_ascii=False)):
        assert strict_json_loads(text.encode()) == value


@given(st.lists(st.sampled_from(["a", "b", "c:", "d"]), min_size=2, max_size=6))
def test_repeated_keys_found_whatever_the_colons(keys: list[str]) -> None:
    text = render(Raw("{" + ", ".join(f'"{k}": {i}' for i, k in enumerate(keys)) + "}")).encode()
    if len(set(keys)) == len(keys):
        assert strict_json_loads(text) == {k: i for i, k in enumerate(keys)}
    else:
        with pytest.raises(ss.JSONFileError, match="duplicate key"):
            strict_json_loads(text)


def test_read_json_file_refuses_what_is_not_a_bounded_regular_file(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_bytes(b'{"a": 1}')
    assert read_json_file(path, 8) == {"a": 1}
    with pytest.raises(ss.JSONFileError, match=rf"{path}: expected at most 7 bytes, found 8"):
        read_json_file(path, 7)
    link = tmp_path / "link.json"
    link.symlink_to(path)
    with pytest.raises(ss.NotRegularFileError, match="found a symbolic link"):
        read_json_file(link, 100)
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    with pytest.raises(ss.NotRegularFileError, match="found a symbolic link"):
        read_json_file(zero, 100)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(ss.NotRegularFileError, match="found a FIFO"):
        read_json_file(fifo, 100)
    with pytest.raises(ss.NotRegularFileError, match="found a directory"):
        read_json_file(tmp_path, 100)
    with pytest.raises(FileNotFoundError):
        read_json_file(tmp_path / "absent.json", 100)
    path.write_bytes(b'{"a": NaN}')
    with pytest.raises(ss.JSONFileError, match=rf"^{path}: not valid JSON"):
        read_json_file(path, 100)


def deep(levels: int) -> Any:
    value: Any = 0
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({"family": "\ud800"}, "string '\\\\ud800' is not valid Unicode"),
        ({"n": 2**64}, "integer 18446744073709551616 does not fit 64 bits"),
        ([-(2**63) - 1], "does not fit 64 bits"),
        ({"x": float("nan")}, "nan is not a JSON number"),
        ({"x": (float("inf"),)}, "inf is not a JSON number"),
        ({1: "a"}, "object keys must be strings, found int 1"),
        ({"x": {1, 2}}, "set {1, 2} is not a JSON value"),
        (deep(MAX_JSON_DEPTH + 1), "nested deeper than 64 levels"),
        (deep(1_000_000), "nested deeper than 64 levels"),  # no RecursionError
    ],
    ids=lambda v: v[:40] if isinstance(v, str) else type(v).__name__,
)
def test_json_value_problem(value: Any, problem: str) -> None:
    found = json_value_problem(value)
    assert found is not None and problem.replace("\\\\", "\\") in found


def test_json_value_problem_of_an_integer_too_long_to_print() -> None:
    expected = "integer <integer of 16610 bits> does not fit 64 bits (expected -2**63 to 2**64-1)"
    assert json_value_problem([10**5000]) == expected


def test_json_value_problem_accepts_the_limits() -> None:
    assert json_value_problem({"a": [JSON_INT_MAX, JSON_INT_MIN, 1e308, "a\x00\x1b é", None, True]}) is None
    assert json_value_problem(deep(MAX_JSON_DEPTH)) is None


def test_short_repr_is_bounded_whatever_the_value() -> None:
    assert len(short_repr("x" * 10**6)) <= 80
    assert short_repr(10**5000) == "<integer of 16610 bits>"
    assert len(short_repr(deep(100_000))) <= 80
    assert short_repr("\x1b[2J\ud800") == repr("\x1b[2J\ud800")  # escaped, as repr writes them


def test_the_fast_scan_still_finds_depth_and_repeated_keys() -> None:
    """``every_number=False`` stops once every bracket is accounted for; brackets inside
    strings only make it look further, and integers beyond 64 bits stay floats for the
    schema to reject."""
    fast = {"every_number": False}
    for text in (b"[" * 65 + b"]" * 65, b'["{[", ' + b"[" * 65 + b"]" * 65 + b"]"):
        with pytest.raises(ss.JSONFileError, match="nested deeper than 64 levels"):
            strict_json_loads(text, **fast)
    with pytest.raises(ss.JSONFileError, match="duplicate key 'n'"):
        strict_json_loads(b'{"shards": [{"n": 1, "n": 1}], "x": "[{"}', **fast)
    assert strict_json_loads(b'[{"nbytes": 18446744073709551616}]', **fast) == [{"nbytes": 2.0**64}]
    with pytest.raises(ss.JSONFileError, match="does not fit 64 bits"):
        strict_json_loads(b'[{"nbytes": 18446744073709551616}]')


def test_a_manifest_integer_beyond_64_bits_is_rejected_by_the_schema(root: Path) -> None:
    md = small_metadata(n_examples=3)
    write_cache(root, md)
    path = writable(root / md.hash) / "shards.json"
    path.write_text(path.read_text().replace('"nbytes": 480', '"nbytes": 18446744073709551616', 1))
    found = r"nbytes: expected an integer >= 0, found float 1\.8446744073709552e\+19"
    with pytest.raises(ss.ManifestError, match=found):
        ss.open(root / md.hash)
