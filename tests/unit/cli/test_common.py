"""cli._common: what every command shares: output that never carries a raw control character,
tables, JSON, and the argument types of sizes and integer lists."""

from __future__ import annotations

import argparse
import io
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from saev_shards.cli._common import EscapingWriter, int_list, parse_size, plural, print_json, printable, table


@given(st.text())
def test_printable_text_holds_no_control_character(text: str) -> None:
    out = printable(text)
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or c in "\u2028\u2029\u202e" for c in out)
    kept = printable(text, keep_line_breaks=True)
    assert kept.count("\n") == text.count("\n")


def test_the_escapes_say_which_character_it_was() -> None:
    assert printable("a\x1b[31mb\u202ec\n") == "a\\x1b[31mb\\u202ec\\x0a"
    assert printable("a\tb\n", keep_line_breaks=True) == "a\tb\n"
    raw = io.StringIO()
    writer = EscapingWriter(raw)
    assert writer.write("x\x07y\n") == 4
    assert raw.getvalue() == "x\\x07y\n" and writer.writable()


def test_tables_pad_columns_and_keep_each_value_in_its_cell() -> None:
    out = io.StringIO()
    table([["name", "bytes"], ["a\nb", "12"], ["long name", "3"]], out, indent="  ", right=[1])
    assert out.getvalue().splitlines() == ["  name       bytes", "  a\\x0ab        12", "  long name      3"]


def test_json_output_escapes_what_a_terminal_would_act_on() -> None:
    out = io.StringIO()
    print_json({"name": "x\u202ey", "n": 1}, out)
    assert "\u202e" not in out.getvalue() and json.loads(out.getvalue()) == {"name": "x\u202ey", "n": 1}
    out = io.StringIO()
    print_json({"name": "\udcff"}, out)  # not UTF-8: Python's json, ASCII only
    assert json.loads(out.getvalue()) == {"name": "\udcff"}


@pytest.mark.parametrize(
    ("text", "size"), [("2G", 2 << 30), ("512MiB", 512 << 20), ("1.5g", 3 << 29), ("100", 100), (" 4 kb ", 4096)]
)
def test_sizes_in_binary_units(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "2X", "-1", "1" * 21])
def test_bad_sizes_are_argument_errors(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected a size like 2G, 512M or 1073741824"):
        parse_size(text)


def test_integer_lists_and_plurals() -> None:
    assert int_list("6, 11") == [6, 11] and int_list("11") == [11] and int_list("-1,") == [-1]
    with pytest.raises(argparse.ArgumentTypeError, match="expected comma-separated integers such as 6,11, found 'a,b'"):
        int_list("a,b")
    assert (plural(1, "shard"), plural(0, "shard"), plural(2, "shard")) == ("1 shard", "0 shards", "2 shards")
