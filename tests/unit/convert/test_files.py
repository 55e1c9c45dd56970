"""convert.files: every file a converter reads is a regular file of bounded size, read whole or
by lines, gzip members expanded within a cap; every problem a `ConvertError` naming the file."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from saev_shards.convert import files
from saev_shards.errors import ConvertError


def test_read_bytes_takes_regular_files_within_the_cap(tmp_path: Path) -> None:
    path = tmp_path / "a.bin"
    path.write_bytes(b"x" * 100)
    (tmp_path / "link").symlink_to(path)  # a source's files are often linked in
    assert files.read_bytes(tmp_path / "link", 100) == b"x" * 100
    with pytest.raises(
        ConvertError, match=r"a\.bin \(the index\): 100 bytes, more than the 99 this file may hold; raise it"
    ):
        files.read_bytes(path, 99, "the index", hint="; raise it")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ConvertError, match=r"found a FIFO.*: a source is read from regular files only"):
        files.read_bytes(tmp_path / "fifo", 100)
    with pytest.raises(ConvertError, match="missing"):
        files.read_bytes(tmp_path / "missing", 100)
    assert files.is_file(tmp_path / "link") and not files.is_file(tmp_path)
    assert files.is_dir(tmp_path) and not files.is_dir(path) and not files.is_dir(tmp_path / "missing")


def test_read_json_is_strict(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text('{"a": [1, 2]}')
    assert files.read_json(tmp_path / "a.json") == {"a": [1, 2]}
    (tmp_path / "b.json").write_text('{"a": 1, "a": 2}')
    with pytest.raises(ConvertError, match=r"b\.json"):
        files.read_json(tmp_path / "b.json")


@given(st.lists(st.binary(max_size=3000), min_size=1, max_size=3), st.sampled_from([b"", b"\0\0"]))
def test_gunzip_expands_every_member(members: list[bytes], padding: bytes) -> None:
    data = b"".join(gzip.compress(m) for m in members) + padding
    assert files.gunzip(data, 10_000, Path("s.pkl.gz")) == b"".join(members)


def test_gunzip_stops_at_the_cap_and_names_damage() -> None:
    bomb = gzip.compress(b"\0" * 1_000_000)
    with pytest.raises(ConvertError, match=r"s\.gz: expands to more than 1,000 bytes, the most one shard may take"):
        files.gunzip(bomb, 1000, Path("s.gz"))
    with pytest.raises(ConvertError, match=r"not a readable gzip file \(truncated after"):
        files.gunzip(bomb[: len(bomb) // 2], 2_000_000, Path("s.gz"))
    with pytest.raises(ConvertError, match="not a readable gzip file"):
        files.gunzip(b"not gzip at all", 1000, Path("s.gz"))


def test_lines_are_read_one_at_a_time_up_to_the_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"one\n" + b"x" * 50 + b"\n")
    monkeypatch.setattr(files, "MAX_LINE_BYTES", 10)
    with files.open_lines(path) as f:
        assert files.read_line(f, path, 1) == b"one\n"
        with pytest.raises(ConvertError, match=r"t\.jsonl: line 2 is longer than 10 bytes"):
            files.read_line(f, path, 2)
