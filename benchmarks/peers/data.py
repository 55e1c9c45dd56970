"""What every format in the peers benchmark stores, and what every adapter provides.

`CacheSpec` is the logical float16 tensor ``(N, L, T, D)`` (examples, layers, tokens,
d_model) and how it is cut into shards; `Source` produces its values, the same for every
format, without holding the cache in memory. `Format` and `Reader` are the contract between
the workloads and the adapters (`adapters.py`): write the whole cache, open it, read one
slice, a batch of pairs, a gather. `fsync_tree`, `remove` and `files` are what every
adapter's write ends with and what the workloads warm, evict and delete.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[Any]
DTYPE = np.dtype("<f2")


# --------------------------------------------------------------------------------------
# the data


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """Shape of the benchmark cache: the logical tensor and how it is cut into shards."""

    n_examples: int
    n_layers: int
    tokens: int
    d_model: int
    examples_per_shard: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.n_examples, self.n_layers, self.tokens, self.d_model)

    @property
    def slice_nbytes(self) -> int:
        """Bytes of one ``(T, D)`` slice."""
        return self.tokens * self.d_model * DTYPE.itemsize

    @property
    def vector_nbytes(self) -> int:
        return self.d_model * DTYPE.itemsize

    @property
    def example_nbytes(self) -> int:
        return self.n_layers * self.slice_nbytes

    @property
    def nbytes(self) -> int:
        return self.n_examples * self.example_nbytes

    @property
    def n_shards(self) -> int:
        return -(-self.n_examples // self.examples_per_shard)

    def shard_range(self, k: int) -> tuple[int, int]:
        """``[start, stop)`` examples of shard ``k``."""
        start = k * self.examples_per_shard
        return start, min(self.n_examples, start + self.examples_per_shard)

    def describe(self) -> str:
        n, l_, t, d = self.shape
        return (
            f"(N, L, T, D) = ({n}, {l_}, {t}, {d}) float16, {self.nbytes / 1e9:.2f} GB, "
            f"{self.n_shards} shards of {self.examples_per_shard} examples, "
            f"slice (T, D) = {self.slice_nbytes / 2**10:.0f} KiB, vector = {self.vector_nbytes / 2**10:.0f} KiB"
        )


class Source:
    """Deterministic float16 data, identical for every format, without holding the cache in memory.

    Shard ``k``'s examples are a contiguous window of a random pool (a view, so producing
    a batch costs nothing); windows start at different, unaligned offsets, so every
    example differs from every other one.
    """

    def __init__(self, spec: CacheSpec, seed: int = 0, extra_nbytes: int = 64 << 20) -> None:
        self.spec = spec
        batch = spec.examples_per_shard * spec.example_nbytes // DTYPE.itemsize
        self._batch_elems = batch
        n_elems = batch + extra_nbytes // DTYPE.itemsize
        rng = np.random.default_rng(seed)
        pool = np.empty(n_elems, DTYPE)
        step = 1 << 24
        for i in range(0, n_elems, step):  # in pieces: bounded float32 scratch memory
            piece = rng.standard_normal(min(step, n_elems - i), dtype=np.float32)
            pool[i : i + len(piece)] = piece
        self._pool = pool
        self._room = n_elems - batch

    def _offset(self, k: int) -> int:
        return (k * 1_000_003 + 17 * k * k) % max(1, self._room)

    def shard(self, k: int) -> Array:
        """Examples of shard ``k``, ``(n_k, L, T, D)`` float16 (a read-only view)."""
        start, stop = self.spec.shard_range(k)
        count = (stop - start) * self.spec.example_nbytes // DTYPE.itemsize
        off = self._offset(k)
        view = self._pool[off : off + count].reshape(stop - start, *self.spec.shape[1:])
        view.flags.writeable = False
        return view

    def batches(self) -> Iterator[tuple[int, Array]]:
        """``(first_example, batch)`` for every shard in order."""
        for k in range(self.spec.n_shards):
            yield self.spec.shard_range(k)[0], self.shard(k)

    def slabs(self, min_nbytes: int = 64 << 20) -> Iterator[tuple[int, Array]]:
        """Whole shards grouped into slabs of at least ``min_nbytes`` (views when a shard is that big):
        fewer, larger writes for single-store formats when shards are tiny."""
        group: list[Array] = []
        first = 0
        for start, batch in self.batches():
            if not group:
                first = start
            group.append(batch)
            if sum(b.nbytes for b in group) >= min_nbytes:
                yield first, group[0] if len(group) == 1 else np.concatenate(group)
                group = []
        if group:
            yield first, group[0] if len(group) == 1 else np.concatenate(group)

    def example(self, ex: int) -> Array:
        """``(L, T, D)`` values of example ``ex``."""
        k, local = divmod(ex, self.spec.examples_per_shard)
        return np.asarray(self.shard(k)[local])


# --------------------------------------------------------------------------------------
# the adapters' contract


class Reader(Protocol):
    def read(self, ex: int, layer: int, out: Array) -> Array: ...

    def read_pairs(self, ex: Array, layers: Array, out: Array) -> Array: ...

    def gather(self, ex: Array, layer: Array, tok: Array, out: Array) -> Array: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class Format:
    """A cache format: how it writes the whole cache and opens it for reading.

    ``write(root, spec, source, durable)`` creates the store under the empty folder ``root``
    and returns its path; with ``durable`` every file and folder is fsynced before it returns.
    """

    key: str
    name: str
    note: str
    write: Callable[[Path, CacheSpec, Source, bool], Path]
    open: Callable[[Path, CacheSpec], Reader]
    #: Rows that read the same files another way share the files (written once).
    files_of: str | None = None


# --------------------------------------------------------------------------------------
# files


def fsync_tree(path: Path, durable: bool = True) -> None:
    """fsync every file under ``path`` and every folder: what a durable write ends with."""
    if not durable:
        return
    items = [path] if path.is_file() else [*sorted(path.rglob("*")), path]
    for p in items:
        fd = os.open(p, os.O_RDONLY | (os.O_DIRECTORY if p.is_dir() else 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """Delete a file or folder, including our read-only published caches."""
    if not path.exists() and not path.is_symlink():
        return
    if path.is_file() or path.is_symlink():
        path.unlink()
        return
    for p in [path, *path.rglob("*")]:
        if p.is_dir():
            os.chmod(p, stat.S_IRWXU)
    shutil.rmtree(path)


def files(path: Path) -> list[Path]:
    """Every regular file of a store (for dropping or warming the page cache)."""
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
