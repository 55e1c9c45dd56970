"""The machine's limits, measured in the same run as the figures compared with them.

Every speed figure the benchmarks print is a ratio against a limit measured here, in the
same run (memcpy, O_DIRECT sequential and random disk I/O, buffered and random preads,
the random-row gather, host-to-device copies), because absolute numbers on a shared
virtual machine drift by 2x from minute to minute. Limits and measurements are interleaved
(`interleaved`) and summarised by their medians. The suites set up what a limit runs on (a
cache's own files, a loader's own rows); how it is measured lives here and nowhere else.
Where the figures go (`Table`, the folders, the machine's description) is `tables.py`.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: Large O_DIRECT requests: the disk's best sequential rate, not Python's per-call cost.
DIRECT_BLOCK = 8 << 20
ALIGN = 4096  # O_DIRECT needs offsets, lengths and buffers aligned to the logical block size


# --------------------------------------------------------------------------------------
# the machine's limits


def memcpy_gbps(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Large-buffer memcpy bandwidth (GB/s, bytes copied / second): numpy copyto, best of ``repeats``."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def memcpy_chunks_gbps(
    chunk: int, total: int = 512 << 20, pool: int = 1 << 30, seed: int = 0, dst_nbytes: int | None = None
) -> float:
    """memcpy of ``chunk``-byte pieces from random offsets of a ``pool``-byte buffer into one
    destination: the best any reader of ``chunk``-sized slices from page-cached memory can do.

    By default every piece lands in the same ``chunk``-byte buffer (hot in the CPU cache, as
    when a reader reuses one output buffer); ``dst_nbytes`` cycles the pieces through a
    destination that big instead (a batch being assembled in memory).
    """
    src = np.ones(pool, np.uint8)
    pieces = max(1, (dst_nbytes or chunk) // chunk)
    dst = np.ones((pieces, chunk), np.uint8)  # ones, not empty: its pages are touched before timing
    n = max(1, total // chunk)
    rng = np.random.default_rng(seed)
    offsets = rng.integers(0, (pool - chunk) // 64, n) * 64
    t = time.perf_counter()
    for i, o in enumerate(offsets.tolist()):
        np.copyto(dst[i % pieces], src[o : o + chunk])
    return n * chunk / (time.perf_counter() - t) / 1e9


def _aligned(nbytes: int) -> mmap.mmap:
    buf = mmap.mmap(-1, nbytes)  # page-aligned anonymous memory
    buf.write(os.urandom(min(nbytes, 1 << 20)) * (nbytes // min(nbytes, 1 << 20)))
    return buf


def odirect_write_gbps(path: Path, nbytes: int, block: int = DIRECT_BLOCK) -> float:
    """Sequential O_DIRECT write of ``nbytes`` (plus fsync): the disk's write limit, GB/s."""
    nbytes -= nbytes % block
    buf = _aligned(block)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        t = time.perf_counter()
        for off in range(0, nbytes, block):
            os.pwrite(fd, buf, off)
        os.fsync(fd)
        return nbytes / (time.perf_counter() - t) / 1e9
    finally:
        os.close(fd)


def odirect_read_gbps(path: Path, block: int = DIRECT_BLOCK, limit: int | None = None) -> float:
    """Sequential O_DIRECT read of a file: the disk's read limit, GB/s (page cache bypassed)."""
    size = os.stat(path).st_size
    size -= size % block
    if limit is not None:
        size = min(size, limit - limit % block)
    buf = _aligned(block)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        t = time.perf_counter()
        for off in range(0, size, block):
            os.preadv(fd, [buf], off)
        return size / (time.perf_counter() - t) / 1e9
    finally:
        os.close(fd)


def odirect_files_gbps(paths: Sequence[Path], limit: int | None = None) -> float:
    """Sequential O_DIRECT reads of ``paths`` in turn (a cache's shard files), up to ``limit``
    bytes in all: the disk's sequential rate for these very bytes, GB/s. Files shorter than one
    request are skipped."""
    done, elapsed = 0, 0.0
    for path in paths:
        left = None if limit is None else limit - done
        if left is not None and left < DIRECT_BLOCK:
            break
        size = os.stat(path).st_size if left is None else min(os.stat(path).st_size, left)
        if size < DIRECT_BLOCK:
            continue
        gbps = odirect_read_gbps(path, limit=size)
        read = size - size % DIRECT_BLOCK
        elapsed += read / gbps / 1e9
        done += read
    return done / max(elapsed, 1e-9) / 1e9


