"""fileio: locks whose holder may delete them, the publish re-check, disk-full errors."""

from __future__ import annotations

import errno
import os
import pickle
from pathlib import Path

import pytest

import saev_shards as ss
from saev_shards import fileio


def test_take_lock_excludes_and_shares(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    a = fileio.take_lock(path)
    assert a is not None
    assert fileio.take_lock(path) is None
    assert fileio.take_lock(path, shared=True) is None
    os.close(a)
    b, c = fileio.take_lock(path, shared=True), fileio.take_lock(path, shared=True)
    assert b is not None and c is not None
    assert fileio.take_lock(path) is None
    os.close(b)
    os.close(c)


def test_a_lock_deleted_by_its_holder_is_never_held_twice(tmp_path: Path) -> None:
    """B opened the lock file before A deleted it (A held it exclusively): once A lets go,
    the lock B gets is on the file at the path now, the same one C locks."""
    path = tmp_path / "x.lock"
    a = fileio.take_lock(path)
    assert a is not None
    stale = os.open(path, os.O_RDWR)  # what B opened before A deleted the file
    path.unlink()
    os.close(a)
    assert fileio.try_flock(stale)  # a plain flock of the deleted file succeeds...
    b = fileio.take_lock(path)  # ...take_lock locks the file at the path instead
    assert b is not None
    assert os.fstat(b).st_ino == path.stat().st_ino != os.fstat(stale).st_ino
    assert fileio.take_lock(path) is None  # C is excluded
    os.close(stale)
    os.close(b)


def test_take_lock_on_a_folder_follows_a_replacement(tmp_path: Path) -> None:
    folder = tmp_path / "partial"
    fd = fileio.take_lock(folder, directory=True)
    assert fd is not None and folder.is_dir()
    assert fileio.take_lock(folder, directory=True) is None
    os.rename(folder, tmp_path / "published")  # the holder publishes it and lets go
    os.close(fd)
    again = fileio.take_lock(folder, directory=True)  # a new folder at the name, not the renamed one
    assert again is not None and os.fstat(again).st_ino == folder.stat().st_ino
    os.close(again)


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


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 3 * 4096 + 17])
@pytest.mark.parametrize("offset", [0, 4096, 100])
@pytest.mark.parametrize("aligned", [True, False])
def test_pwrite_direct_writes_exactly_the_bytes(tmp_path: Path, nbytes: int, offset: int, aligned: bool) -> None:
    """Whole blocks through O_DIRECT where it applies (page-aligned memory, aligned offset), the
    rest buffered, a refused request (unaligned memory: EINVAL) all buffered: the file holds
    exactly the bytes either way."""
    data = bytes((i * 31 + 7) % 251 for i in range(nbytes))
    buffer = fileio.aligned_buffer(nbytes + 1)
    start = 0 if aligned else 1
    buffer[start : start + nbytes] = data
    view = memoryview(buffer)[start : start + nbytes]
    path = tmp_path / "f"
    path.write_bytes(b"\xff" * (offset + nbytes + 10))
    fd = os.open(path, os.O_RDWR)
    direct = fileio.open_direct(path)
    try:
        went_direct = fileio.pwrite_direct(direct, fd, view, offset)
    finally:
        for f in (fd, direct):
            if f is not None:
                os.close(f)
    del view
    assert path.read_bytes() == b"\xff" * offset + data + b"\xff" * 10
    if went_direct:
        assert aligned and offset % fileio.DIRECT_ALIGN == 0 and nbytes >= fileio.DIRECT_ALIGN
