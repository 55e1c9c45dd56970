"""Windows read in place: a local cache's shards mapped into one address range.

The host pipeline's windows used to be copies: every block read with ``pread`` into a
window buffer, then gathered into batches, so each byte was copied twice, and from the
page cache the first copy cost about as much CPU as the gather itself. Here every shard
file of a local cache is mapped read-only, back to back, into one reserved address range
(`CacheMap`), and the gathers take their rows straight from the page cache through it:

* **Layout.** Shard ``k`` starts at vector ``base[k]`` of one ``(vectors, D)`` array, a
  multiple of what keeps every row whole and every shard's first byte on a 2 MiB boundary
  (so that the kernel can map the page cache's large folios with huge pages). A window's
  index says where its rows are in that array (`CacheMap.source`).
* **Reads** become "make resident": per block, ``mincore`` says whether its pages are in
  the page cache; those that are not are read with ``pread`` into a small per-thread scratch
  buffer (the same requests as before, so a cold cache reads at the same rate; the gathers
  then fault the pages in), and spans found there are mapped with ``MADV_POPULATE_READ``
  (once per loader) so that the gathers do not fault.
  A shard cut short since it was opened is a `FileSizeError`, as before (one ``fstat`` per
  block). Checking a mapped block costs microseconds; mapping one again for every window
  (and unmapping it after) cost more than the copy it saves, so for a cache that fits in
  half the memory pages stay mapped while the loader lives: RSS counts them (shared, clean
  file pages the kernel may still reclaim; the loader's windows are no longer anonymous
  memory, which it could not). A larger cache's windows are unmapped once done with
  (``MADV_DONTNEED``: the page tables, not the page cache), so that mapped pages never pile
  up for the kernel to unmap before it can evict them.
* **Lifetime.** The arrays keep the mapping alive; it is unmapped when the last is gone.

A remote cache is read in place too once every block of its shards is in the block cache:
each entry is mapped at its block's place (`Files.map_pieces`), so a warm block cache is read
as a local cache is, through the page cache; until then (a block not fetched yet, or
trimmed) its windows are read into buffers, and the map is tried again the next epoch.

Linux only (``mmap`` at a fixed address through libc, ``mincore``, ``madvise``). Anywhere
else, for shards of less than
`MIN_SHARD_BYTES` on average and for the device path (which copies whole windows to the
device), windows are read into buffers as before. A shard file truncated in place between
that check and the gathers makes the process fail with SIGBUS, as any memory-mapped reader
would (`Shards.shard` included); the cache's writers never truncate a published file (its
files are read-only, and replaced only by renaming).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
import mmap
import os
import sys
import threading
from concurrent.futures import CancelledError
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import FileSizeError
from ..protocol.common import FLOAT8
from ..protocol.float8 import scales_plain
from ..reader import Shards
from .plan import ReadSpans

_PAGE = mmap.PAGESIZE
_HUGE = 2 << 20
_MAP_FIXED = 0x10  # the same on every Linux architecture
_PROT_NONE = 0
_MADV_DONTNEED = 4
_MADV_POPULATE_READ = 22  # Linux 5.14; older kernels say EINVAL and the gathers fault instead


class _Libc:
    """The few libc calls the mapping needs, typed for ctypes."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap = libc.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        self.munmap = libc.munmap
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.madvise = libc.madvise
        self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.mincore = libc.mincore
        self.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


@functools.cache
def _get_libc() -> _Libc:
    return _Libc()


