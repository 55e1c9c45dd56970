"""Loader benchmark: the training loaders against the machine's own limits.

Every speed is printed as a ratio to a limit measured in the same run: the shuffled and
ordered loaders on a page-cached cache against large-buffer memcpy, on a cold cache (and,
with ``--big``, a cache larger than RAM) against sequential O_DIRECT reads of the same
files; the map-style datasets under DataLoader workers 0, 4, 8 beside Gemma Scope's 1 GB/s
target; the shuffle quality against a perfect shuffle; host-to-GPU with pinned memory
when a CUDA GPU is present.

    .venv/bin/python benchmarks/loaders.py [--quick] [--big] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import saev_shards as ss
from benchmarks import benchlib as bl
from benchmarks import tables
from benchmarks.core import make_metadata
from saev_shards import loaders
from saev_shards.codecs import float8, gather
from saev_shards.loaders.mapped import CacheMap
from saev_shards.loaders.outputs import cast_into
from saev_shards.loaders.plan import index_window
from saev_shards.protocol.manifest import Manifest, ShardEntry, ShardList

# A ViT-B/16-like cache: 2 layers x (CLS + 196 patches) x 768 dims, float16: 605 KB per
# example, one token vector 1,536 bytes.
#: The throughput Gemma Scope's training pipeline aimed for (Lieberum et al., 2024).
GEMMA_SCOPE_GBPS = 1.0
BATCH = 4096
#: A page-cached sample runs a loader's epochs until this many bytes: steady state, whatever
#: the cache's size (the first window, read before the first batch, is then a small part).
PAGE_CACHED_BYTES = 2e9


def build_cache(root: Path, md: ss.Metadata) -> ss.Shards:
    """Write ``md`` (labels included) from a repeated random batch, unless it is already there."""
    path = root / md.hash
    if not path.exists():
        rng = np.random.default_rng(0)
        batch = rng.standard_normal((64, *md.shape[1:]), dtype=np.float32).astype(np.float16)
        labels = rng.integers(0, 10, (64, md.patches_per_ex), dtype=np.uint8)
        t = time.perf_counter()
        with ss.ShardWriter(root, md, durable=False) as w:
            for start in range(0, md.n_examples, len(batch)):
                n = min(len(batch), md.n_examples - start)
                w.write(batch[:n], labels=labels[:n])
        print(f"(wrote {md.nbytes / 1e9:.1f} GB in {time.perf_counter() - t:.0f} s)", flush=True)
    return ss.open(path)


class EpochSample(NamedTuple):
    """One loader sample of `epoch_rate`."""

    #: GB/s of stored bytes and tokens/s, from the first batch on (or after the first epoch).
    gbps: float
    tokens: float
    #: Seconds from ``iter`` to the new loader's first batch.
    first_batch: float
    #: CPU seconds (every thread) per GB over the timed stretch.
    cpu: float
    #: Share of the timed stretch spent in later epochs' start-ups.
    startups: float
    #: GB/s of the new loader's whole first epoch, first batch included (``after_first_epoch``), else NaN.
    first_epoch: float


def epoch_rate(
    make: Callable[[], Any], max_bytes: float = float("inf"), min_bytes: float = 0, after_first_epoch: bool = False
) -> EpochSample:
    """One epoch of a new loader (or its first ``max_bytes``), or as many epochs of the same
    loader as make ``min_bytes``.

    The rates count from the first batch on: the first window's load, which nothing can
    overlap, is reported apart as the start-up time; later epochs' start-ups (from ``iter`` to
    their first batch) are counted, as a training loop meets them, and their share of the time
    reported. CPU time is the process's (every loader thread and the consumer) over the same
    stretch. ``after_first_epoch``: the clock starts once the new loader has run one whole epoch
    (timed apart, `EpochSample.first_epoch`): what a training run gets from its second epoch on,
    with the cache mapped in place (a local page-cached cache's pages are mapped into the process
    during a loader's first epoch, once per loader).
    """
    loader = make()
    itemsize = loader.shards.metadata.itemsize  # count stored bytes, whatever the output dtype
    nbytes = tokens = 0
    start = time.perf_counter()
    it = iter(loader)
    first = next(it, None)
    t, cpu = time.perf_counter(), time.process_time()
    first_batch, first_epoch = t - start, float("nan")
    startups = 0.0
    if after_first_epoch and first is not None:
        moved = first.acts.numel() + sum(batch.acts.numel() for batch in it)
        first_epoch = moved * itemsize / (time.perf_counter() - start) / 1e9
        t, cpu = time.perf_counter(), time.process_time()
        it = iter(loader)  # the second epoch's start-up on the clock, as every later epoch's
        first = next(it, None)
        startups = time.perf_counter() - t
        if first is not None:
            tokens, nbytes = len(first), first.acts.numel() * itemsize
    while True:
        for batch in it:
            tokens += len(batch)
            nbytes += batch.acts.numel() * itemsize
            if nbytes >= max_bytes:
                break
        if nbytes >= min_bytes or nbytes >= max_bytes or first is None:
            break
        t_iter = time.perf_counter()
        it = iter(loader)
        batch = next(it, None)  # counted like the others: the start-up is timed, not left out
        startups += time.perf_counter() - t_iter
        if batch is None:
            break
        tokens += len(batch)
        nbytes += batch.acts.numel() * itemsize
    dt, cpu = time.perf_counter() - t, time.process_time() - cpu
    del first, it
    loader.close()
    gbps, tps = nbytes / max(dt, 1e-9) / 1e9, tokens / max(dt, 1e-9)
    return EpochSample(gbps, tps, first_batch, cpu / max(nbytes / 1e9, 1e-9), startups / max(dt, 1e-9), first_epoch)


# --------------------------------------------------------------------------------------
# shuffled and ordered loaders


#: A limit row of a loader table: ``(the ratio column it sets, the rate function)``. Rows of
#: one column are alternatives (say numpy and torch, 1 or 2 threads): the best sets it. A
#: row with no column ("") is a reference: measured and compared, setting no column.
Limit = tuple[str, Callable[[], float]]


def loader_table(
    name: str,
    title: str,
    limits: dict[str, Limit],
    contenders: dict[str, Callable[[], Any]],
    rounds: int,
    before_each: Callable[[], None] = lambda: None,
    max_bytes: float = float("inf"),
    min_bytes: float = 0,
    limit_cpu: dict[str, float] | None = None,
    after_first_epoch: bool = False,
) -> tables.Table:
    """Interleave ``rounds`` epochs of each loader with every limit; a table of medians and ratios.

    Every row, limits included, gets a ratio to each limit column (the best row of that
    column, measured in the same run), then to Gemma Scope's 1 GB/s. ``limit_cpu``: the CPU
    seconds per GB of limit rows that measured it (filled while they run). ``after_first_epoch``:
    each loader timed from its second epoch on (`epoch_rate`), its first epoch in a column of its own.
    """
    samples: dict[str, list[EpochSample]] = {}

    def timed(label: str, make: Callable[[], Any]) -> Callable[[], float]:
        def fn() -> float:
            before_each()
            sample = epoch_rate(make, max_bytes, min_bytes, after_first_epoch)
            samples.setdefault(label, []).append(sample)
            return sample[0]

        return fn

    def limit(fn: Callable[[], float]) -> Callable[[], float]:
        def run() -> float:
            before_each()
            return fn()

        return run

    fns: dict[str, Callable[[], float]] = {label: limit(fn) for label, (_, fn) in limits.items()}
    fns.update({label: timed(label, make) for label, make in contenders.items()})
    medians = bl.interleaved(fns, rounds=rounds)
    columns = list(dict.fromkeys(column for column, _ in limits.values() if column))
    tops = {c: max(medians[label] for label, (column, _) in limits.items() if column == c) for c in columns}
    table = tables.Table(
        name,
        title,
        [
            "loader",
            "GB/s",
            "tokens/s",
            *(f"ratio to {c}" for c in columns),
            "ratio to Gemma Scope 1 GB/s",
            "first batch (s)",
            *(["first epoch GB/s"] if after_first_epoch else []),
            "later start-ups (share of time)",
            "CPU s/GB",
        ],
    )
    first_epoch_blank = [""] if after_first_epoch else []
    for label in limits:
        gbps = medians[label]
        cpu_row = limit_cpu.get(label, "") if limit_cpu is not None else ""
        ratios = (gbps / tops[c] for c in columns)
        table.add(label, gbps, float("nan"), *ratios, gbps / GEMMA_SCOPE_GBPS, "", *first_epoch_blank, "", cpu_row)
    for label in contenders:
        gbps = medians[label]
        tokens, startup, cpu, later, first = (float(np.median([s[i] for s in samples[label]])) for i in (1, 2, 3, 4, 5))
        table.add(
            label,
            gbps,
            tokens,
            *(gbps / tops[c] for c in columns),
            gbps / GEMMA_SCOPE_GBPS,
            startup,
            *([first] if after_first_epoch else []),
            later,
            cpu,
        )
        table.values[f"{label} (CPU s/GB)"] = cpu
        table.values[f"{label} (start-ups)"] = later
    table.values.update(medians)
    return table


def window_gather(
    shards: ss.Shards, buffer: int, mapped: bool = False
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any] | None, list[np.ndarray[Any, Any]], list[Any]]:
    """What the shuffled loader's gathers do, without the loader: the rows of its first window in
    its own order (its plan and permutation), cut into batches, from a buffer of its window's
    size (anonymous memory, as windows read into buffers) or, with ``mapped``, from the cache
    itself mapped in place (the page cache, as the loader reads a page-cached local cache), into
    as many batch-sized outputs as it keeps in flight: ``(source, source scales or None,
    index batches, outputs)``."""
    loader = loaders.ShuffledLoader(shards, BATCH, buffer_bytes=buffer, mix_layers=True)
    md, cfg = shards.metadata, loader._config
    window = loader.plan(0).windows[0]
    scales = None
    if mapped:
        cache = CacheMap(shards, scales=cfg.float8)
        spans = loader._spans
        for b in window.spans.tolist():  # in the page cache and mapped, as the loader leaves it
            for in_scales in (False, True) if cfg.float8 else (False,):
                cache.populate(*cache.byte_range(int(spans.start[b]), int(spans.stop[b]), None, in_scales))
        index = index_window(loader.selection, loader._spans, window, loader._window_rng(0, 0), cache.source)
        source, scales = cache.values, cache.scales
    else:
        index = index_window(loader.selection, loader._spans, window, loader._window_rng(0, 0))
        source = np.ones((loader._buffer_rows() * md.tokens_per_ex, md.d_model), shards.numpy_dtype)
        if cfg.float8:
            scales = np.ones(len(source), np.float32)
    flat = index.flat
    batches = [flat[i : i + BATCH] for i in range(0, len(flat) - BATCH + 1, BATCH)]
    outs = [np.ones((BATCH, md.d_model), shards.numpy_dtype) for _ in range(cfg.gather_threads + cfg.prefetch + 4)]
    loader.close()
    return source, scales, batches, outs


def ordered_copy(shards: ss.Shards, threads: int) -> float:
    """GB/s of what the OrderedLoader's gathers do, alone: the rows of its first window (runs of
    consecutive rows, in the cache's order) from the cache mapped in place, populated, by its
    own call (``numpy.take``) into as many batch-sized outputs as it keeps in flight."""
    loader = loaders.OrderedLoader(shards, BATCH, mix_layers=True)
    cfg, spans = loader._config, loader._spans
    window = loader.plan(0).windows[0]
    cache = CacheMap(shards)
    for b in window.spans.tolist():
        cache.populate(*cache.byte_range(int(spans.start[b]), int(spans.stop[b])))
    flat = index_window(loader.selection, spans, window, None, cache.source).flat
    batches = [flat[i : i + BATCH] for i in range(0, len(flat) - BATCH + 1, BATCH)]
    n_out = cfg.gather_threads + cfg.prefetch + 4
    outs = [np.ones((BATCH, shards.metadata.d_model), shards.numpy_dtype) for _ in range(n_out)]
    loader.close()
    return bl.gather_gbps(cache.values, batches, outs, threads)


def gather_limits(
    shards: ss.Shards,
    buffer: int,
    column: str = "gather limit",
    libs: tuple[str, ...] = ("numpy", "torch"),
    tag: str = "",
    cpu: dict[str, float] | None = None,
) -> dict[str, Limit]:
    """The random-row gather alone, numpy (and torch), 1 and 2 threads: the same rows into the same
    buffers (a float8_e4m3 cache's rows with their scales, as its loader gathers them), from an
    anonymous buffer and (numpy) from the cache mapped in place, where the loader's page-cached
    gathers read them. ``cpu``: filled with each row's process CPU seconds per GB delivered."""
    limits: dict[str, Limit] = {}
    for mapped in (False, True):
        source, scales, batches, outs = window_gather(shards, buffer, mapped)
        out_scales = None if scales is None else (scales, [np.ones(BATCH, np.float32) for _ in outs])
        where = " from the cache mapped in place" if mapped else ""
        for lib in ("numpy",) if mapped else libs:
            name = "numpy take" if lib == "numpy" else "torch index_select"
            for threads in (1, 2):
                label = f"random-row gather{tag}{where}: {name}, {threads} thread{'s' if threads > 1 else ''} (limit)"
                fn = functools.partial(bl.gather_gbps, source, batches, outs, threads, lib, scales=out_scales)
                limits[label] = (column, fn if cpu is None else functools.partial(_cpu_of, fn, label, cpu))
    return limits


def _cpu_of(fn: Callable[[], float], label: str, cpu: dict[str, float]) -> float:
    """``fn()`` (GB/s), recording the process CPU seconds per GB it spent in ``cpu[label]`` (the
    last sample's: its set-up is a small part of the half-gigabyte it gathers)."""
    c, t = time.process_time(), time.perf_counter()
    gbps = fn()
    cpu[label] = (time.process_time() - c) / max(gbps * (time.perf_counter() - t), 1e-9)
    return gbps


def gather_gap_note(values: dict[str, float], cpu: dict[str, float]) -> str:
    """What remains between the shuffled loader and the gather alone, from this run's figures."""
    rows = {k: v for k, v in values.items() if k.startswith("random-row gather")}
    best = max(rows, key=lambda k: rows[k])
    one = max((k for k in rows if "1 thread" in k), key=lambda k: rows[k])
    mapped = max((k for k in rows if "mapped in place" in k), key=lambda k: rows[k])
    anon = max((k for k in rows if "mapped in place" not in k), key=lambda k: rows[k])
    loader = values["ShuffledLoader, all layers"]
    loader_cpu = values["ShuffledLoader, all layers (CPU s/GB)"]
    startups = values["ShuffledLoader, all layers (start-ups)"]
    gather_cpu = cpu.get(one, float("nan"))
    cores = os.cpu_count() or 1
    return (
        f"The gather limit is the best gather row ({best.split(' (', 1)[0]}: {rows[best]:.2f} GB/s), a reference "
        f"(the next table holds the targets). From the cache mapped in place (the loader's source) the gather ran at "
        f"{rows[mapped]:.2f} GB/s, from an anonymous buffer at {rows[anon]:.2f} GB/s: the page cache's large "
        f"folios are mapped with huge pages (2 MiB-aligned mapping), so reading in place costs no TLB misses "
        f"beyond the buffer's. The loader ({loader:.2f} GB/s, {loader / rows[best]:.2f} of the gather limit, "
        f"{loader / rows[one]:.2f} of the best 1-thread gather) spent {loader_cpu:.3f} CPU s/GB, the 1-thread "
        f"gather {gather_cpu:.3f}: the rest is each window's index (its permutation, a Fisher-Yates shuffle that "
        "fixes the order a saved state resumes, and the batches' metadata), the pages' residency checks, the "
        "threads' hand-offs, the training loop's thread, and waits to take the GIL back after each numpy call "
        f"(docs/loaders.md, 'Speed'). On {cores} cores that bounds the loader at {cores / loader_cpu:.1f} GB/s "
        "with every core busy, while the 2-thread gather rows spend every core on the gather alone. Later "
        f"epochs' start-ups (the first window's index and residency check before an epoch's first batch) took "
        f"{startups:.0%} of the loader's time: this quick cache's epochs are short."
    )


def shard_files(shards: ss.Shards) -> list[Path]:
    return [shards.shard_path(k) for k in range(shards.n_shards)]


def bench_page_cached(shards: ss.Shards, quick: bool) -> None:
    buffer = (64 if quick else 512) << 20
    rounds = 1 if quick else 3
    read_threads = loaders.default_read_threads()
    contenders = {
        "ShuffledLoader, all layers": lambda: loaders.ShuffledLoader(
            shards, BATCH, buffer_bytes=buffer, mix_layers=True
        ),
        "ShuffledLoader, layer 11": lambda: loaders.ShuffledLoader(shards, BATCH, layers=11, buffer_bytes=buffer),
        "ShuffledLoader, all layers, out float32": lambda: loaders.ShuffledLoader(
            shards, BATCH, buffer_bytes=buffer, out_dtype="float32", mix_layers=True
        ),
        "ShuffledLoader, 1 gather thread": lambda: loaders.ShuffledLoader(
            shards, BATCH, buffer_bytes=buffer, gather_threads=1, mix_layers=True
        ),
        "OrderedLoader, all layers": lambda: loaders.OrderedLoader(shards, BATCH, mix_layers=True),
    }
    files = shard_files(shards)
    read_limit = min(shards.metadata.nbytes, 1 << 30)
    limit_cpu: dict[str, float] = {}
    limits: dict[str, Limit] = {
        "memcpy, 256 MiB buffers (limit)": ("memcpy", bl.memcpy_gbps),
        **gather_limits(shards, buffer, cpu=limit_cpu),
        **{
            f"the OrderedLoader's rows copied from the cache mapped in place: numpy take, {t} thread{'s' * (t > 1)}": (
                "",
                functools.partial(ordered_copy, shards, t),
            )
            for t in (1, 2)
        },
        "page-cache read: pread of the shards, 4 MiB blocks, 1 thread": (
            "",
            lambda: bl.buffered_read_gbps(files, 1, limit=read_limit),
        ),
        f"page-cache read: pread of the shards, 4 MiB blocks, {read_threads} threads": (
            "",
            lambda: bl.buffered_read_gbps(files, read_threads, limit=read_limit),
        ),
    }
    bl.warm_cache(shards.path)
    huge_note = bl.mapped_huge_note([shards.path])
    table = loader_table(
        "loaders_page_cached",
        f"Training loaders, page-cached cache ({shards.metadata.nbytes / 1e9:.1f} GB): ratio to memcpy and to the "
        "random-row gather alone",
        limits,
        contenders,
        rounds,
        min_bytes=PAGE_CACHED_BYTES,
        limit_cpu=limit_cpu,
        after_first_epoch=True,
    )
    table.note(
        f"Batches of {BATCH} token vectors (1,536 bytes each, float16 unless noted; GB/s counts the stored bytes "
        f"delivered). Shuffle window {buffer >> 20} MiB, 4 MiB read blocks, read in place (no window buffers: "
        f"docs/loaders.md), read threads: {read_threads} ({loaders.default_read_threads(sequential=True)} for the "
        f"OrderedLoader), gather threads: {loaders.default_gather_threads()} unless noted. Each sample is a new "
        f"loader: its first epoch (timed apart: 'first epoch GB/s', its first batch included), then its later "
        f"epochs until {PAGE_CACHED_BYTES / 1e9:.0f} GB, timed from the second epoch's start (every later epoch's "
        "start-up counted, and their share of its time shown): what a training run gets from its second epoch on. "
        "A loader's first epoch also maps the cache's pages into the process (once per loader, docs/loaders.md, "
        "'Read in place'); the limits gather from pages mapped before their clocks start. Until 2026-11-28 the "
        f"samples were a new loader's first {PAGE_CACHED_BYTES / 1e9:.0f} GB, that mapping included. Median of "
        f"{rounds} interleaved rounds. The gather "
        "limit is the best of the six random-row gather rows: the rows of the shuffled loader's first window, in "
        "its order, from a buffer of its window's size (numpy and torch) or from the cache mapped in place as the "
        "loader reads it (numpy), into as many batch-sized outputs as it keeps in flight, nothing else (no reads, "
        "no Python between gathers); their CPU s/GB is the process's while they ran. The page-cache read rows "
        "(pread into a reused 4 MiB buffer) are what reading windows into buffers cost before. The OrderedLoader's "
        "rows copied alone are what its gathers do with nothing else: its first window's rows (whole examples, in "
        "the cache's order) from the cache mapped in place into batch-sized outputs by its own call; a copy out of "
        "the page cache's pages is not a copy between two anonymous buffers, so memcpy stays the target's limit "
        "and these rows say what a loader's copy reaches here. Targets: the OrderedLoader at >= 0.9 of memcpy; the "
        "shuffled loader's are in the next table (a gather of rows computed before its clock starts is a reference "
        "a loader, which draws its order as it goes, cannot reach). " + huge_note
    )
    table.note(gather_gap_note(table.values, limit_cpu))
    table.emit()


# --------------------------------------------------------------------------------------
# each shuffled loader row against gathers of its own rows and output dtype

#: The page-cached loader rows measured against their own limits: ``(label, cache, loader
#: keywords)``; ``cache`` is the float16 cache or the same values stored as float8_e4m3.
OWN_ROWS: list[tuple[str, str, dict[str, Any]]] = [
    ("all layers", "float16", {"mix_layers": True}),
    ("layer 11", "float16", {"layers": 11}),
    ("all layers, out float32", "float16", {"mix_layers": True, "out_dtype": "float32"}),
    ("stack_layers", "float16", {"stack_layers": True}),
    ("float8, all layers", "float8_e4m3", {"mix_layers": True}),
    ("float8, layer 11, out float32", "float8_e4m3", {"layers": 11, "out_dtype": "float32"}),
    ("1 gather thread", "float16", {"mix_layers": True, "gather_threads": 1}),
    # Without numba (its limits too): the numpy-only path, to be within 2 x the compiled one.
    ("all layers, out float32, numpy only", "float16", {"mix_layers": True, "out_dtype": "float32", "numpy": True}),
]
#: The shuffle windows the rows are measured at: the loaders' default and a small one.
WINDOWS = (1 << 30, 64 << 20)
#: Bytes of the anonymous buffer the 'random rows' limit draws window-sized regions from, in
#: turn (or the whole cache, if smaller): more than the largest window and several times the
#: largest CPU cache seen (480 MiB of L3 on the development machine), so that a region is read
#: from memory, as a loader's window is.
PLAIN_BUFFER_BYTES = 2 << 30
#: `LoaderGather.plain_source` of each cache (by path), built once for all its rows.
_PLAIN_SOURCES: dict[str, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any] | None]] = {}


