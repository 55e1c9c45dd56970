"""storage.folders: folders opened through descriptors and never through a link (a link or a file
at a folder's name removed, never what it leads to), lock files taken without waiting, the
block cache folder's privacy check, and the folder in memory."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from saev_shards.errors import BlockCacheError
from saev_shards.storage import folders
from saev_shards.storage.folders import PRIVATE_MODES, SHARED_MODES, check_folder, lock_file, subdir


@pytest.fixture
def parent(tmp_path: Path) -> Iterator[int]:
    (tmp_path / "top").mkdir()
    fd = os.open(tmp_path / "top", os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield fd
    finally:
        os.close(fd)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_missing_folder_is_made_with_its_mode_or_reported(tmp_path: Path, parent: int) -> None:
    assert subdir(parent, "sub", None) is None and not (tmp_path / "top" / "sub").exists()
    fd = subdir(parent, "sub", 0o700)
    assert fd is not None
    os.close(fd)
    assert mode_of(tmp_path / "top" / "sub") == 0o700
    again = subdir(parent, "sub", None)  # there now: opened, not made
    assert again is not None
    os.close(again)


@pytest.mark.parametrize("kind", ["link to a folder", "link to nothing", "file", "fifo"])
def test_anything_but_a_folder_at_the_name_is_removed_never_what_a_link_leads_to(
    tmp_path: Path, parent: int, kind: str
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"mine")
    name = tmp_path / "top" / "sub"
    if kind == "link to a folder":
        name.symlink_to(outside)
    elif kind == "link to nothing":
        name.symlink_to(tmp_path / "nowhere")
    elif kind == "file":
        name.write_bytes(b"x")
    else:
        os.mkfifo(name)
    assert subdir(parent, "sub", None) is None  # without a mode: reported, left alone
    assert os.path.lexists(name)
    fd = subdir(parent, "sub", 0o700)
    assert fd is not None
    os.close(fd)
    assert stat.S_ISDIR(os.lstat(name).st_mode) and os.listdir(name) == []
    assert (outside / "keep").read_bytes() == b"mine" and not (tmp_path / "nowhere").exists()


def test_a_lock_file_is_taken_once_and_never_through_a_link(tmp_path: Path, parent: int) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    (tmp_path / "top" / "lock").symlink_to(target)
    fd = lock_file(parent, "lock", 0o600)
    assert fd is not None
    try:
        assert stat.S_ISREG(os.lstat(tmp_path / "top" / "lock").st_mode) and target.read_bytes() == b"keep"
        assert lock_file(parent, "lock", 0o600) is None  # held (flock is per open file)
    finally:
        os.close(fd)
    fd = lock_file(parent, "lock", 0o600)  # free again
    assert fd is not None
    os.close(fd)


def test_a_folder_and_what_it_holds_is_removed_by_name(tmp_path: Path, parent: int) -> None:
    (tmp_path / "top" / "d" / "e").mkdir(parents=True)
    (tmp_path / "top" / "d" / "e" / "f").write_bytes(b"x")
    before = os.stat("d", dir_fd=parent, follow_symlinks=False)
    (tmp_path / "top" / "d").rename(tmp_path / "top" / "old")
    (tmp_path / "top" / "d").mkdir()
    folders.remove_name(parent, "d", before)  # replaced since: left alone
    assert (tmp_path / "top" / "d").is_dir()
    folders.remove_name(parent, "old", None)
    assert sorted(folders.names(parent)) == ["d"]


def test_the_block_cache_folder_is_made_private_or_checked(tmp_path: Path) -> None:
    made = tmp_path / "a" / "cache"
    assert check_folder(made, "ENV") == PRIVATE_MODES and mode_of(made) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    assert check_folder(loose, "ENV") == PRIVATE_MODES and mode_of(loose) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o2770)
    assert check_folder(shared, "ENV") == SHARED_MODES and mode_of(shared) == 0o2770


def test_a_folder_that_is_no_private_one_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(BlockCacheError, match="expected a folder for the block cache, found a regular file"):
        check_folder(tmp_path / "file", "ENV")
    with pytest.raises(BlockCacheError, match="cannot make the block cache's folder here"):
        check_folder(tmp_path / "file" / "below", "ENV")
    everyone = tmp_path / "everyone"
    everyone.mkdir()
    everyone.chmod(0o2777)
    with pytest.raises(BlockCacheError, match=r"open to every user too \(mode 2777\): chmod o-rwx"):
        check_folder(everyone, "ENV")
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        with pytest.raises(BlockCacheError, match=r"belongs to user .*65534.*not to you.*set ENV"):
            check_folder(theirs, "ENV")


def test_new_files_hold_their_bytes(tmp_path: Path) -> None:
    for n in (0, 5, 4096, 3 * 4096 + 17):
        data = bytes(i % 251 for i in range(n))
        path = tmp_path / f"f{n}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            folders.write_new_file(fd, memoryview(data))
        finally:
            os.close(fd)
        assert path.read_bytes() == data


def test_the_memory_folder_is_private_and_the_same_for_the_process() -> None:
    folder = folders.memory_folder()
    assert folder.is_dir() and mode_of(folder) == 0o700
    assert folder.name.startswith(f"saev-shards-{os.getpid()}-")
    assert folders.memory_folder() == folder