class _Region:
    """An address range reserved with ``PROT_NONE``, files mapped over parts of it; unmapped
    (all of it) when garbage. Arrays over it hold it through `_Memory.owner`."""

    def __init__(self, nbytes: int) -> None:
        libc = _get_libc()
        self.libc = libc
        self.length = nbytes + _HUGE
        addr = libc.mmap(None, self.length, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), f"mmap: cannot reserve {self.length} bytes of address space")
        self.start = int(addr)
        self.base = -(-self.start // _HUGE) * _HUGE  # 2 MiB aligned

    def map_file(self, fd: int, offset: int, nbytes: int) -> None:
        """Map the first ``nbytes`` of ``fd`` read-only at ``base + offset`` (page-aligned)."""
        addr = self.base + offset
        got = self.libc.mmap(addr, nbytes, mmap.PROT_READ, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
        if got != addr:
            raise OSError(ctypes.get_errno(), "mmap: cannot map a shard file at its place")

    def __del__(self) -> None:
        if getattr(self, "start", None):
            self.libc.munmap(self.start, self.length)
            self.start = 0


def _array(region: _Region, offset: int, nbytes: int, dtype: np.dtype[Any], shape: tuple[int, ...]) -> npt.NDArray[Any]:
    """A read-only numpy array over ``nbytes`` of ``region`` at ``offset``, keeping the region alive."""

    class _Memory(ctypes.c_char * nbytes):  # type: ignore[misc]
        owner: _Region

    memory = _Memory.from_address(region.base + offset)
    memory.owner = region
    arr = np.frombuffer(memory, dtype=dtype).reshape(shape)
    arr.flags.writeable = False
    return arr


#: Shards smaller than this on average are read into buffers: a mapping costs an ``mmap`` per
#: shard and whole pages around each, which pays off only for shards of many pages.
MIN_SHARD_BYTES = 1 << 20


def available(shards: Shards) -> bool:
    """Whether ``shards`` is read in place: a local cache on Linux (or a remote one, from its
    block cache), of shards of at least `MIN_SHARD_BYTES` on average, whose mappings (one per
    file, or per block of a remote cache, and one for the gap after each file) take at most a
    quarter of the process's allowance (``vm.max_map_count``, 65,530 by default: numpy and
    torch map memory too)."""
    if not sys.platform.startswith("linux") or not shards.files.in_place or shards.n_shards == 0:
        return False
    md = shards.metadata
    files = shards.n_shards * (2 if md.dtype == FLOAT8 else 1)
    maps = 2 * files  # a local cache: each file, and the gap after it
    if not shards.files.mappable:  # a remote cache: one mapping per block
        vectors = np.array(shards.manifest.shards.counts, dtype=np.int64) * (md.n_layers * md.tokens_per_ex)
        items = (md.d_model * md.itemsize, 4) if md.dtype == FLOAT8 else (md.d_model * md.itemsize,)
        pieces = shards.files.pieces_of
        maps = sum(pieces(int(n) * item) + 1 for item in items for n in vectors.tolist() if n)
    if maps > max_map_count() // 4:
        return False
    return shards.metadata.nbytes >= MIN_SHARD_BYTES * shards.n_shards


def max_map_count() -> int:
    """How many memory mappings a process may hold (``vm.max_map_count``)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


class _NotYet(Exception):
    """A remote cache's block is not in the block cache (`Files.map_pieces` gave None)."""


def cache_map(shards: Shards, scales: bool = False) -> CacheMap | None:
    """`CacheMap` of ``shards``, or None while a remote cache is not all in its block cache."""
    try:
        return CacheMap(shards, scales)
    except _NotYet:
        return None


class CacheMap:
    """Every shard of ``shards`` (and a float8_e4m3 cache's scale files) in one address range.

    ``values`` is ``(vectors, D)`` in the stored numpy dtype: vector ``base[k] + (i * L + l) *
    T + t`` is example ``i`` of shard ``k``, layer position ``l``, token ``t``; ``scales`` is
    ``(vectors,)`` float32 by the same index (None unless float8_e4m3). Rows between shards
    are never mapped and never indexed.
    """

    def __init__(self, shards: Shards, scales: bool = False) -> None:
        md = shards.metadata
        self.shards = shards
        self.row_nbytes = md.d_model * md.itemsize
        self.vectors_per_example = md.n_layers * md.tokens_per_ex
        self.eps = md.examples_per_shard
        self.layers = md.n_layers
        self.tokens = md.tokens_per_ex
        # Shards start on vectors that put both the values and the scales on 2 MiB boundaries.
        align = _HUGE // math.gcd(_HUGE, self.row_nbytes)
        if scales:
            align = math.lcm(align, _HUGE // 4)
        counts = np.array(shards.manifest.shards.counts, dtype=np.int64)
        vectors = counts * self.vectors_per_example
        slots = -(-vectors // align) * align
        self.base = np.zeros(len(counts), dtype=np.int64)
        np.cumsum(slots[:-1], out=self.base[1:])
        total = int(slots.sum())
        #: Whether pages are unmapped again once their window is done with (`unmap_pages`): for a
        #: cache that may not stay in the page cache, so that mapped pages never pile up.
        self.bounded = int(vectors.sum()) * (self.row_nbytes + (4 if scales else 0)) > memory_bytes() // 2
        self.local = threading.local()  # each read thread's scratch buffers (`make_resident`)
        #: Examples whose pages were mapped (``MADV_POPULATE_READ``) by this map: not again.
        self.populated = np.zeros(md.n_examples, dtype=bool)
        #: The reserved ranges (values, then scales): unmapped when the last array over them is gone.
        self.regions: list[_Region] = []
        self.values = self._map(shards, total, self.row_nbytes, vectors, False, shards.numpy_dtype, (md.d_model,))
        self.scales = self._map(shards, total, 4, vectors, True, np.dtype(np.float32), ()) if scales else None

    def _map(
        self,
        shards: Shards,
        total: int,
        item: int,
        vectors: npt.NDArray[np.int64],
        scales: bool,
        dtype: np.dtype[Any],
        row: tuple[int, ...],
    ) -> npt.NDArray[Any]:
        region = _Region(max(total * item, _PAGE))
        self.regions.append(region)
        for k, n in enumerate(vectors.tolist()):
            if n == 0:
                continue
            name = shards.manifest.scales.names[k] if scales else shards.manifest.shards[k].name  # type: ignore[union-attr]
            pieces = shards.files.map_pieces(name, n * item)  # the file, or a remote one's blocks
            if pieces is None:
                raise _NotYet(name)
            try:
                for fd, offset, nbytes in pieces:
                    region.map_file(fd, int(self.base[k]) * item + offset, nbytes)
            finally:
                for fd, _, _ in pieces:
                    os.close(fd)
        return _array(region, 0, max(total, 1) * item, dtype, (max(total, 1), *row))

    def source(
        self, examples: npt.NDArray[np.int64], spans: ReadSpans
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Where a window's rows are here (`plan.RowSource`): the first vector of each of its
        ``examples``, and the offset of each slot (a layer position: every layer of an example
        is mapped, whichever ``spans`` reads)."""
        shard, local = np.divmod(examples, self.eps)
        positions = np.arange(spans.rows_per_ex, dtype=np.int64) if spans.whole else spans.read_positions
        return self.base[shard] + local * self.vectors_per_example, positions * self.tokens

    # -- residency -------------------------------------------------------------------------
    def byte_range(self, start: int, stop: int, position: int | None = None, scales: bool = False) -> tuple[int, int]:
        """``(address, length)`` of examples ``[start, stop)`` (one layer position's slice of each
        when ``position`` is given: then ``stop == start + 1``) in the values (or scales)."""
        arr = self.scales if scales else self.values
        assert arr is not None
        item = 4 if scales else self.row_nbytes
        k, local = divmod(start, self.eps)
        first = int(self.base[k]) + local * self.vectors_per_example
        count = (stop - start) * self.vectors_per_example
        if position is not None:
            first += position * self.tokens
            count = self.tokens
        return arr.ctypes.data + first * item, count * item

    def make_resident(self, start: int, stop: int, spans: ReadSpans, stop_event: threading.Event) -> None:
        """Examples ``[start, stop)`` (their slices that ``spans`` reads, and a float8_e4m3
        cache's scales) in the page cache and mapped (once per map): what is no longer there
        (the window was found in the page cache, not all of it) is read into this thread's
        scratch buffers first. `FileSizeError` if a shard was cut short since it was opened."""
        shards = self.shards
        self.check_size(start, stop)
        kinds = (False, True) if self.scales is not None else (False,)
        ranges: list[tuple[int, int, int | None]]
        if spans.whole:
            ranges = [(start, stop, None)]
        else:
            ranges = [(e, e + 1, p) for e in range(start, stop) for p in spans.read_positions.tolist()]
            # Every layer of the block in the page cache (one mincore of the block, not one per
            # slice: a block holds a dozen or more): mapped before, nothing to do; else its chosen
            # slices mapped, without asking about each.
            if all(self.resident(*self.byte_range(start, stop, scales=scales)) for scales in kinds):
                if not self.populated[start:stop].all():
                    for a, _, position in ranges:
                        for scales in kinds:
                            self.populate(*self.byte_range(a, a + 1, position, scales))
                    self.populated[start:stop] = True
                return
        shape = shards.metadata.shard_shape[1:]
        for a, b, position in ranges:
            if stop_event.is_set():
                raise CancelledError
            for scales in kinds:
                addr, nbytes = self.byte_range(a, b, position, scales)
                if self.resident(addr, nbytes):
                    if not self.populated[a]:
                        self.populate(addr, nbytes)
                    continue
                if position is None:
                    out = self._scratch((b - a, *(shape[:-1] if scales else shape)), scales)
                    (shards.read_range_scales if scales else shards.read_range_raw)(a, b, out)
                else:
                    out = self._scratch(shape[1:-1] if scales else shape[1:], scales)
                    (shards.read_example_scales if scales else shards.read_example_raw)(a, position, out)
                self.populate(addr, nbytes)
        self.populated[start:stop] = True

    def still_resident(self, starts: npt.NDArray[np.int64], stops: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
        """Which blocks ``[starts[i], stops[i])`` `make_resident` has nothing left to do for: mapped
        by this map before, their shard still holding them, every page of theirs (every layer, and
        a float8_e4m3 cache's scales) in the page cache. Neighbouring blocks of one shard are asked
        about together: one ``fstat`` and one ``mincore`` a run, where `make_resident` takes one of
        each a block and ~13 us of Python around them (3% of the OrderedLoader's CPU, whose
        windows are such runs). A run found short in any way is left to `make_resident`, block by
        block, which reads what is missing or raises the error of the first block at fault."""
        done = np.zeros(len(starts), dtype=bool)
        if not len(starts):
            return done
        shard = starts // self.eps
        breaks = np.flatnonzero((starts[1:] != stops[:-1]) | (shard[1:] != shard[:-1])) + 1
        bounds = [0, *breaks.tolist(), len(starts)]
        kinds = (False, True) if self.scales is not None else (False,)
        for i, j in itertools.pairwise(bounds):
            start, stop = int(starts[i]), int(stops[j - 1])
            if not self.populated[start:stop].all():
                continue
            try:
                self.check_size(start, stop)
            except FileSizeError:
                continue
            if all(self.resident(*self.byte_range(start, stop, scales=scales)) for scales in kinds):
                done[i:j] = True
        return done

    def check_scales(self, start: int, stop: int, spans: ReadSpans) -> None:
        """`Shards.check_scales` of the scales a window gathers from here: those of examples
        ``[start, stop)`` at the layer positions ``spans`` reads (nothing without scales)."""
        if self.scales is None:
            return
        k, local = divmod(start, self.eps)
        first = int(self.base[k]) + local * self.vectors_per_example
        n = stop - start
        found = self.scales[first : first + n * self.vectors_per_example].reshape(n, self.layers, self.tokens)
        positions = slice(None) if spans.whole else spans.read_positions
        found = found[:, positions]
        if scales_plain(found):
            return
        numbers = np.arange(start * self.vectors_per_example, stop * self.vectors_per_example, dtype=np.int64)
        self.shards.check_scales(found, lambda: numbers.reshape(n, self.layers, self.tokens)[:, positions])

    def _scratch(self, shape: tuple[int, ...], scales: bool) -> npt.NDArray[Any]:
        """This thread's buffer of ``shape`` (stored values, or float32 scales) for reads whose
        bytes only need to reach the page cache."""
        name = "scales" if scales else "values"
        arr: npt.NDArray[Any] | None = getattr(self.local, name, None)
        n = int(np.prod(shape))
        if arr is None or arr.size < n:
            arr = np.empty(n, dtype=np.float32 if scales else self.shards.numpy_dtype)
            setattr(self.local, name, arr)
        return arr[:n].reshape(shape)

    def check_size(self, start: int, stop: int) -> None:
        """`FileSizeError` unless the shard of examples ``[start, stop)`` (and its scale file)
        still holds them (an ``fstat`` each): through a mapping, bytes cut off a file's last
        page would read as zeros."""
        k, local = divmod(start, self.eps)
        vectors = (local + stop - start) * self.vectors_per_example
        files = [(self.shards.shard_fd(k), vectors * self.row_nbytes, self.shards.shard_path)]
        if self.scales is not None:
            files.append((self.shards.scale_fd(k), vectors * 4, self.shards.scale_path))
        for fd, need, path in files:
            size = self.shards.files.size_now(fd)
            if size < need:
                raise FileSizeError(
                    f"{path(k)}: expected at least {need} bytes, found {size} (file truncated after open?)"
                )

    def probably_resident(self, start: int, position: int | None = None) -> bool:
        """Whether the first page of the block starting at example ``start`` is in the page cache
        (of its slice at layer ``position`` when its slices are read one by one, and its scales'):
        one ``mincore`` of one page each, enough to choose how a window is read (`resident`
        checks it all)."""
        libc = _get_libc()
        vec = np.zeros(1, np.uint8)
        for scales in (False, True) if self.scales is not None else (False,):
            addr, _ = self.byte_range(start, start + 1, position, scales)
            lo = addr - addr % _PAGE
            if libc.mincore(lo, _PAGE, vec.ctypes.data) != 0 or not vec[0] & 1:
                return False
        return True

    def resident(self, addr: int, nbytes: int) -> bool:
        """Whether every page of ``[addr, addr + nbytes)`` is in the page cache (``mincore``; its
        first page alone first, which answers a cold range at the cost of one page)."""
        libc = _get_libc()
        lo, hi = addr - addr % _PAGE, -(-(addr + nbytes) // _PAGE) * _PAGE
        vec = np.empty((hi - lo) // _PAGE, np.uint8)
        if libc.mincore(lo, _PAGE, vec.ctypes.data) != 0 or not vec[0] & 1:
            return False
        if libc.mincore(lo, hi - lo, vec.ctypes.data) != 0:
            return False
        return bool(np.all(vec & 1))

    def populate(self, addr: int, nbytes: int) -> None:
        """Map the pages of ``[addr, addr + nbytes)`` now (no-op where the kernel cannot)."""
        lo, hi = addr - addr % _PAGE, -(-(addr + nbytes) // _PAGE) * _PAGE
        _get_libc().madvise(lo, hi - lo, _MADV_POPULATE_READ)

    def unmap_pages(self, start: int, stop: int) -> None:
        """Drop the page-table entries of examples ``[start, stop)`` (the whole pages inside their
        values and scales; the page cache keeps the data, the next access maps it again)."""
        libc = _get_libc()
        for scales in (False, True) if self.scales is not None else (False,):
            addr, nbytes = self.byte_range(start, stop, scales=scales)
            lo, hi = -(-addr // _PAGE) * _PAGE, (addr + nbytes) // _PAGE * _PAGE
            if hi > lo:
                libc.madvise(lo, hi - lo, _MADV_DONTNEED)
        self.populated[start:stop] = False


def memory_bytes() -> int:
    """The memory this process may fill: the machine's, or its cgroup's limit when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total