class LoaderGather:
    """What one loader's gathers do, alone: its rows (in its order, from the cache mapped in place
    as it reads a page-cached cache) gathered, cast and dequantized into batch-sized outputs of its
    output dtype by the same call it makes (`numpy.take`, `gather.take_widen`,
    `float8.take_dequantize`, or a gather and a cast), as many outputs as it keeps in flight."""

    def __init__(self, shards: ss.Shards, options: dict[str, Any]) -> None:
        self.loader = loaders.ShuffledLoader(shards, BATCH, **options)
        cfg = self.cfg = self.loader._config
        md = shards.metadata
        self.cache = CacheMap(shards, scales=cfg.float8)
        self.plan = self.loader.plan(0)
        spans = self.loader._spans
        for w in self.plan.windows:  # in the page cache and mapped, as the loader leaves them
            for b in w.spans.tolist():
                for in_scales in (False, True) if cfg.float8 else (False,):
                    self.cache.populate(
                        *self.cache.byte_range(int(spans.start[b]), int(spans.stop[b]), None, in_scales)
                    )
        out_np = np.dtype(np.uint16) if cfg.out_dtype == "bfloat16" else np.dtype(cfg.out_dtype)
        n_out = cfg.gather_threads + cfg.prefetch + 4
        self.outs = [np.ones((BATCH, *cfg.row_shape), out_np) for _ in range(n_out)]
        self.raw = [np.ones((BATCH, *cfg.row_shape), cfg.numpy_dtype) for _ in range(n_out)]
        #: Stored bytes of one output row (what the loaders' GB/s count).
        self.row_bytes = int(np.prod(cfg.row_shape)) * md.itemsize
        #: As many threads as the loader gathers with (2 here by default; 1 for the '1 gather thread' row).
        self.threads = cfg.gather_threads
        #: Process CPU seconds per GB of each sample, by kind ('precomputed', 'drawn', 'plain'):
        #: over the gathers' stretch only, as their GB/s (not their set-up, such as `plain`'s buffer).
        self.cpu: dict[str, list[float]] = {}

    def _timed(self, kind: str, run: Callable[[int], None], nbytes: Callable[[], float]) -> float:
        """GB/s of ``run`` on this many threads, recording its CPU seconds per GB under ``kind``."""
        dt, cpu = bl.in_threads_cpu(self.threads, run)
        gb = nbytes() / 1e9
        self.cpu.setdefault(kind, []).append(cpu / max(gb, 1e-9))
        return gb / dt

    def index(self, w: int) -> Any:
        window = self.plan.windows[w]
        rng = self.loader._window_rng(0, w)
        return index_window(self.loader.selection, self.loader._spans, window, rng, self.cache.source)

    def take(
        self, values: np.ndarray[Any, Any], scales: np.ndarray[Any, Any] | None, rows: np.ndarray[Any, Any], o: int
    ) -> None:
        """The loader's gather of ``rows`` into output ``o`` (the same call as `HostRun._chunk`)."""
        cfg = self.cfg
        out = self.outs[o][: len(rows)]
        if scales is not None:
            float8.take_dequantize(values, scales, rows, out, cfg.out_dtype)
        elif cfg.out_dtype == cfg.stored:
            np.take(values, rows, axis=0, out=out, mode="clip")
        elif not (cfg.out_dtype == "float32" and gather.take_widen(values, rows, out, cfg.stored)):
            raw = self.raw[o][: len(rows)]
            np.take(values, rows, axis=0, out=raw, mode="clip")
            cast_into(raw, cfg.stored, cfg.out_dtype, out)

    def take_batches(
        self, values: np.ndarray[Any, Any], scales: np.ndarray[Any, Any] | None, rows: np.ndarray[Any, Any], o: int
    ) -> tuple[int, int]:
        """``rows`` gathered batch by batch into this thread's outputs from output ``o`` on (every
        ``threads``-th): ``(the next output, stored bytes gathered)``."""
        nbytes = 0
        for i in range(0, len(rows), BATCH):
            batch = rows[i : i + BATCH]
            self.take(values, scales, batch, o % len(self.outs))
            o += self.threads
            nbytes += len(batch) * self.row_bytes
        return o, nbytes

    def precomputed(self, min_bytes: float) -> float:
        """GB/s of the first window's rows, its index computed beforehand (not timed)."""
        flat = self.index(0).flat
        batches = [flat[i : i + BATCH] for i in range(0, max(1, len(flat) - BATCH + 1), BATCH)]
        passes = max(1, int(-(-min_bytes // max(1, sum(len(b) for b in batches) * self.row_bytes))))
        work = [(b, i % len(self.outs)) for i, b in enumerate(batches * passes)]
        values, scales = self.cache.values, self.cache.scales

        def run(t: int) -> None:
            for b, o in work[t :: self.threads]:
                self.take(values, scales, b, o)

        return self._timed("precomputed", run, lambda: sum(len(b) for b, _ in work) * self.row_bytes)

    def drawn(self, min_bytes: float) -> float:
        """GB/s of the epoch's windows, each thread indexing its windows (the loader's permutation
        and columns, `index_window`) and gathering their batches: the order drawn as it goes."""
        n_windows = len(self.plan.windows)
        values, scales = self.cache.values, self.cache.scales
        done = [0] * self.threads

        def run(t: int) -> None:
            w, o = t, t
            while done[t] * self.threads < min_bytes:
                o, nbytes = self.take_batches(values, scales, self.index(w % n_windows).flat, o)
                done[t] += nbytes
                w += self.threads

        return self._timed("drawn", run, lambda: sum(done))

    def plain_source(self) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any] | None]:
        """The anonymous buffer 'random rows' draws from, shared by every row of the same cache:
        the cache's first examples as stored, ``(examples * L * T, D)`` in its own layout (every
        layer and token, a float8_e4m3 cache's scales beside), up to `PLAIN_BUFFER_BYTES`."""
        key = str(self.loader.shards.path)
        if key not in _PLAIN_SOURCES:
            shards = self.loader.shards
            md = shards.metadata
            n_ex = max(1, min(md.n_examples, PLAIN_BUFFER_BYTES // md.example_nbytes))
            values = shards.read_range_raw(0, n_ex).reshape(-1, md.d_model)
            scales = shards.read_range_scales(0, n_ex).reshape(-1) if self.cache.scales is not None else None
            _PLAIN_SOURCES[key] = (values, scales)
        return _PLAIN_SOURCES[key]

    def plain(self, window_bytes: int, min_bytes: float) -> float:
        """GB/s of random rows of an anonymous buffer, a window's worth at a time: each thread takes
        the next window-sized region of the buffer (`plain_source`: the cache's layout, larger than
        the CPU's caches, so a region comes round again from memory), draws its order
        (``Generator.permutation`` of the region's chosen units: the loader's layers and tokens,
        every one once, as a loader's window) and gathers it batch by batch into the same outputs
        by the same call. Rows drawn again and again from one window-sized buffer of the chosen
        vectors alone (what this limit did until 2026-11-28) came from the CPU's caches at small
        windows (a 64 MiB buffer fits in this machine's 480 MiB L3), and one layer of two packed
        densely was not the layout a loader reads: neither is reachable by a loader."""
        md = self.loader.shards.metadata
        values, scales = self.plain_source()
        per_ex = md.n_layers * md.tokens_per_ex  # vectors of one example in the buffer
        layers = self.loader.selection.layer_positions
        tokens = self.loader.selection.base_tokens
        if self.loader.stack_layers:  # a unit is one token at every chosen layer: (tokens, L)
            units = layers[None, :] * md.tokens_per_ex + tokens[:, None]
        else:  # a unit is one vector, by layer then token
            units = (layers[:, None] * md.tokens_per_ex + tokens[None, :]).reshape(-1)
        unit_bytes = units[0].size * md.d_model * md.itemsize
        n_ex = len(values) // per_ex
        region = max(1, min(n_ex, window_bytes // max(1, len(units) * unit_bytes)))  # examples per window
        n_regions = max(1, n_ex // region)
        done = [0] * self.threads

        def run(t: int) -> None:
            rng = np.random.default_rng(t)
            r, o = t, t
            while done[t] * self.threads < min_bytes:
                example, unit = np.divmod(rng.permutation(region * len(units)), len(units))
                first = (example + (r % n_regions) * region) * per_ex  # each unit's example's first vector
                rows = units[unit] + (first[:, None] if units.ndim > 1 else first)
                o, nbytes = self.take_batches(values, scales, rows, o)
                done[t] += nbytes
                r += self.threads

        return self._timed("plain", run, lambda: sum(done))

    def close(self) -> None:
        self.loader.close()


def _numpy_only(fn: Callable[[], float]) -> Callable[[], float]:
    """``fn`` run without numba's kernels (`gather.numpy_only`, `float8.numpy_only`)."""

    def run() -> float:
        with gather.numpy_only(), float8.numpy_only():
            return fn()

    return run


def bench_own_limits(caches: dict[str, ss.Shards], quick: bool) -> None:
    """Each shuffled loader row beside gathers of its own rows into its own output dtype, at the
    default window and a small one, page-cached."""
    rounds = 1 if quick else 3
    min_bytes = 0.5e9 if quick else PAGE_CACHED_BYTES
    limit_bytes = 0.25e9 if quick else 1e9
    fns: dict[str, Callable[[], float]] = {}
    samples: dict[str, list[EpochSample]] = {}
    gathers: list[LoaderGather] = []
    rows = []
    for window in WINDOWS:
        for name, cache, options in OWN_ROWS:
            shards = caches[cache]
            kwargs = {**options, "buffer_bytes": window}
            numpy = bool(kwargs.pop("numpy", False))
            label = f"{name}, {window >> 20} MiB window"
            g = LoaderGather(shards, kwargs)
            gathers.append(g)
            rows.append((label, g))

            def sample(label: str = label, shards: ss.Shards = shards, kwargs: dict[str, Any] = kwargs) -> float:
                s = epoch_rate(
                    lambda: loaders.ShuffledLoader(shards, BATCH, **kwargs), min_bytes=min_bytes, after_first_epoch=True
                )
                samples.setdefault(label, []).append(s)
                return s[0]

            row_fns: dict[str, Callable[[], float]] = {
                "loader": sample,
                "precomputed": functools.partial(g.precomputed, limit_bytes),
                "drawn": functools.partial(g.drawn, limit_bytes),
                "plain": functools.partial(g.plain, window, limit_bytes),
            }
            fns.update({f"{label}: {k}": _numpy_only(fn) if numpy else fn for k, fn in row_fns.items()})
    for g in gathers:
        g.plain_source()  # built once per cache, before any clock starts
    for shards in caches.values():
        bl.warm_cache(shards.path)
    huge_note = bl.mapped_huge_note([shards.path for shards in caches.values()])
    try:
        medians = bl.interleaved(fns, rounds=rounds)
    finally:
        for g in gathers:
            g.close()
        _PLAIN_SOURCES.clear()
    table = tables.Table(
        "loaders_page_cached_own_limits",
        "ShuffledLoader rows, page-cached, against gathers of their own rows and output dtype (GB/s of stored bytes)",
        [
            "ShuffledLoader",
            "GB/s",
            "tokens/s",
            "own rows, precomputed (reference)",
            "own rows, order drawn as it goes",
            "random rows, drawn as it goes",
            "ratio to the limit",
            "ratio to own rows drawn",
            "ratio to precomputed",
            "first batch (s)",
            "first epoch GB/s",
            "CPU s/GB",
            "limit CPU s/GB",
        ],
    )
    for label, g in rows:
        loader = medians[f"{label}: loader"]
        own, drawn, plain = (medians[f"{label}: {k}"] for k in ("precomputed", "drawn", "plain"))
        best = "drawn" if drawn >= plain else "plain"
        tokens, startup, loader_cpu, first = (float(np.median([s[i] for s in samples[label]])) for i in (1, 2, 3, 5))
        limit_cpu = float(np.median(g.cpu[best]))
        table.add(
            label,
            loader,
            tokens,
            own,
            drawn,
            plain,
            loader / max(drawn, plain),
            loader / drawn,
            loader / own,
            startup,
            first,
            loader_cpu,
            limit_cpu,
        )
    md = caches["float16"].metadata
    table.note(
        f"Caches of {md.nbytes / 1e9:.2f} GB (float16) and of the same values as float8_e4m3, in the page "
        f"cache; batches of {BATCH} rows; GB/s counts the stored bytes delivered (a stacked row is "
        f"{len(md.layers)} vectors), whatever the output dtype; windows of {WINDOWS[0] >> 20} MiB (the default) "
        f"and {WINDOWS[1] >> 20} MiB. Every limit gathers with "
        "the loader's own call into its output dtype (`numpy.take`; float16 to float32 in one compiled pass, "
        "`codecs.gather.take_widen`, where numba is installed; float8_e4m3 `float8.take_dequantize`), with as many "
        "threads as the loader gathers with (2; 1 for the '1 gather thread' row), into as many batch-sized outputs "
        "as the loader keeps in flight, and includes nothing else: no reads, no residency checks, no batches' "
        "metadata handed out. 'own rows, precomputed' (a reference, not reachable): the loader's first window's rows "
        "in its order from the cache mapped in place, its index computed before the clock starts. 'own rows, order "
        "drawn as it goes': every window of the loader's epoch, each thread computing a window's index (the "
        "permutation and the rows, `index_window`) and then gathering it. 'random rows, drawn as it goes': "
        f"window-sized regions, in turn, of an anonymous buffer holding the cache's first {PLAIN_BUFFER_BYTES >> 30} "
        "GiB as stored (every layer and token, and scales), each thread drawing the order of its region's chosen "
        "units (`Generator.permutation`: the loader's layers and tokens, every one once, as a loader's window) "
        "and gathering them batch by batch; the buffer is several times the CPU's last-level cache, so that a "
        "region comes from memory, as a loader's window does. Until 2026-11-28 this limit drew rows again and "
        "again from one window-sized buffer of the chosen vectors alone: at a 64 MiB window they came from the "
        "CPU's cache, and one layer of two was packed densely, not laid out as a loader reads it; neither is "
        "reachable by a loader. 'own rows, precomputed' at a window that fits in the CPU's cache gathers from it "
        "too: a reference only. The limit is the "
        "faster of the two drawn ones ('ratio to own rows drawn' is the loader against the rows it reads, where "
        "it reads them: a page-cached window is not one anonymous buffer); its CPU "
        "s/GB is the process's while its gathers ran (not its set-up: the anonymous buffer's fill). "
        f"Median of {rounds} interleaved rounds; each loader sample is a new loader's first epoch (timed apart: "
        "'first epoch GB/s', its first batch and the mapping of the cache's pages into the process included, once "
        f"per loader), then its later epochs until {min_bytes / 1e9:.1f} GB, timed from the second epoch's start "
        "(its start-up included): what a training run gets from its second epoch on, against limits that gather "
        "from pages mapped before their clocks start (until 2026-11-28 the samples were a new loader's first "
        f"{min_bytes / 1e9:.1f} GB, the mapping included). The 'numpy only' row and its limits run without numba's "
        "kernels. Targets: every row >= 0.8 of its limit, CPU s/GB within 1.3 x the limit's; numpy only "
        "within 2 x the compiled row's time. " + huge_note
    )
    table.emit()


def disk_limits(shards: ss.Shards, limit: int) -> dict[str, Limit]:
    """The cold loaders' limits on the cache's own files: sequential O_DIRECT reads (one 8 MiB
    request at a time), and buffered preads in file order with the kernel's readahead, 1, 2 and
    4 threads (what this disk gives any buffered reader; the best row sets the column)."""
    files = shard_files(shards)
    limits: dict[str, Limit] = {
        "O_DIRECT sequential read, 8 MiB requests (limit)": ("O_DIRECT", lambda: bl.odirect_files_gbps(files, limit))
    }
    for threads in (1, 2, 4):
        limits[f"buffered read of the shards, 4 MiB preads, {threads} thread{'s' if threads > 1 else ''} (limit)"] = (
            "buffered read",
            functools.partial(bl.buffered_read_gbps, files, threads, limit=limit),
        )
    return limits


def bench_cold(shards: ss.Shards, quick: bool, big: bool) -> None:
    """From disk: the page cache is dropped before every sample (or the cache exceeds RAM)."""
    md = shards.metadata
    rounds = 1 if big else 3
    buffer = (64 if quick else 512) << 20
    contenders = {
        "ShuffledLoader, all layers": lambda: loaders.ShuffledLoader(
            shards, BATCH, buffer_bytes=buffer, mix_layers=True
        ),
        "ShuffledLoader, layer 11": lambda: loaders.ShuffledLoader(shards, BATCH, layers=11, buffer_bytes=buffer),
        "OrderedLoader, all layers": lambda: loaders.OrderedLoader(shards, BATCH, mix_layers=True),
    }
    where = f"cache larger than RAM ({md.nbytes / 2**30:.0f} GiB)" if big else f"cold cache ({md.nbytes / 1e9:.1f} GB)"
    # Dropped before each sample: a smaller cache would be read from memory, and the part of a
    # larger one that was written last would still be in the page cache.
    table = loader_table(
        "loaders_big" if big else "loaders_cold",
        f"Training loaders from disk, {where}: ratio to sequential O_DIRECT reads and to buffered reads of the "
        "same files",
        disk_limits(shards, min(md.nbytes, 4 << 30)),
        contenders,
        rounds,
        before_each=lambda: bl.drop_cache(shards.path),
        max_bytes=(32 << 30) if big else float("inf"),
    )
    table.note(
        ("Each loader reads up to 32 GiB of its epoch. " if big else "")
        + f"The page cache is dropped before each sample. Median of {rounds} interleaved rounds, each timed "
        "from its first batch. GB/s counts the activation bytes delivered in batches (layer 11 alone is half "
        "of each example, read slice by slice). The O_DIRECT limit keeps one request in flight; buffered "
        "reads keep several (the kernel's readahead, and the threads), which this virtual disk serves 2-3 "
        "times faster, so a loader can beat O_DIRECT; the buffered-read rows are what any reader of these "
        "files gets from this disk in the same minute. Targets: the shuffled loader >= 0.85 of O_DIRECT, "
        "the OrderedLoader >= 3 x O_DIRECT (quick run)."
    )
    table.emit()


# --------------------------------------------------------------------------------------
# shuffle quality (no data needed: which vectors land in a batch is a function of the plan)


def virtual_shards(n_examples: int, patches_per_shard: int = 2_400_000) -> ss.Shards:
    """An ImageNet-sized cache description with no files behind it (the planner reads none)."""
    return virtual_cache(make_metadata(n_examples, "quality", patches_per_shard))


def virtual_cache(md: ss.Metadata) -> ss.Shards:
    """A cache described by ``md`` with no files behind it: for plans and arithmetic only."""
    entries = ShardList.of(
        ShardEntry(f"acts{k:06d}.bin", md.shard_n_examples(k), md.shard_n_examples(k) * md.example_nbytes, None)
        for k in range(md.n_shards)
    )
    return ss.Shards(Path("/nonexistent") / md.hash, md, Manifest(shards=entries))


def batch_examples(loader: loaders.ShuffledLoader, n_batches: int) -> list[np.ndarray[Any, Any]]:
    """Example index of every vector of the first ``n_batches`` batches of epoch 0, from the plan."""
    examples = loader.epoch_examples(0, n_batches * loader.batch_size)
    return [examples[i * loader.batch_size : (i + 1) * loader.batch_size] for i in range(n_batches)]


def bench_quality(quick: bool) -> None:
    n_examples = 1_281_167  # ImageNet-1k train
    shards = virtual_shards(n_examples)
    md = shards.metadata
    eps = md.examples_per_shard
    n_batches = 20 if quick else 100
    rng = np.random.default_rng(0)
    per_layer = md.patches_per_ex
    table = tables.Table(
        "loaders_shuffle_quality",
        f"Shuffle quality: ImageNet-1k-sized cache ({n_examples:,} examples, {md.n_shards} shards of {eps:,}), "
        f"layer 11 content tokens, batches of {BATCH}",
        ["shuffle", "distinct examples / batch", "distinct shards / batch", "max tokens of one example / batch"],
    )
    # A perfect shuffle: each batch a uniform sample without replacement of all tokens.
    total = n_examples * per_layer
    ex_perfect = [rng.choice(total, BATCH, replace=False) // per_layer for _ in range(n_batches)]
    table.add("perfect (uniform, without replacement)", *_quality(ex_perfect, eps))
    for buffer_mib in (256, 1024, 4096) if not quick else (256, 1024):
        loader = loaders.ShuffledLoader(shards, BATCH, layers=11, buffer_bytes=buffer_mib << 20)
        table.add(f"ShuffledLoader, window {buffer_mib} MiB", *_quality(batch_examples(loader, n_batches), eps))
        loader.close()
    ex_bytes = md.tokens_per_ex * md.d_model * md.itemsize
    table.note(
        f"Averages over the first {n_batches} batches of epoch 0, computed from the loader's plan (which vectors go "
        f"in which batch depends only on the metadata and the seed, so no data is read). A window of W bytes holds "
        f"W / {ex_bytes:,} examples of layer 11 (4 MiB read blocks of ~13 consecutive examples, drawn from random "
        "shards); every batch is a uniform sample of its window's tokens, so the distinct examples per batch "
        "approach the perfect figure as the window grows."
    )
    table.emit()


def _quality(batches: list[np.ndarray[Any, Any]], eps: int) -> tuple[float, float, float]:
    distinct = float(np.mean([len(np.unique(b)) for b in batches]))
    shards = float(np.mean([len(np.unique(b // eps)) for b in batches]))
    most = float(np.mean([np.unique(b, return_counts=True)[1].max() for b in batches]))
    return distinct, shards, most


# --------------------------------------------------------------------------------------
# map-style datasets under DataLoader workers


def bench_datasets(shards: ss.Shards, quick: bool) -> None:
    from torch.utils.data import DataLoader, RandomSampler

    k = 300 if quick else 10_000
    workers_list = (0, 4, 8)
    md = shards.metadata
    slice_bytes = md.tokens_per_ex * md.d_model * md.itemsize
    vector_bytes = md.d_model * md.itemsize
    cases: dict[str, tuple[Any, int, int]] = {
        # name: (dataset, batch size, bytes per item)
        "ExampleDataset (example, layer) slices": (loaders.ExampleDataset(shards, mix_layers=True), 32, slice_bytes),
        "LayerPairDataset (b, 2, T, D)": (loaders.LayerPairDataset(shards), 32, 2 * slice_bytes),
        "TokenDataset single tokens": (loaders.TokenDataset(shards, layer=11), 1024, vector_bytes),
    }
    bl.warm_cache(shards.path)
    limit = bl.memcpy_gbps()
    table = tables.Table(
        "loaders_datasets",
        f"Map-style datasets under torch DataLoader, page-cached, k={k:,} random items",
        ["dataset", "workers", "items/s", "GB/s", "ratio to memcpy", "ratio to Gemma Scope 1 GB/s"],
    )
    for name, (ds, batch_size, item_bytes) in cases.items():
        n_items = k if item_bytes >= slice_bytes else k * 20
        next(iter(DataLoader(ds, batch_size=batch_size)))  # one-time costs (torch's thread pools) off the clock
        for workers in workers_list:
            sampler = RandomSampler(ds, num_samples=n_items, generator=None)
            with warnings.catch_warnings():  # more workers than cores is the point of the 4 and 8 rows
                warnings.filterwarnings("ignore", message="This DataLoader will create")
                loader = DataLoader(ds, batch_size=batch_size, sampler=sampler, num_workers=workers)
                t = time.perf_counter()
                items = 0
                for batch in loader:
                    items += len(batch["acts"])
                dt = time.perf_counter() - t
            gbps = items * item_bytes / dt / 1e9
            table.add(name, workers, items / dt, gbps, gbps / limit, gbps / GEMMA_SCOPE_GBPS)
    table.add("memcpy, 256 MiB buffers (limit)", "", float("nan"), limit, 1.0, limit / GEMMA_SCOPE_GBPS)
    table.note(
        f"Default DataLoader collation, fork start, worker start-up included; {os.cpu_count()} cores, so 4 and 8 "
        "workers oversubscribe them. With 0 workers the default collation stacks in the main process with torch's "
        "intra-op threads, which slow down by 3-20x whenever other work shares the cores. Single-token items pay "
        "Python's per-item cost: for training, use ShuffledLoader."
    )
    table.emit()


# --------------------------------------------------------------------------------------
# host to GPU


def bench_cuda(shards: ss.Shards, quick: bool) -> None:
    import torch

    if not torch.cuda.is_available():
        print("Host-to-GPU with pin_memory: no CUDA GPU on this machine.\n", flush=True)
        return
    bl.warm_cache(shards.path)
    limit = bl.copy_gbps("h2d", 256 << 20, repeats=10)
    table = tables.Table(
        "loaders_cuda",
        f"Host to GPU ({torch.cuda.get_device_name()}): ShuffledLoader batches moved with non_blocking copies",
        ["path", "GB/s", "ratio to pinned H2D copy"],
    )
    table.add("pinned 256 MiB host-to-device copy (limit)", limit, 1.0)
    for pin in (True, False):
        loader = loaders.ShuffledLoader(
            shards, BATCH, pin_memory=pin, buffer_bytes=(64 if quick else 512) << 20, mix_layers=True
        )
        moved = 0
        t = time.perf_counter()
        for batch in loader:
            batch.acts.to("cuda", non_blocking=True)
            moved += batch.acts.numel() * batch.acts.element_size()
        torch.cuda.synchronize()
        gbps = moved / (time.perf_counter() - t) / 1e9
        table.add(f"ShuffledLoader pin_memory={pin}", gbps, gbps / limit)
        loader.close()
    table.emit()


# --------------------------------------------------------------------------------------


def main(quick: bool = False, scale: bool = False, keep: bool = False) -> None:
    """Run every loader table; ``scale`` also builds a cache larger than RAM (minutes, ~30 GB of disk)."""
    print(f"Machine: {tables.machine()}\n", flush=True)
    # The compiled kernels loaded before anything is timed (a loader loads them on a thread of its
    # own, whose import of numba would otherwise be counted in the first samples' CPU time).
    print(f"Compiled gathers and indexes (numba): {gather.kernels_in_use()}", flush=True)
    work = tables.bench_dir() / "loaders"
    work.mkdir(parents=True, exist_ok=True)
    n_examples = 600 if quick else 6_000  # 0.36 GB / 3.6 GB, both well inside RAM
    md = make_metadata(n_examples, "loaders", patches_per_shard=200_000)  # 507 examples (307 MB) per shard
    # The page-cached tables read in place, at a speed the page cache's folios decide: write
    # the caches into a page cache with room, as a node's that holds its cache after an epoch.
    bl.SETTLED[:] = [what] if (what := bl.settle_memory()) else []
    shards = build_cache(work, md)
    md8 = md.replace(dtype="float8_e4m3", data={**md.data, "stored": "float8_e4m3"})
    shards8 = build_cache(work, md8)
    # The writer writes through O_DIRECT: the files are not in the page cache. Read them in
    # sequentially now, before anything reads parts of them: the first reader decides the
    # page cache's folios (a sequential read, large; the limits' windows read first left two
    # thirds of the cache in small ones, and every table after them paid TLB misses).
    for cache in (shards, shards8):
        bl.warm_cache(cache.path)
    try:
        bench_page_cached(shards, quick)
        bench_own_limits({"float16": shards, "float8_e4m3": shards8}, quick)
        bench_cold(shards, quick, big=False)
        bench_datasets(shards, quick)
        bench_cuda(shards, quick)
    finally:
        shards.close()
        shards8.close()
        if not keep:
            shutil.rmtree(work / md.hash, ignore_errors=True)
            shutil.rmtree(work / md8.hash, ignore_errors=True)
    bench_quality(quick)
    if scale:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        n_big = int(max(24 << 30, 1.1 * ram) // md.example_nbytes) + 1
        md_big = make_metadata(n_big, "loaders-big")
        big = build_cache(work, md_big)
        try:
            bench_cold(big, quick=False, big=True)
        finally:
            big.close()
            if not keep:
                shutil.rmtree(work / md_big.hash, ignore_errors=True)
    with contextlib.suppress(OSError):  # only when empty: --keep leaves the caches for the next run
        work.rmdir()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, one round (well under a minute)")
    parser.add_argument("--big", "--scale", dest="big", action="store_true", help="also a cache larger than RAM")
    parser.add_argument("--keep", action="store_true", help="keep the benchmark caches for the next run")
    args = parser.parse_args()
    main(args.quick, args.big, args.keep)