def odirect_spread_read_gbps(files: Sequence[Path], seed: int, picks: int = 6, nbytes: int = 64 << 20) -> float:
    """Sequential O_DIRECT reads of ``nbytes`` from each of ``picks`` files spread over a cache:
    the disk's sequential rate over the same stretch of disk as a full pass, without one."""
    rng = np.random.default_rng(seed)
    chosen = rng.choice(len(files), min(picks, len(files)), replace=False)
    seconds = 0.0
    total = 0
    for i in chosen.tolist():
        size = os.stat(files[i]).st_size
        n = min(nbytes, size - size % DIRECT_BLOCK)
        if n:
            seconds += n / (odirect_read_gbps(files[i], limit=nbytes) * 1e9)
            total += n
    return total / seconds / 1e9 if seconds else float("nan")


def odirect_random_read(path: Path, block: int, n: int, threads: int = 1, seed: int = 0) -> tuple[float, float]:
    """``n`` random aligned O_DIRECT reads of ``block`` bytes from one file: ``(GB/s, reads/s)``."""
    return odirect_random_read_files([path], block, n, threads, seed)


def odirect_random_read_files(
    paths: Sequence[Path], block: int, n: int, threads: int = 1, seed: int = 0
) -> tuple[float, float]:
    """``n`` random aligned O_DIRECT reads of ``block`` bytes spread over several files (say a
    cache's shards, so the limit covers the same stretch of disk as the reads it is compared
    with, not a small file a host-side cache may hold): ``(GB/s, reads/s)``."""
    sizes = [os.stat(p).st_size for p in paths]
    usable = [(p, s) for p, s in zip(paths, sizes, strict=True) if s >= block]
    if not usable:
        raise ValueError(f"no file of at least {block} bytes among {len(paths)}")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(usable), n)
    fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p, _ in usable]
    jobs = [(fds[i], int(rng.integers(0, (usable[i][1] - block) // ALIGN + 1)) * ALIGN) for i in picks.tolist()]

    def work(part: list[tuple[int, int]]) -> None:
        buf = _aligned(block)
        for fd, off in part:
            os.preadv(fd, [buf], off)

    try:
        t = time.perf_counter()
        pool = [threading.Thread(target=work, args=(jobs[i::threads],)) for i in range(threads)]
        for th in pool:
            th.start()
        for th in pool:
            th.join()
        dt = time.perf_counter() - t
    finally:
        for fd in fds:
            os.close(fd)
    return n * block / dt / 1e9, n / dt


def in_threads(threads: int, work: Callable[[int], None]) -> float:
    """Seconds for ``threads`` threads to each run ``work(i)``, started together (GIL released inside)."""
    return in_threads_cpu(threads, work)[0]


def in_threads_cpu(threads: int, work: Callable[[int], None]) -> tuple[float, float]:
    """``(seconds, process CPU seconds)`` for ``threads`` threads to each run ``work(i)``, started
    together: the CPU time over the same stretch as the wall time, nothing of the set-up before."""
    barrier = threading.Barrier(threads + 1)

    def run(i: int) -> None:
        barrier.wait()
        work(i)

    pool = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for th in pool:
        th.start()
    barrier.wait()
    t, cpu = time.perf_counter(), time.process_time()
    for th in pool:
        th.join()
    return time.perf_counter() - t, time.process_time() - cpu


def buffered_read_gbps(paths: Sequence[Path], threads: int, block: int = 4 << 20, limit: int | None = None) -> float:
    """Buffered ``pread`` of ``paths`` in file order, ``block`` bytes per call, ``threads`` threads
    taking the next block in turn (as the loaders' read threads do) into buffers of their own.

    From the page cache, the cost of the loaders' first copy; after `drop_cache`, what this
    disk gives a buffered reader with the kernel's readahead (often more than one O_DIRECT
    request at a time: the cold loaders' own limit).
    """
    jobs: list[tuple[int, int, int]] = []
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    budget = limit if limit is not None else float("inf")
    for fd, p in zip(fds, paths, strict=True):
        size = os.stat(p).st_size
        for off in range(0, size, block):
            n = min(block, size - off)
            if budget < n:
                break
            jobs.append((fd, off, n))
            budget -= n
    order = iter(range(len(jobs)))
    lock = threading.Lock()
    buffers = [np.ones(block, np.uint8) for _ in range(threads)]  # touched before timing

    def work(i: int) -> None:
        view = buffers[i].data
        while True:
            with lock:
                j = next(order, None)
            if j is None:
                return
            fd, off, n = jobs[j]
            os.preadv(fd, [view[:n]], off)

    try:
        dt = in_threads(threads, work)
    finally:
        for fd in fds:
            os.close(fd)
    return sum(n for _, _, n in jobs) / dt / 1e9


def gather_gbps(
    source: np.ndarray[Any, Any],
    batches: Sequence[np.ndarray[Any, Any]],
    outs: Sequence[np.ndarray[Any, Any]],
    threads: int = 1,
    lib: str = "numpy",
    min_bytes: int = 512 << 20,
    scales: tuple[np.ndarray[Any, Any], Sequence[np.ndarray[Any, Any]]] | None = None,
) -> float:
    """Rows ``source[idx]`` for each index array of ``batches`` into ``outs`` (cycled), in GB/s
    of rows delivered: the random-row gather alone, what the shuffled loaders' gathers do.

    ``lib="numpy"``: ``numpy.take(..., out=, mode="clip")`` (what the loaders call), the batches
    dealt to ``threads`` threads. ``lib="torch"``: ``torch.index_select(..., out=)`` from one
    thread with ``threads`` intra-op threads. The batches are repeated up to ``min_bytes``.
    ``scales``: a float8_e4m3 cache's ``(scale per source row, outputs)``, gathered by the same
    index (numpy only) and counted in the bytes delivered.
    """
    row = source.shape[1] * source.itemsize + (4 if scales is not None else 0)
    per_pass = sum(len(b) for b in batches) * row
    passes = max(1, -(-min_bytes // max(1, per_pass)))
    work_list = [(b, i % len(outs)) for i, b in enumerate(list(batches) * passes)]
    if lib == "torch":
        import torch

        src_t = torch.from_numpy(source)
        idx_t = [torch.from_numpy(b) for b in batches]
        outs_t = [torch.from_numpy(o) for o in outs]
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            t = time.perf_counter()
            for j, (_, o) in enumerate(work_list):
                idx = idx_t[j % len(batches)]
                torch.index_select(src_t, 0, idx, out=outs_t[o][: len(idx)])
            dt = time.perf_counter() - t
        finally:
            torch.set_num_threads(before)
    else:

        def work(i: int) -> None:
            for b, o in work_list[i::threads]:
                np.take(source, b, axis=0, out=outs[o][: len(b)], mode="clip")
                if scales is not None:
                    np.take(scales[0], b, out=scales[1][o][: len(b)], mode="clip")

        dt = in_threads(threads, work)
    return float(passes * per_pass / dt / 1e9)


def memcpy_threads_gbps(threads: int, nbytes: int = 256 << 20) -> float:
    """``threads`` threads each copying their own ``nbytes`` buffer (numpy releases the GIL):
    the memory bandwidth of several cores, GB/s of bytes copied."""
    pairs = [(np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)) for _ in range(threads)]
    for src, dst in pairs:
        np.copyto(dst, src)

    def work(i: int) -> None:
        src, dst = pairs[i]
        for _ in range(3):
            np.copyto(dst, src)

    return 3 * threads * nbytes / in_threads(threads, work) / 1e9


def _host_buffer(nbytes: int, pinned: bool) -> np.ndarray[Any, Any]:
    import torch

    if pinned:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
    return np.ones(nbytes, np.uint8)  # touched, as a loader's reused buffers are


def _random_preads(paths: Sequence[Path], block: int, n: int, seed: int = 0) -> tuple[list[int], list[tuple[int, int]]]:
    """``n`` random ``(fd, offset)`` reads of ``block`` bytes over ``paths`` (fds to close)."""
    sizes = [os.stat(p).st_size for p in paths]
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(paths), n)
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    return fds, [(fds[k], int(rng.integers(0, max(1, sizes[k] - block)))) for k in picks.tolist()]


def pread_threads_gbps(paths: Sequence[Path], threads: int, total: int, pinned: bool, block: int = 4 << 20) -> float:
    """Random ``block``-byte preads of page-cached ``paths``, ``total`` bytes in all, into one
    buffer per thread (page-locked when ``pinned``: needs torch): what a loader's read threads
    can do at best, GB/s."""
    fds, jobs = _random_preads(paths, block, max(threads, total // block))
    buffers = [_host_buffer(block, pinned) for _ in range(threads)]

    def work(i: int) -> None:
        view = buffers[i].data
        for fd, off in jobs[i::threads]:
            os.preadv(fd, [view], off)

    try:
        return len(jobs) * block / in_threads(threads, work) / 1e9
    finally:
        for fd in fds:
            os.close(fd)


def read_upload_gbps(paths: Sequence[Path], threads: int, total: int, block: int = 4 << 20) -> float:
    """Random ``block``-byte preads into pinned memory, each block then copied to the GPU on the
    thread's own stream (two pinned buffers per thread, one filling while the other uploads):
    the device-side shuffle's work without anything else, GB/s. Needs CUDA."""
    import torch

    fds, jobs = _random_preads(paths, block, max(threads, total // block), seed=1)
    pinned = [[torch.empty(block, dtype=torch.uint8, pin_memory=True) for _ in range(2)] for _ in range(threads)]
    dev = torch.empty((threads, 2, block), dtype=torch.uint8, device="cuda")
    streams = [torch.cuda.Stream() for _ in range(threads)]

    def work(i: int) -> None:
        events: list[Any] = [None, None]
        with torch.cuda.stream(streams[i]):
            for j, (fd, off) in enumerate(jobs[i::threads]):
                k = j % 2
                if events[k] is not None:
                    events[k].synchronize()
                os.preadv(fd, [pinned[i][k].numpy().data], off)
                dev[i, k].copy_(pinned[i][k], non_blocking=True)
                events[k] = torch.cuda.Event()
                events[k].record()
            streams[i].synchronize()

    try:
        return len(jobs) * block / in_threads(threads, work) / 1e9
    finally:
        for fd in fds:
            os.close(fd)


def copy_gbps(kind: str, nbytes: int = 512 << 20, repeats: int = 8) -> float:
    """GPU copies of ``nbytes``, ``repeats`` times after one untimed: ``h2d`` (host to device,
    from pinned memory: the limit of every batch a loader moves to the GPU), ``h2d_pageable``,
    ``d2h`` (to pinned memory) or ``d2d`` (counting bytes read + written), GB/s. Needs CUDA."""
    import torch

    pinned = kind != "h2d_pageable"
    host = torch.ones(nbytes, dtype=torch.uint8).pin_memory() if pinned else torch.ones(nbytes, dtype=torch.uint8)
    dev = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty_like(dev)
    src, dst = {"h2d": (host, dev), "h2d_pageable": (host, dev), "d2h": (dev, host), "d2d": (dev, dev2)}[kind]
    dst.copy_(src, non_blocking=pinned)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src, non_blocking=pinned)
    torch.cuda.synchronize()
    moved = repeats * nbytes * (2 if kind == "d2d" else 1)
    return moved / (time.perf_counter() - start) / 1e9


def fill_file(path: Path, nbytes: int) -> None:
    """Write ``nbytes`` of incompressible data (sequentially, then fsync)."""
    block = DIRECT_BLOCK
    chunk = os.urandom(1 << 20) * (block >> 20)
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left:
            n = f.write(chunk[: min(left, block)])
            left -= n
        os.fsync(f.fileno())


def drop_cache(paths: Path | Sequence[Path]) -> None:
    """Evict files from the page cache (POSIX_FADV_DONTNEED on clean pages), recursively for folders."""
    items = [paths] if isinstance(paths, Path) else list(paths)
    for p in items:
        files = [p] if p.is_file() else [q for q in p.rglob("*") if q.is_file()]
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fdatasync(fd) if os.access(f, os.W_OK) else None
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_read_bytes() -> int:
    """Bytes this process has caused to be fetched from storage (``read_bytes`` of /proc/self/io),
    readahead included; -1 where the kernel does not say. Differences measure read amplification."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def readahead_nbytes(path: Path) -> int:
    """The block device's readahead window for files at ``path`` (read_ahead_kb), else Linux's 128 KiB default.

    Buffered reads, and page faults on memmaps, fetch up to this much around what was asked.
    """
    st = os.stat(path)
    dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}").resolve()
    for queue in (dev / "queue", dev.parent / "queue"):  # a partition's queue is its disk's
        with contextlib.suppress(OSError, ValueError):
            return int((queue / "read_ahead_kb").read_text()) * 1024
    return 128 * 1024


def warm_cache(paths: Path | Sequence[Path]) -> None:
    """Read files once so they sit in the page cache."""
    items = [paths] if isinstance(paths, Path) else list(paths)
    buf = bytearray(DIRECT_BLOCK)
    for p in items:
        files = [p] if p.is_file() else [q for q in p.rglob("*") if q.is_file()]
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass


def settle_memory() -> str:
    """Give the caches written next the page cache of a machine with memory to spare: the
    clean page cache (what earlier suites left) dropped and free memory compacted, so that
    the kernel finds 2 MiB blocks for large folios (a page cache crowded by earlier suites
    leaves few, and a cache written then is held in small folios: docs/loaders.md, "Large
    folios"). Needs root; elsewhere nothing is done. Returns what was done, for a note."""
    os.sync()
    done = []
    for knob, what in (("drop_caches", "dropped the clean page cache"), ("compact_memory", "compacted free memory")):
        try:
            Path("/proc/sys/vm", knob).write_text("1")  # drop_caches 1: the page cache only
            done.append(what)
        except OSError:
            pass
    return " and ".join(done)


def mapped_huge(path: Path) -> tuple[int, int]:
    """Bytes of a cache's shard files that a mapping of each maps with huge pages once its
    pages are mapped (the page cache's large folios: docs/loaders.md, "Large folios"), and
    the files' bytes. Call it with the files in the page cache: it maps what is there
    (``MADV_POPULATE_READ``) and unmaps it; ``(0, total)`` where the kernel cannot say."""
    huge = total = 0
    for f in sorted(path.glob("acts*.bin")):
        size = f.stat().st_size
        total += size
        if size == 0:
            continue
        with open(f, "rb") as fh:
            m = mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ)
        try:
            with contextlib.suppress(OSError, AttributeError):
                m.madvise(22)  # MADV_POPULATE_READ (Linux 5.14)
            start = np.frombuffer(m, dtype=np.uint8).ctypes.data
            huge += _smaps_kib(start, "FilePmdMapped") << 10
        finally:
            m.close()
    return huge, total


def _smaps_kib(start: int, field: str) -> int:
    """``field`` (kB) of this process's mapping that starts at address ``start``; 0 if none says."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return 0
    lines = text.splitlines()
    for i, line in enumerate(lines):
        head = line.split(" ", 1)[0]
        if "-" in head and int(head.split("-")[0], 16) == start:
            for entry in lines[i + 1 :]:
                name = entry.split(":", 1)[0]
                if name == field:
                    return int(entry.split()[1])
                if "-" in entry.split(" ", 1)[0] and ":" not in name:
                    break
            return 0
    return 0


def mapped_huge_note(paths: Sequence[Path]) -> str:
    """One sentence: how much of the caches the page cache holds in folios mapped huge."""
    huge = total = 0
    for p in paths:
        h, t = mapped_huge(p)
        huge, total = huge + h, total + t
    settled = f" (before they were written the suite {SETTLED[0]})" if SETTLED else ""
    return (
        f"Of the caches' {total / 1e9:.2f} GB, {huge / 1e9:.2f} GB were mapped with huge pages when the tables "
        f"started{settled}: the page cache's large folios; gathers read in place pay TLB misses on the rest "
        "(docs/loaders.md, 'Large folios')."
    )


#: What `settle_memory` did before a suite wrote its caches (empty: nothing), for the notes.
SETTLED: list[str] = []


# --------------------------------------------------------------------------------------
# measuring


def interleaved(fns: dict[str, Callable[[], float]], rounds: int = 3) -> dict[str, float]:
    """Run each rate function once per round, in turn, and return the median rate of each.

    Interleaving spreads the machine's drift over every contender instead of favouring
    whichever ran in a quiet minute.
    """
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(fn())
    return {k: statistics.median(v) for k, v in samples.items()}


def latencies(fn: Callable[[int], Any], n: int) -> np.ndarray[Any, np.dtype[np.float64]]:
    """Seconds taken by ``fn(i)`` for i in range(n)."""
    out = np.empty(n)
    clock = time.perf_counter
    for i in range(n):
        t = clock()
        fn(i)
        out[i] = clock() - t
    return out


@contextlib.contextmanager
def stopwatch() -> Iterator[list[float]]:
    """``with stopwatch() as t: ...`` then ``t[0]`` holds the elapsed seconds."""
    box: list[float] = []
    start = time.perf_counter()
    try:
        yield box
    finally:
        box.append(time.perf_counter() - start)
