"""Streaming copies and digests in large sequential chunks: `stream` (copy and hash at once),
`BlockHasher` (xxh3_128 of the whole and of every block), `hash_file`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import xxhash

from .regular import open_regular

#: Bytes per read when hashing or copying files: large sequential I/O.
IO_CHUNK = 8 << 20


class _Hasher(Protocol):
    def update(self, data: Any, /) -> None: ...


def stream(
    src: Any,
    sink: Any | None = None,
    hasher: _Hasher | None = None,
    progress: Callable[[int], None] | None = None,
    buffer: memoryview | None = None,
) -> int:
    """Read the open binary file ``src`` from its position to its end in `IO_CHUNK` pieces.

    Every piece updates ``hasher`` (if given) and is written whole to ``sink`` (an open
    binary file, if given); ``progress`` is called with each piece's length. Returns the
    number of bytes read. Pass ``buffer`` to reuse one across calls.
    """
    view = buffer if buffer is not None else memoryview(bytearray(IO_CHUNK))
    total = 0
    while True:
        n = src.readinto(view)
        if not n:
            return total
        chunk = view[:n]
        if hasher is not None:
            hasher.update(chunk)
        if sink is not None:
            write_all(sink, chunk)
        total += n
        if progress is not None:
            progress(n)


class BlockHasher:
    """xxh3_128 of a stream of bytes, of the whole and (with a ``block_size``) of every
    ``block_size`` bytes from its start: a hasher for `stream` and the writer's files, so
    the digests of the blocks cost no second read."""

    def __init__(self, block_size: int | None = None) -> None:
        self.whole = xxhash.xxh3_128()
        self.block_size = block_size
        self._blocks: list[str] = []
        self._block = xxhash.xxh3_128()
        self._fill = 0  # bytes of the current block hashed so far

    def update(self, data: Any) -> None:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        self.whole.update(view)
        size = self.block_size
        if size is None:
            return
        while view.nbytes:
            n = min(size - self._fill, view.nbytes)
            self._block.update(view[:n])
            self._fill += n
            view = view[n:]
            if self._fill == size:
                self._blocks.append(self._block.hexdigest())
                self._block = xxhash.xxh3_128()
                self._fill = 0

    def hexdigest(self) -> str:
        """Digest of every byte so far."""
        return self.whole.hexdigest()

    def block_hexdigests(self) -> list[str]:
        """Digest of each block so far, the last one as far as it goes ([] before any byte)."""
        return self._blocks + ([self._block.hexdigest()] if self._fill else [])


def hash_file(
    path: Path,
    progress: Callable[[int], None] | None = None,
    *,
    regular_only: bool = False,
    buffer: memoryview | None = None,
    hasher: BlockHasher | None = None,
) -> tuple[int, str]:
    """``(nbytes, xxh3_128 hex)`` of a file, read in large sequential chunks.

    ``regular_only``: open it with `open_regular` (`NotRegularFileError` for a link, a FIFO...).
    ``buffer``: reuse one across files (a fresh `IO_CHUNK` buffer costs more than hashing a small file).
    ``hasher``: a fresh `BlockHasher` to hash with, for the digests of the file's blocks too.
    """
    h = BlockHasher() if hasher is None else hasher
    with open_regular(path) if regular_only else open(path, "rb", buffering=0) as f:
        total = stream(f, hasher=h, progress=progress, buffer=buffer)
    return total, h.hexdigest()


def write_all(f: Any, view: memoryview) -> None:
    """Write all of ``view`` to the open binary file ``f`` (unbuffered writes may be short)."""
    while view.nbytes:
        n = f.write(view)
        view = view[n:]
