"""fileio.space: disk-full errors that name the file, the free-space check, bytes on disk."""

from __future__ import annotations

import errno
import os
import pickle
from pathlib import Path

import pytest

import saev_shards as ss
from saev_shards import fileio


def test_disk_full_error_is_an_oserror_that_names_the_file_and_pickles(tmp_path: Path) -> None:
    path = tmp_path / "acts000003.bin"
    with pytest.raises(ss.DiskFullError) as info, fileio.naming_disk_full(path, 4096, "; resume"):
        raise OSError(errno.ENOSPC, "No space left on device")
    err = info.value
    assert isinstance(err, OSError) and isinstance(err, ss.ShardsError)
    assert (err.errno, err.filename, err.needed) == (errno.ENOSPC, str(path), 4096)
    assert str(err).startswith(f"{path}: no space left on device while writing it: it needs 4,096 bytes in all, found ")
    assert str(err).endswith("free on its filesystem; resume")
    clone = pickle.loads(pickle.dumps(err))
    assert (type(clone), str(clone), clone.errno, clone.filename, clone.needed) == (
        ss.DiskFullError,
        str(err),
        err.errno,
        err.filename,
        4096,
    )
    with pytest.raises(PermissionError), fileio.naming_disk_full(path):
        raise PermissionError(errno.EACCES, "denied")  # other errors pass through untouched


def test_check_free_space_refuses_and_can_be_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    free = fileio.free_bytes(tmp_path / "not" / "yet")  # the nearest existing parent counts
    assert free is not None and free > 0
    fileio.check_free_space(tmp_path, free // 2, "a small write", "pass --force")
    with pytest.raises(
        ss.DiskFullError, match=r"a huge write needs [\d,]+ bytes, found [\d,]+ free .* pass --force or set"
    ):
        fileio.check_free_space(tmp_path, free * 4, "a huge write", "pass --force")
    monkeypatch.setenv(fileio.NO_SPACE_CHECK_ENV, "1")
    fileio.check_free_space(tmp_path, free * 4, "a huge write", "pass --force")


def test_bytes_on_disk_rounds_each_file_up_to_the_allocation_unit(tmp_path: Path) -> None:
    unit = os.statvfs(tmp_path).f_frsize
    assert fileio.bytes_on_disk([], tmp_path) == 0
    assert fileio.bytes_on_disk([0, 1, unit, unit + 1], tmp_path) == 0 + unit + unit + 2 * unit
