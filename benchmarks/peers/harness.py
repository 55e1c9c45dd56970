"""The peers benchmark's harness: its sizes, how one measurement is timed and summarised, and
the state every workload shares (the stores written, the results so far, the limits' helpers).

`Harness` writes nothing itself: the workloads (`workloads.py`, `slices.py`) write the stores
and fill ``results``; `main.py` runs them in order. Every limit is measured by
`benchmarks.benchlib`; the helpers here only choose its sizes and the files it reads.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import benchlib as bl
from benchmarks import tables
from benchmarks.peers import adapters as F
from benchmarks.peers.data import DTYPE, Array, CacheSpec, Reader, Source, files, remove

OURS = ("saev", "saev_view")
REGIMES = ("page-cached", "cold")


# --------------------------------------------------------------------------------------
# configuration


@dataclasses.dataclass(frozen=True)
class Config:
    spec: CacheSpec
    queries: int  # workload 1: k random (example, layer) reads (the zarr logs' benchmark: 10,000)
    workers: tuple[int, ...]  # DataLoader workers (the zarr logs' benchmark: 0, 4, 8)
    loader_batch: int  # DataLoader batch size
    pair_examples: int  # workload 2: b examples x 2 layers per batch
    pair_batches: int
    gather_vectors: int  # workload 3: vectors per batch
    gather_batches: int
    open_shards: tuple[int, ...]  # workload 5
    budget_s: float  # cap on one (format, workload, regime) measurement; at least one item always runs
    rounds: int  # interleaved repeats of the loop measurements
    write_rounds: int  # our writer is timed this many times, interleaved with the others
    limit_nbytes: int  # size of the O_DIRECT limit file
    label: str = "full"
    #: Workload 1 again (page-cached loop) with these (T, D) slices, on small caches of their own.
    sweep_shapes: tuple[tuple[int, int], ...] = ()
    sweep_nbytes: int = 256 << 20

    def describe(self) -> list[str]:
        return [
            f"cache: {self.spec.describe()}",
            f"workload 1: k={self.queries} random (example, layer) reads per measurement (cold: one random "
            "layer of each example of a shuffled set spaced wider than the readahead window); DataLoader workers "
            f"{list(self.workers)}, batch_size={self.loader_batch}",
            f"workload 2: {self.pair_batches} batches of b={self.pair_examples} random examples x 2 random distinct "
            "layers (cold: examples from the same spaced set)",
            f"workload 3: {self.gather_batches} batches of {self.gather_vectors} random (example, layer, token) "
            "vectors",
            f"each measurement stops after {self.budget_s:g} s (the n column says how many items ran); "
            f"{self.rounds} interleaved rounds; the machine has {os.cpu_count()} cores",
        ]


FULL = Config(
    spec=CacheSpec(n_examples=512, n_layers=4, tokens=128, d_model=4096, examples_per_shard=32),
    queries=10_000,
    workers=(0, 4, 8),
    loader_batch=32,
    pair_examples=16,
    pair_batches=100,
    gather_vectors=4096,
    gather_batches=10,
    open_shards=(1, 100, 10_000),
    budget_s=4.0,
    rounds=3,
    write_rounds=3,
    limit_nbytes=1 << 30,
    # A short text sequence, and CLIP ViT-B/16 (196 patches + CLS, d 768: saev's own default).
    sweep_shapes=((32, 768), (197, 768)),
)
QUICK = Config(
    spec=CacheSpec(n_examples=32, n_layers=2, tokens=128, d_model=1024, examples_per_shard=8),
    queries=1000,
    workers=(0,),
    loader_batch=32,
    pair_examples=8,
    pair_batches=10,
    gather_vectors=256,
    gather_batches=2,
    open_shards=(1, 100),
    budget_s=0.2,
    rounds=1,
    write_rounds=1,
    limit_nbytes=64 << 20,
    label="quick",
)


# --------------------------------------------------------------------------------------
# measurements

DISK_NOTE = (
    "disk/read: bytes the kernel fetched from storage for this process (/proc/self/io read_bytes, readahead "
    "included) per byte delivered; 1.00 is no waste, more is read amplification (n/a: DataLoader workers, whose "
    "reads are not counted in the parent)."
)


@dataclasses.dataclass
class Run:
    """One measurement: ``n`` items (queries or batches) of ``nbytes`` in ``seconds`` wall time."""

    n: int
    nbytes: int
    seconds: float
    lat: Array  # seconds per item
    disk: int = -1  # bytes fetched from storage meanwhile (-1: not known)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("nan")


@dataclasses.dataclass
class Summary:
    """Several rounds of one measurement: rate is the median of the rounds, latencies pooled."""

    n: int
    gbps: float
    items_per_s: float
    mean: float
    median: float
    p95: float
    amplification: float  # bytes fetched from storage per byte delivered

    @classmethod
    def of(cls, runs: Sequence[Run]) -> Summary:
        lat = np.concatenate([r.lat for r in runs]) if runs else np.zeros(0)
        nan = float("nan")
        return cls(
            n=sum(r.n for r in runs),
            gbps=statistics.median(r.gbps for r in runs) if runs else nan,
            items_per_s=statistics.median(r.n / r.seconds for r in runs) if runs else nan,
            mean=float(lat.mean()) if len(lat) else nan,
            median=float(np.median(lat)) if len(lat) else nan,
            p95=float(np.percentile(lat, 95)) if len(lat) else nan,
            amplification=(
                sum(r.disk for r in runs) / sum(r.nbytes for r in runs)
                if runs and all(r.disk >= 0 for r in runs) and sum(r.nbytes for r in runs)
                else nan
            ),
        )


def timed(fn: Callable[[Any], object], items: Iterable[Any], item_nbytes: int, budget_s: float) -> Run:
    """Call ``fn`` on each item until done or ``budget_s`` has passed (at least once)."""
    clock = time.perf_counter
    lat: list[float] = []
    start = clock()
    for item in items:
        t = clock()
        fn(item)
        lat.append(clock() - t)
        if clock() - start > budget_s:
            break
    seconds = clock() - start
    return Run(len(lat), len(lat) * item_nbytes, seconds, np.array(lat))


def ms(seconds: float) -> float:
    return seconds * 1e3


def ratio(a: float, b: float) -> float:
    return a / b if b and b == b and a == a else float("nan")


class SliceDataset:
    """A map-style dataset of ``(example, layer)`` queries; each process opens its own reader."""

    def __init__(self, key: str, store: Path, spec: CacheSpec, queries: Array) -> None:
        self.key, self.store, self.spec, self.queries = key, store, spec, queries
        self._reader: Reader | None = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.queries)

    def __getitem__(self, j: int) -> tuple[Any, float]:
        import torch

        if self._reader is None or self._pid != os.getpid():
            self._reader = F.FORMATS[self.key].open(self.store, self.spec)
            self._pid = os.getpid()
        e, layer = self.queries[j].tolist()
        out = np.empty((self.spec.tokens, self.spec.d_model), DTYPE)
        t = time.perf_counter()
        got = self._reader.read(e, layer, out)
        dt = time.perf_counter() - t
        return torch.from_numpy(np.asarray(got)), dt

    def close(self) -> None:
        if self._reader is not None and self._pid == os.getpid():
            self._reader.close()
        self._reader = None


def loader_run(ds: SliceDataset, workers: int, batch: int, budget_s: float) -> Run:
    """Iterate a DataLoader; the rate counts from the first batch on (worker start-up excluded)."""
    from torch.utils.data import DataLoader

    loader: Any = DataLoader(ds, batch_size=batch, shuffle=False, num_workers=workers)  # type: ignore[arg-type]
    clock = time.perf_counter
    lat: list[float] = []
    start = clock()
    first: float | None = None
    after = 0
    for _, dt in loader:
        now = clock()
        lat.extend(dt.tolist())
        if first is None:
            first = now
        else:
            after += len(dt)
        if now - start > budget_s and after:
            break
    end = clock()
    del loader
    ds.close()
    if after:
        return Run(after, after * ds.spec.slice_nbytes, end - (first or start), np.array(lat))
    return Run(len(lat), len(lat) * ds.spec.slice_nbytes, end - start, np.array(lat))


# --------------------------------------------------------------------------------------
# the state every workload shares


class Harness:
    """One run of the comparison: its configuration, its folder, the stores written so far and
    the results every later table (and the plots) read."""

    def __init__(self, cfg: Config, keep: bool = False) -> None:
        self.cfg = cfg
        self.spec = cfg.spec
        self.keep = keep
        self.dir = tables.bench_dir() / "peers"
        remove(self.dir)
        self.dir.mkdir(parents=True)
        self.limit_file = self.dir / "limit.bin"
        self.stores: dict[str, Path] = {}
        self.results: dict[str, Any] = {}  # for the plots and the targets
        self.rng = np.random.default_rng(0)
        self.source: Source | None = None
        self.readahead = bl.readahead_nbytes(self.dir)
        #: Stores read whole into the page cache since they were written or last evicted
        #: (`prepare`), with their files' identity then (`_written`).
        self.settled: dict[Path, tuple[tuple[str, int, int, int], ...]] = {}

    def keys(self, round_: int = 0) -> list[str]:
        """Every row, rotated by round so no format always runs first."""
        keys = list(F.FORMATS)
        r = round_ % len(keys)
        return keys[r:] + keys[:r]

    def open_reader(self, key: str, regime: str, spec: CacheSpec | None = None, store: Path | None = None) -> Reader:
        """Open ``key``'s store after warming its files (page-cached) or evicting them (cold)."""
        store = store or self.stores[key]
        self.prepare(store, regime)
        return F.FORMATS[key].open(store, spec or self.spec)

    def prepare(self, store: Path, regime: str) -> None:
        """Put ``store``'s files in ``regime``: evicted (cold), or in the page cache as a
        sequential read leaves them (page-cached).

        How fast a page-cached file is read depends on the folios the page cache holds it in,
        set when its pages were first read: whole, in large folios; at random (a cold
        workload just before), in small ones, which a later sequential read does not merge
        (the same 296 KiB slices, one ``pread`` each: 9.0-9.4 GB/s against 5.0-6.4 by hand
        on 2026-11-28). So a store's first page-cached use after it was written or read cold
        evicts it and reads it back whole, and every format is timed from the same state."""
        paths = files(store)
        if regime == "cold":
            gc.collect()  # drop memmaps of closed readers: mapped pages cannot be evicted
            bl.drop_cache(paths)
            self.settled.pop(store, None)
            return
        written = _written(paths)  # a store written again at the same path is new files
        if self.settled.get(store) != written:
            gc.collect()
            bl.drop_cache(paths)
            self.settled[store] = written
        bl.warm_cache(paths)

    def measure(
        self,
        key: str,
        regime: str,
        op: str,
        items: Sequence[Any],
        item_nbytes: int,
        spec: CacheSpec | None = None,
        store: Path | None = None,
    ) -> Run:
        """Time ``op`` ("read", "pairs" or "gather") of a freshly opened reader over ``items``."""
        spec = spec or self.spec
        reader = self.open_reader(key, regime, spec, store)
        try:
            if op == "read":
                out = np.empty((spec.tokens, spec.d_model), DTYPE)

                def fn(q: Any) -> object:
                    return reader.read(q[0], q[1], out)

            elif op == "pairs":
                out = np.empty((self.cfg.pair_examples, 2, spec.tokens, spec.d_model), DTYPE)

                def fn(q: Any) -> object:
                    return reader.read_pairs(q[0], q[1], out)

            else:
                out = np.empty((self.cfg.gather_vectors, spec.d_model), DTYPE)

                def fn(q: Any) -> object:
                    return reader.gather(q[0], q[1], q[2], out)

            before = bl.disk_read_bytes()
            run = timed(fn, items, item_nbytes, self.cfg.budget_s)
            after = bl.disk_read_bytes()
            run.disk = after - before if before >= 0 and after >= 0 else -1
            return run
        finally:
            reader.close()

    def block(self, nbytes: int) -> int:
        """An O_DIRECT request size: ``nbytes`` rounded up to the 4 KiB block."""
        return -(-nbytes // bl.ALIGN) * bl.ALIGN

    def memcpy_limit(self, chunk: int, dst_nbytes: int | None = None) -> float:
        pool = min(1 << 30, max(64 << 20, 4 * self.cfg.limit_nbytes))
        return bl.memcpy_chunks_gbps(chunk, total=min(512 << 20, pool // 2), pool=pool, dst_nbytes=dst_nbytes)

    def sparse_examples(self, round_: int) -> Array:
        """Examples far enough apart that no readahead window around one reaches another, shuffled.

        Cold queries use these, so a read never finds a neighbour's readahead in the page cache:
        what every read meets in a cache much bigger than RAM.
        """
        gap = -(-self.readahead // self.spec.example_nbytes) + 1
        ex = np.arange(round_ % gap, self.spec.n_examples, gap)
        np.random.default_rng(500 + round_).shuffle(ex)
        return ex

    def random_limit(self, nbytes: int, threads: int = 1) -> float:
        """Random O_DIRECT reads of ``nbytes``: over our store's shard files once it exists (the same
        stretch of disk the cold reads cover), over the limit file before."""
        block = self.block(nbytes)
        n = max(32, min(4096, (self.cfg.limit_nbytes // 4) // block))
        seed = int(self.rng.integers(1 << 30))
        if "saev" in self.stores:
            shards = [p for p in files(self.stores["saev"]) if p.name.startswith("acts")]
            return bl.odirect_random_read_files(shards, block, n, threads=threads, seed=seed)[0]
        return bl.odirect_random_read(self.limit_file, block, n, threads=threads, seed=seed)[0]

    def best_peer(self, rates: dict[str, float]) -> float:
        peers = [v for k, v in rates.items() if k not in OURS and v == v]
        return max(peers) if peers else float("nan")

    def pair_layers(self, rng: np.random.Generator, b: int) -> Array:
        """``(b, 2)`` random distinct layer positions per example."""
        if self.spec.n_layers < 2:
            return np.zeros((b, 2), np.int64)
        return np.argsort(rng.random((b, self.spec.n_layers)), axis=1)[:, :2]

    def slice_queries(self, regime: str, seed: int) -> Array:
        spec, k = self.spec, self.cfg.queries
        rng = np.random.default_rng(seed)
        if regime == "cold":
            ex = self.sparse_examples(seed)[:k]
            return np.stack([ex, rng.integers(0, spec.n_layers, len(ex))], axis=1)
        return np.stack([rng.integers(0, spec.n_examples, k), rng.integers(0, spec.n_layers, k)], axis=1)

    def interleaved(
        self,
        regime: str,
        workload: str,
        make_batches: Callable[[int], list[Any]],
        piece_nbytes: int,
        item_nbytes: int,
    ) -> tuple[dict[str, Summary], float, float]:
        """Every format on round ``r``'s batches, interleaved with the limit for pieces of
        ``piece_nbytes``; a format slower than the budget per batch sits out later rounds.
        Returns each format's summary, the median limit and the best peer's GB/s."""
        cfg = self.cfg
        runs: dict[str, list[Run]] = {k: [] for k in F.FORMATS}
        limits: list[float] = []
        slow: set[str] = set()
        for r in range(cfg.rounds):
            batches = make_batches(r)
            limits.append(
                self.memcpy_limit(piece_nbytes, item_nbytes) if regime != "cold" else self.random_limit(piece_nbytes)
            )
            for key in self.keys(r):
                if key in slow:
                    continue
                run = self.measure(key, regime, workload, batches, item_nbytes)
                runs[key].append(run)
                if run.lat.max() > cfg.budget_s:
                    slow.add(key)
        sums = {k: Summary.of(v) for k, v in runs.items()}
        best = self.best_peer({k: s.gbps for k, s in sums.items()})
        return sums, statistics.median(limits), best


def _written(paths: Sequence[Path]) -> tuple[tuple[str, int, int, int], ...]:
    """Which files these are: name, inode, size and modification time of each."""
    out = []
    for p in paths:
        st = p.stat()
        out.append((str(p), st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)
