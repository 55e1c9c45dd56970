"""fileio.publish: a folder is published only when it holds exactly the expected files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import saev_shards as ss
from saev_shards import fileio


def test_publish_dir_refuses_anything_but_the_expected_files(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "a.bin").write_bytes(b"12345")
    (staging / ".lock").write_bytes(b"")
    (staging / "sub").mkdir()
    final = tmp_path / "final"
    expected = {"a.bin": 4, "b.bin": 1, "sub": 0}
    with pytest.raises(ss.WriterError) as info:
        fileio.publish_dir(staging, final, durable=False, expected=expected)
    message = str(info.value)
    assert f"{staging / 'a.bin'}: expected 4 bytes, found 5" in message
    assert f"{staging / 'b.bin'}: missing" in message
    assert f"{staging / 'sub'}: expected a regular file, found drwx" in message
    assert f"{staging / '.lock'}: not expected here" in message
    assert not final.exists()
    os.unlink(staging / ".lock")
    os.rmdir(staging / "sub")
    (staging / "b.bin").write_bytes(b"x")
    assert fileio.publish_dir(staging, final, durable=False, expected={"a.bin": 5, "b.bin": 1})
    assert oct(final.stat().st_mode & 0o777) == "0o555"
    assert {oct(p.stat().st_mode & 0o777) for p in final.iterdir()} == {"0o444"}
