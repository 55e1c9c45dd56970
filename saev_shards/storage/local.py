"""`LocalFiles`: a cache in a folder of this machine, read through descriptors, ``os.preadv``
and memory maps (the calls the reader always made); and the shared lock readers hold on
that folder while the cache is open (`FolderLock`, protocol.md 6, "Caches in use").

A data file removed under an open reader (``saev-shards rm --force``) is reported when it is
next opened, as `CacheNotFoundError` saying so (`removed_while_open`), never a bare
`FileNotFoundError`; what the reader had open still reads (POSIX keeps it until closed).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import CacheNotFoundError, InvalidCacheError, Problem
from ..fileio import IO_CHUNK, BlockHasher, hash_file, hold_folder
from ..protocol.jsonfile import load_json
from .base import Digests, Files, Piece


class FolderLock:
    """A shared ``flock`` on a cache folder, held until `release` or until the object goes away
    (`fileio.hold_folder`; ``fd`` None where it could not be taken: the filesystem does not
    lock, or another process holds the folder exclusively while it publishes or removes it)."""

    def __init__(self, path: Path) -> None:
        self.fd = hold_folder(path, shared=True)

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)  # a forked child closes its copy only: the parent's lock stays

    def __del__(self) -> None:
        # Not contextlib.suppress: it may be gone at interpreter shutdown (`Shards.__del__`).
        try:  # noqa: SIM105
            self.release()
        except Exception:  # noqa: S110
            pass


def removed_while_open(folder: Path, name: str) -> CacheNotFoundError:
    """The error for data file ``name`` of the open cache ``folder`` gone when it is first read:
    the whole cache removed under its readers (``saev-shards rm --force``), or that one file."""
    if not os.path.isdir(folder):
        return CacheNotFoundError(
            f"{folder}: the cache was removed while open (`saev-shards rm --force`, or another process), so "
            f"{name} cannot be read: open it again once it is back (stage or pull it again)"
        )
    return CacheNotFoundError(
        f"{folder / name}: missing: removed while the cache was open; the cache is damaged "
        f"(check it with `saev-shards verify {folder}`)"
    )


@contextlib.contextmanager
def naming_removal(folder: Path, name: str) -> Iterator[None]:
    """Turn `FileNotFoundError` from opening data file ``name`` into `removed_while_open`'s error."""
    try:
        yield
    except CacheNotFoundError:
        raise
    except FileNotFoundError:
        raise removed_while_open(folder, name) from None


class LocalFiles(Files):
    """A local cache's data files (module docstring)."""

    mappable = True
    in_place = True
    prefetches = False  # the kernel's readahead serves the loaders' sequential reads
    verifies_reads = False
    #: Earlier name of ``not mappable``.
    copies = False
    preadv = staticmethod(os.preadv)  # the hot path: os's own call
    close = staticmethod(os.close)

    def __init__(self, path: Path) -> None:
        self.path = path
        # One read buffer, handed to whoever streams next (list operations are atomic, so no
        # lock a fork could inherit held): a fresh IO_CHUNK buffer costs more than a small file.
        self._spare: list[memoryview] = []

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])  # type: ignore[misc]

    @property
    def streams(self) -> int:
        return 1  # one disk: files one after another, each read in large sequential pieces

    @property
    def url(self) -> None:
        return None

    @property
    def location(self) -> str:
        return str(self.path)

    def where(self, name: str) -> str:
        return str(self.path / name)

    def beside(self, name: str) -> str:
        return str(self.path.parent / name)

    @property
    def local_root(self) -> Path:
        return self.path.parent

    def footprint(self) -> int:
        """Bytes of the regular files in the folder (links are not followed: a cache holds none)."""
        with os.scandir(self.path) as entries:
            return sum(e.stat(follow_symlinks=False).st_size for e in entries if e.is_file(follow_symlinks=False))

    def share_beside(self, name: str, data: bytes) -> None:
        return None  # written in the root already: the folder's parent is it

    def lock_folder(self) -> FolderLock:
        return FolderLock(self.path)

    def open(self, name: str) -> int:
        """A descriptor of data file ``name``; `CacheNotFoundError` saying so when the cache (or
        the file) was removed while open."""
        with naming_removal(self.path, name):
            return os.open(self.path / name, os.O_RDONLY | os.O_CLOEXEC)

    def prefetch(self, fd: int, start: int, stop: int, *, scattered: bool = False) -> None:
        """Scattered reads: have the kernel start reading the range now (POSIX_FADV_WILLNEED), as
        its readahead does not foresee them and they would otherwise wait for the disk one after
        another. Plain ranges are left to the readahead."""
        if scattered and stop > start and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, start, stop - start, os.POSIX_FADV_WILLNEED)

    def close_all(self, wait: bool = True) -> None:
        self._spare.clear()

    def map_pieces(self, name: str, nbytes: int) -> list[Piece] | None:
        """The file itself, whole (`removed_while_open`'s error when it is gone)."""
        return [(self.open(name), 0, nbytes)]

    def size_now(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def map(self, name: str, dtype: np.dtype[Any], shape: tuple[int, ...]) -> npt.NDArray[Any]:
        """A read-only `np.memmap`; zeros for an empty shape (mmap cannot map 0 bytes)."""
        if int(np.prod(shape, dtype=object)) * dtype.itemsize == 0:
            return np.zeros(shape, dtype).view(np.memmap)
        with naming_removal(self.path, name):
            return np.memmap(self.path / name, dtype=dtype, mode="r", shape=shape)

    def read(self, name: str, start: int = 0, stop: int | None = None) -> bytearray:
        out = bytearray()
        for piece in self.stream(name, start, stop):
            out += piece
        return out if stop is None else out[: max(0, stop - start)]

    def open_file(self, name: str) -> io.BufferedReader:
        with naming_removal(self.path, name):
            return open(self.path / name, "rb")

    def read_json(
        self, name: str, max_bytes: int, kind: type[InvalidCacheError], *, every_number: bool = True
    ) -> tuple[Any, list[Problem]]:
        return load_json(self.path / name, max_bytes, kind, every_number=every_number)

    def stream(self, name: str, start: int = 0, stop: int | None = None) -> Iterator[memoryview]:
        """The file's bytes in `IO_CHUNK` pieces of one buffer, reused (module docstring)."""
        buffer = self._take_buffer()
        try:
            with naming_removal(self.path, name), open(self.path / name, "rb", buffering=0) as f:
                f.seek(start)
                left = None if stop is None else max(0, stop - start) + 1
                while left is None or left > 0:
                    view = buffer if left is None or left >= buffer.nbytes else buffer[:left]
                    n = f.readinto(view)
                    if not n:
                        return
                    if left is not None:
                        left -= n
                    yield view[:n]
        finally:
            self._spare[:] = [buffer]

    def verify_file(self, name: str, block_size: int | None, tick: Callable[[int], None]) -> Digests:
        path = self.path / name
        hasher = BlockHasher(block_size)
        buffer = self._take_buffer()
        try:
            size, digest = hash_file(path, tick, regular_only=True, buffer=buffer, hasher=hasher)
        except OSError as err:
            raise CacheNotFoundError(f"{path}: {err.strerror}") from None
        finally:
            self._spare[:] = [buffer]
        return size, digest, hasher.block_hexdigests()

    def _take_buffer(self) -> memoryview:
        try:
            return self._spare.pop()
        except IndexError:
            return memoryview(bytearray(IO_CHUNK))
