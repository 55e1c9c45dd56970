"""Publishing a finished folder under its final name, read-only, after checking exactly what
it holds (`publish_dir`), and undoing it for its owner (`make_writable`, `remove_path`).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path

from ..errors import WriterError
from .durable import _suppress_os_errors, fsync_dir
from .faults import fault_point

#: Modes of a published cache: files read-only for everyone, the folder read-only and listable.
READ_ONLY_FILE = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH  # 0444
READ_ONLY_DIR = 0o555


def freeze(folder: Path) -> None:
    """Make every entry of ``folder`` read-only (0444); the folder itself is left writable."""
    for entry in os.scandir(folder):
        os.chmod(entry.path, READ_ONLY_FILE, follow_symlinks=False)


def check_listing(folder: Path, expected: Mapping[str, int]) -> list[str]:
    """Problems with ``folder`` holding exactly ``expected`` (name -> size) as regular files."""
    problems = []
    found: dict[str, os.stat_result] = {}
    for entry in os.scandir(folder):
        found[entry.name] = entry.stat(follow_symlinks=False)
    for name, size in sorted(expected.items()):
        st = found.get(name)
        if st is None:
            problems.append(f"{folder / name}: missing")
        elif not stat.S_ISREG(st.st_mode):
            problems.append(f"{folder / name}: expected a regular file, found {stat.filemode(st.st_mode)}")
        elif st.st_size != size:
            problems.append(f"{folder / name}: expected {size} bytes, found {st.st_size}")
    problems.extend(f"{folder / name}: not expected here" for name in sorted(found.keys() - expected.keys()))
    return problems


def publish_dir(staging: Path, final: Path, durable: bool = True, *, expected: Mapping[str, int]) -> bool:
    """Check, freeze and rename ``staging`` to ``final``, read-only (files 0444, folder 0555).

    ``staging`` must hold exactly the regular files ``expected`` lists (name -> size), and
    nothing else; otherwise `WriterError` lists every difference and nothing is renamed.
    The rename is the last step: whatever is at ``final`` is complete and read-only.
    Returns False, renaming nothing, when ``final`` already exists (someone else published
    the same name meanwhile); the caller decides whether that is an error.
    """
    problems = check_listing(staging, expected)
    if problems:
        raise WriterError(f"{staging}: refusing to publish it as {final}:\n  " + "\n  ".join(problems[:50]))
    fault_point("publish-checked")
    freeze(staging)
    # Linux renames a read-only folder within one parent (only moving it to another
    # parent needs write permission on it, to update ".."), so it is frozen beforehand.
    os.chmod(staging, READ_ONLY_DIR)
    if durable:
        fsync_dir(staging)
    fault_point("publish-frozen")
    try:
        os.rename(staging, final)
    except OSError as err:
        if err.errno in (errno.EEXIST, errno.ENOTEMPTY):
            return False
        raise
    fault_point("published")
    if durable:
        fsync_dir(final.parent)
    return True


def make_owner_writable(folder: Path) -> None:
    """Give ``folder`` itself back its owner's write permission (to add or delete entries)."""
    mode = stat.S_IMODE(os.lstat(folder).st_mode)
    if mode & stat.S_IRWXU != stat.S_IRWXU:
        os.chmod(folder, mode | stat.S_IRWXU)


def make_writable(folder: Path) -> None:
    """Undo a published folder's read-only modes (0555 folder, 0444 files) for its owner."""
    make_owner_writable(folder)
    for entry in os.scandir(folder):
        if entry.is_file(follow_symlinks=False):
            mode = stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode)
            os.chmod(entry.path, mode | stat.S_IWUSR | stat.S_IRUSR)


def remove_path(path: Path) -> None:
    """Delete a file, a symlink or a whole folder; a missing path is not an error."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        with _suppress_os_errors(errno.ENOENT):
            path.unlink()
