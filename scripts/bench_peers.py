"""Our reader against what a user would pick instead, on identical data, in the same run (issue 6).

Workloads (seed 000's benchmarks, plus gathers, writes and open time), each in two regimes:
page-cached (files read once just before) and cold (``POSIX_FADV_DONTNEED`` on every file
of the store just before, and queries spread further apart than the disk's readahead window,
so no read is served by an earlier one's readahead, as in a cache much bigger than RAM):

1. k random ``(example, layer)`` slice reads: mean, median, p95 latency and GB/s; a plain
   loop, then through a PyTorch DataLoader with 0, 4 and 8 workers;
2. the training pattern: batches of b random examples x 2 random distinct layers;
3. random single-token gathers: batches of 4096 ``(example, layer, token)`` vectors;
4. write throughput for the whole cache (every format ends with its files fsynced);
5. time to open a cache of 1, 100 and 10,000 shards.

Every figure is printed next to the machine's relevant limit measured in the same run,
interleaved with the contenders (memcpy, O_DIRECT sequential and random reads and writes),
and next to the best peer. Tables go to results/peers_*.md, plots to results/peers*.png.

    python scripts/bench_peers.py                 # the full comparison (a 2 GB cache, ~20 minutes)
    python scripts/bench_peers.py --quick         # tiny cache, under a minute
    python scripts/bench_peers.py --scale-only    # our cost per GB from 1 GB to 40 GB (> RAM), ~30 min
    python scripts/bench_peers.py --scale         # both
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import saev_shards as ss

if __package__ in (None, ""):  # run as a file, or imported as a top-level module from scripts/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts import benchlib as bl
from scripts import formats as F

OURS = ("saev", "saev_view")
REGIMES = ("page-cached", "cold")
Array = F.Array


# --------------------------------------------------------------------------------------
# configuration


@dataclasses.dataclass(frozen=True)
class Config:
    spec: F.CacheSpec
    queries: int  # workload 1: k random (example, layer) reads (seed 000: 10,000)
    workers: tuple[int, ...]  # DataLoader workers (seed 000: 0, 4, 8)
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
    spec=F.CacheSpec(n_examples=512, n_layers=4, tokens=128, d_model=4096, examples_per_shard=32),
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
    spec=F.CacheSpec(n_examples=32, n_layers=2, tokens=128, d_model=1024, examples_per_shard=8),
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

    def __init__(self, key: str, store: Path, spec: F.CacheSpec, queries: Array) -> None:
        self.key, self.store, self.spec, self.queries = key, store, spec, queries
        self._reader: F.Reader | None = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.queries)

    def __getitem__(self, j: int) -> tuple[Any, float]:
        import torch

        if self._reader is None or self._pid != os.getpid():
            self._reader = F.FORMATS[self.key].open(self.store, self.spec)
            self._pid = os.getpid()
        e, layer = self.queries[j].tolist()
        out = np.empty((self.spec.tokens, self.spec.d_model), F.DTYPE)
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
# the benchmark


class Bench:
    def __init__(self, cfg: Config, keep: bool = False) -> None:
        self.cfg = cfg
        self.spec = cfg.spec
        self.keep = keep
        self.dir = bl.bench_dir() / "peers"
        F.remove(self.dir)
        self.dir.mkdir(parents=True)
        self.limit_file = self.dir / "limit.bin"
        self.stores: dict[str, Path] = {}
        self.results: dict[str, Any] = {}  # for the plots and the targets
        self.rng = np.random.default_rng(0)
        self.source: F.Source | None = None
        self.readahead = bl.readahead_nbytes(self.dir)

    # -- helpers ------------------------------------------------------------------
    def keys(self, round_: int = 0) -> list[str]:
        """Every row, rotated by round so no format always runs first."""
        keys = list(F.FORMATS)
        r = round_ % len(keys)
        return keys[r:] + keys[:r]

    def open_reader(
        self, key: str, regime: str, spec: F.CacheSpec | None = None, store: Path | None = None
    ) -> F.Reader:
        """Open ``key``'s store after warming its files (page-cached) or evicting them (cold)."""
        store = store or self.stores[key]
        paths = F.files(store)
        if regime == "cold":
            gc.collect()  # drop memmaps of closed readers: mapped pages cannot be evicted
            bl.drop_cache(paths)
        else:
            bl.warm_cache(paths)
        return F.FORMATS[key].open(store, spec or self.spec)

    def measure(
        self,
        key: str,
        regime: str,
        op: str,
        items: Sequence[Any],
        item_nbytes: int,
        spec: F.CacheSpec | None = None,
        store: Path | None = None,
    ) -> Run:
        """Time ``op`` ("read", "pairs" or "gather") of a freshly opened reader over ``items``."""
        spec = spec or self.spec
        reader = self.open_reader(key, regime, spec, store)
        try:
            if op == "read":
                out = np.empty((spec.tokens, spec.d_model), F.DTYPE)

                def fn(q: Any) -> object:
                    return reader.read(q[0], q[1], out)

            elif op == "pairs":
                out = np.empty((self.cfg.pair_examples, 2, spec.tokens, spec.d_model), F.DTYPE)

                def fn(q: Any) -> object:
                    return reader.read_pairs(q[0], q[1], out)

            else:
                out = np.empty((self.cfg.gather_vectors, spec.d_model), F.DTYPE)

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
            shards = [p for p in F.files(self.stores["saev"]) if p.name.startswith("acts")]
            return bl.odirect_random_read_files(shards, block, n, threads=threads, seed=seed)[0]
        return bl.odirect_random_read(self.limit_file, block, n, threads=threads, seed=seed)[0]

    def best_peer(self, rates: dict[str, float]) -> float:
        peers = [v for k, v in rates.items() if k not in OURS and v == v]
        return max(peers) if peers else float("nan")

    # -- limits -------------------------------------------------------------------
    def limits(self) -> None:
        spec, cfg = self.spec, self.cfg
        write_nbytes = cfg.limit_nbytes
        fns = {
            "memcpy": lambda: bl.memcpy_gbps(min(256 << 20, cfg.limit_nbytes)),
            "memcpy_slice": lambda: self.memcpy_limit(spec.slice_nbytes),
            "memcpy_vector": lambda: self.memcpy_limit(spec.vector_nbytes),
            "write": lambda: bl.odirect_write_gbps(self.limit_file, write_nbytes),
            "read": lambda: bl.odirect_read_gbps(self.limit_file),
            "rand4k": lambda: self.random_limit(4096),
            "rand1m": lambda: self.random_limit(1 << 20),
            "rand_slice": lambda: self.random_limit(spec.slice_nbytes),
            "rand_vector": lambda: self.random_limit(spec.vector_nbytes),
        }
        got = bl.interleaved(fns, rounds=max(1, cfg.rounds))
        iops4k = self.random_limit(4096) / 4096 * 1e9
        self.results["limits"] = got
        t = bl.Table("peers_limits", "The machine's limits (same run)", ["limit", "GB/s", "how"])
        slice_kib = f"{spec.slice_nbytes / 1024:.0f} KiB"
        vec_kib = f"{self.block(spec.vector_nbytes) / 1024:.0f} KiB"
        rows = [
            ("memcpy", got["memcpy"], "numpy copyto of a large buffer, best of 5"),
            (f"memcpy of {slice_kib} pieces", got["memcpy_slice"], "random offsets of a big buffer into one buffer"),
            (f"memcpy of {spec.vector_nbytes} B pieces", got["memcpy_vector"], "same, vector-sized"),
            ("O_DIRECT sequential write", got["write"], f"{write_nbytes >> 20} MiB in 8 MiB requests, then fsync"),
            ("O_DIRECT sequential read", got["read"], "the same file, 8 MiB requests"),
            ("O_DIRECT random 4 KiB reads", got["rand4k"], f"one thread, ~{iops4k:,.0f} reads/s"),
            ("O_DIRECT random 1 MiB reads", got["rand1m"], "one thread"),
            (f"O_DIRECT random {slice_kib} reads (a slice)", got["rand_slice"], "one thread"),
            (f"O_DIRECT random {vec_kib} reads (a vector)", got["rand_vector"], "one thread"),
        ]
        for row in rows:
            t.add(*row)
        t.note(f"Medians of {max(1, cfg.rounds)} interleaved rounds. Machine: {bl.machine()}.")
        t.note("Each workload below re-measures its own limit, interleaved with its rounds.")
        t.emit()

    # -- workload 4: writes -------------------------------------------------------
    def writes(self) -> None:
        spec, cfg = self.spec, self.cfg
        assert self.source is not None
        sample_nbytes = min(512 << 20, cfg.limit_nbytes)
        order = [k for k in F.FORMATS if F.FORMATS[k].files_of is None]
        extra = ["saev*"] * (cfg.write_rounds - 1)
        # Our repeats go between the peers, so drift hits everyone alike.
        sequence: list[str] = []
        for i, k in enumerate(order):
            sequence.append(k)
            if extra and i in (2, 4):
                sequence.append(extra.pop())
        sequence += extra
        limits = [bl.odirect_write_gbps(self.limit_file, sample_nbytes)]
        rates: dict[str, list[tuple[float, float]]] = {}
        for k in sequence:
            key = k.rstrip("*")
            root = self.dir / (f"{key}-scratch" if k.endswith("*") else key)
            F.remove(root)
            root.mkdir()
            gc.collect()
            t0 = time.perf_counter()
            store = F.FORMATS[key].write(root, spec, self.source, True)
            dt = time.perf_counter() - t0
            limits.append(bl.odirect_write_gbps(self.limit_file, sample_nbytes))
            limit = (limits[-2] + limits[-1]) / 2
            rates.setdefault(key, []).append((spec.nbytes / dt / 1e9, limit))
            if k.endswith("*"):
                F.remove(root)
            else:
                self.stores[key] = store
            print(f"  wrote {F.FORMATS[key].name}: {dt:.1f} s", flush=True)
        for k, fmt in F.FORMATS.items():
            if fmt.files_of:
                self.stores[k] = self.stores[fmt.files_of]
        gbps = {k: statistics.median(g for g, _ in v) for k, v in rates.items()}
        x_limit = {k: statistics.median(g / lim for g, lim in v) for k, v in rates.items()}
        best = self.best_peer(gbps)
        t = bl.Table(
            "peers_write",
            "Workload 4: writing the whole cache",
            ["format", "n", "s", "GB/s", "x O_DIRECT write", "x best peer", "on disk GB", "files"],
        )
        for k in order:
            paths = F.files(self.stores[k])
            size = sum(p.stat().st_size for p in paths)
            t.add(
                F.FORMATS[k].name,
                len(rates[k]),
                spec.nbytes / 1e9 / gbps[k],
                gbps[k],
                x_limit[k],
                ratio(gbps[k], best),
                size / 1e9,
                len(paths),
            )
        t.note(f"Data: {spec.describe()}, from memory (views of a random pool).")
        t.note(
            "Every writer ends with all its files and folders fsynced (ours: `ShardWriter` with its defaults, "
            "xxh3 checksums and a background thread). x O_DIRECT write: against the mean of the O_DIRECT "
            f"sequential write rate measured ({sample_nbytes >> 20} MiB) just before and just after that write; "
            f"median {statistics.median(limits):.2f} GB/s over {len(limits)} samples. n: times written (ours is "
            "repeated between the peers)."
        )
        t.emit()
        self.results["write"] = {"gbps": gbps, "x_limit": x_limit, "limit": statistics.median(limits)}

    # -- correctness ----------------------------------------------------------------
    def verify(self) -> None:
        """Every reader returns the source's values (a benchmark of wrong data is void)."""
        spec = self.spec
        assert self.source is not None
        rng = np.random.default_rng(1)
        # A few examples in the first, a middle and the last shard: enough to catch wrong offsets
        # without making pickle.gz decompress every shard.
        examples = np.array([0, 1, spec.n_examples // 2, spec.n_examples - 1])
        for key in F.FORMATS:
            reader = self.open_reader(key, "page-cached")
            try:
                for e in examples[[0, 2, 3]].tolist():
                    layer = int(rng.integers(spec.n_layers))
                    got = reader.read(e, layer, np.empty((spec.tokens, spec.d_model), F.DTYPE))
                    if not np.array_equal(got, self.source.example(e)[layer]):
                        raise RuntimeError(f"{key}: read({e}, {layer}) returned wrong values")
                ex = examples[[3, 1]]
                layers = self.pair_layers(rng, 2)
                got = reader.read_pairs(ex, layers, np.empty((2, 2, spec.tokens, spec.d_model), F.DTYPE))
                want = np.stack([self.source.example(int(e))[lay] for e, lay in zip(ex, layers, strict=True)])
                if not np.array_equal(got, want):
                    raise RuntimeError(f"{key}: read_pairs returned wrong values")
                g = [rng.choice(examples, 8), *(rng.integers(0, n, 8) for n in spec.shape[1:3])]
                got = reader.gather(g[0], g[1], g[2], np.empty((8, spec.d_model), F.DTYPE))
                want = np.stack([self.source.example(int(e))[lay, t] for e, lay, t in zip(*g, strict=True)])
                if not np.array_equal(got, want):
                    raise RuntimeError(f"{key}: gather returned wrong values")
            finally:
                reader.close()
        print("  every reader returned the written values", flush=True)

    def pair_layers(self, rng: np.random.Generator, b: int) -> Array:
        """``(b, 2)`` random distinct layer positions per example."""
        if self.spec.n_layers < 2:
            return np.zeros((b, 2), np.int64)
        return np.argsort(rng.random((b, self.spec.n_layers)), axis=1)[:, :2]

    # -- workload 1: random (example, layer) slices ---------------------------------------
    def slice_queries(self, regime: str, seed: int) -> Array:
        spec, k = self.spec, self.cfg.queries
        rng = np.random.default_rng(seed)
        if regime == "cold":
            ex = self.sparse_examples(seed)[:k]
            return np.stack([ex, rng.integers(0, spec.n_layers, len(ex))], axis=1)
        return np.stack([rng.integers(0, spec.n_examples, k), rng.integers(0, spec.n_layers, k)], axis=1)

    def slices(self, regime: str) -> None:
        spec, cfg = self.spec, self.cfg
        runs: dict[str, list[Run]] = {k: [] for k in F.FORMATS}
        limits: list[float] = []
        slow: set[str] = set()
        for r in range(cfg.rounds):
            queries = self.slice_queries(regime, seed=r)
            limits.append(
                self.memcpy_limit(spec.slice_nbytes) if regime != "cold" else self.random_limit(spec.slice_nbytes)
            )
            for key in self.keys(r):
                if key in slow:
                    continue
                run = self.measure(key, regime, "read", queries.tolist(), spec.slice_nbytes)
                runs[key].append(run)
                if run.lat.max() > cfg.budget_s:
                    slow.add(key)  # one item outlasts the budget: one round is enough
        loop = {k: Summary.of(v) for k, v in runs.items()}
        limit = statistics.median(limits)
        rows: list[tuple[str, str, Summary, float]] = [(k, "loop", s, limit) for k, s in loop.items()]
        skipped: list[str] = []
        for w in cfg.workers:
            w_limit = (
                self.memcpy_limit(spec.slice_nbytes)
                if regime != "cold"
                else self.random_limit(spec.slice_nbytes, max(1, w))
            )
            queries = self.slice_queries(regime, seed=200 + w)
            for key in self.keys(w):
                per_batch = loop[key].mean * cfg.loader_batch * (1 + w / 2 if w else 1)
                if per_batch > cfg.budget_s * 2:
                    skipped.append(f"{F.FORMATS[key].name} (w={w}: one batch would take ~{per_batch:.0f} s)")
                    continue
                paths = F.files(self.stores[key])
                if regime == "cold":
                    gc.collect()
                    bl.drop_cache(paths)
                else:
                    bl.warm_cache(paths)
                ds = SliceDataset(key, self.stores[key], spec, queries)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # torch: non-writable numpy arrays
                    before = bl.disk_read_bytes()
                    run = loader_run(ds, w, cfg.loader_batch, cfg.budget_s)
                    if w == 0 and before >= 0:  # workers' reads are not in our /proc/self/io
                        run.disk = bl.disk_read_bytes() - before
                rows.append((key, f"DataLoader w={w}", Summary.of([run]), w_limit))
        order = {k: i for i, k in enumerate(F.FORMATS)}
        rows.sort(key=lambda r: (r[1] != "loop", r[1], order[r[0]]))
        name = "peers_slices_cached" if regime != "cold" else "peers_slices_cold"
        t = bl.Table(
            name,
            f"Workload 1: random (example, layer) slice reads, {regime}",
            ["format", "mode", "n", "mean ms", "median ms", "p95 ms", "GB/s", "x limit", "x best peer", "disk/read"],
        )
        by_mode: dict[str, dict[str, float]] = {}
        for key, mode, s, _ in rows:
            by_mode.setdefault(mode, {})[key] = s.gbps
        for key, mode, s, lim in rows:
            best = self.best_peer(by_mode[mode])
            t.add(
                F.FORMATS[key].name,
                mode,
                s.n,
                ms(s.mean),
                ms(s.median),
                ms(s.p95),
                s.gbps,
                ratio(s.gbps, lim),
                ratio(s.gbps, best),
                s.amplification,
            )
        slice_kib = f"{spec.slice_nbytes / 1024:.0f} KiB"
        if regime == "cold":
            t.note(
                f"Cold: every file of the store evicted (POSIX_FADV_DONTNEED) and the reader opened anew before each "
                f"measurement; the queries are one random layer of examples spaced more than the disk's readahead "
                f"window ({self.readahead >> 10} KiB) apart, so no read finds another's readahead in the page cache "
                f"(as in a cache much bigger than RAM). Limit: random O_DIRECT reads of {slice_kib} "
                f"(one slice) over our store's shard files, with as many threads as workers (1 for the loop), median "
                f"{limit:.2f} GB/s for one thread."
            )
        else:
            t.note(
                f"Page-cached: the store's files read once just before each measurement. Limit: memcpy of {slice_kib} "
                f"pieces from random offsets (one thread), median {limit:.2f} GB/s."
            )
        t.note(
            f"Latency is one read call (for DataLoader rows, measured inside the worker); GB/s is slices x "
            f"{slice_kib} / wall time (DataLoader rows: from the first batch on, so worker start-up is excluded, "
            f"and they include the default collate's copy into a batch of {cfg.loader_batch}). The loop is the "
            f"median of {cfg.rounds} interleaved rounds. Workers 4 and 8 share {os.cpu_count()} cores."
        )
        t.note(DISK_NOTE)
        if self.cfg.label == "quick" and regime == "cold":
            t.note(
                "Quick run: the files are a few MiB, no bigger than one readahead window, so opening a store or "
                "the first read pulls in whole files: cold figures here mean little. Use the full run."
            )
        if skipped:
            t.note("Not run through the DataLoader: " + "; ".join(skipped) + ".")
        for line in self.cfg.describe()[:2]:
            t.note(line)
        t.note("Formats: " + " ".join(f"**{f.name}**: {f.note}." for f in F.FORMATS.values()))
        t.emit()
        self.results[f"slices_{regime}"] = {"gbps": {k: s.gbps for k, s in loop.items()}, "limit": limit, "loop": loop}

    # -- workload 1 at other slice sizes ------------------------------------------------------
    def slice_sizes(self) -> None:
        """Page-cached random slices of other (T, D) shapes: how the ratios depend on the slice size."""
        cfg = self.cfg
        if not cfg.sweep_shapes:
            return
        keys = [k for k in F.FORMATS if k != "pickle_gz"]  # far below everyone at 1 MiB already
        t = bl.Table(
            "peers_slice_sizes",
            "Workload 1 at other slice sizes: random (example, layer) reads, page-cached, plain loop",
            [
                "slice (T, D)",
                "KiB",
                "saev_shards GB/s",
                "mean us",
                "x memcpy",
                "best peer",
                "best peer GB/s",
                "x best peer",
                "x zarr v2",
                "x h5py",
            ],
        )
        rows = []
        for tokens, d_model in (*cfg.sweep_shapes, (self.spec.tokens, self.spec.d_model)):
            if (tokens, d_model) == (self.spec.tokens, self.spec.d_model):
                res = self.results["slices_page-cached"]
                loop = res["loop"]
                limit = res["limit"]
            else:
                example = self.spec.n_layers * tokens * d_model * F.DTYPE.itemsize
                eps = max(1, (32 << 20) // example)
                spec = F.CacheSpec(
                    n_examples=max(eps, cfg.sweep_nbytes // example),
                    n_layers=self.spec.n_layers,
                    tokens=tokens,
                    d_model=d_model,
                    examples_per_shard=eps,
                )
                source = F.Source(spec, extra_nbytes=16 << 20)
                stores: dict[str, Path] = {}
                for key in keys:
                    fmt = F.FORMATS[key]
                    if fmt.files_of:
                        stores[key] = stores[fmt.files_of]
                        continue
                    root = self.dir / f"size-{key}"
                    F.remove(root)
                    root.mkdir()
                    stores[key] = fmt.write(root, spec, source, False)
                del source
                runs: dict[str, list[Run]] = {k: [] for k in keys}
                limits = []
                for r in range(cfg.rounds):
                    rng = np.random.default_rng(600 + r)
                    queries = np.stack(
                        [rng.integers(0, spec.n_examples, cfg.queries), rng.integers(0, spec.n_layers, cfg.queries)],
                        axis=1,
                    ).tolist()
                    limits.append(self.memcpy_limit(spec.slice_nbytes))
                    for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
                        runs[key].append(
                            self.measure(key, "page-cached", "read", queries, spec.slice_nbytes, spec, stores[key])
                        )
                for key, store in stores.items():
                    if not F.FORMATS[key].files_of:
                        F.remove(store.parent)
                loop = {k: Summary.of(v) for k, v in runs.items()}
                limit = statistics.median(limits)
            peers = {k: v.gbps for k, v in loop.items() if k not in OURS and k in keys}
            best = max(peers, key=lambda k: peers[k])
            ours = loop["saev"]
            kib = tokens * d_model * F.DTYPE.itemsize / 1024
            rows.append((tokens, d_model))
            t.add(
                f"({tokens}, {d_model})",
                kib,
                ours.gbps,
                ours.mean * 1e6,
                ratio(ours.gbps, limit),
                F.FORMATS[best].name,
                peers[best],
                ratio(ours.gbps, peers[best]),
                ratio(ours.gbps, peers["zarr2"]),
                ratio(ours.gbps, peers["h5"]),
            )
            self.results.setdefault("sizes", []).append(
                {"kib": kib, "ours": ours.gbps, "zarr2": peers["zarr2"], "h5": peers["h5"], "best": peers[best]}
            )
        t.note(
            f"Each other shape gets its own ~{cfg.sweep_nbytes >> 20} MiB cache in every format but pickle.gz "
            f"({self.spec.n_layers} layers, same adapters as above); the last row is workload 1's. "
            f"k={cfg.queries} queries, median of {cfg.rounds} interleaved rounds; x memcpy: against memcpy of "
            "slice-sized pieces measured alongside. Per-call overheads (zarr ~1 ms, h5py ~0.1 ms) weigh more on "
            "small slices, so the ratios to the peers grow as slices shrink, while big slices approach memcpy."
        )
        t.emit()

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

    # -- workload 2: b examples x 2 layers -------------------------------------------------
    def pairs(self) -> None:
        spec, cfg = self.spec, self.cfg
        b = cfg.pair_examples
        item_nbytes = b * 2 * spec.slice_nbytes
        t = bl.Table(
            "peers_pairs",
            f"Workload 2: training batches of b={b} random examples x 2 random distinct layers",
            ["regime", "format", "n", "mean ms", "p95 ms", "GB/s", "x limit", "x best peer", "disk/read"],
        )
        self.results["pairs"] = {}
        for regime in REGIMES:

            def make_batches(r: int, regime: str = regime) -> list[Any]:
                rng = np.random.default_rng(300 + r)
                if regime == "cold":
                    ex = self.sparse_examples(r)
                    if len(ex) < b:  # a cache too small to space b examples out (the quick run)
                        ex = rng.permutation(spec.n_examples)[:b]
                    n = max(1, min(cfg.pair_batches, len(ex) // b))
                    return [(ex[i * b : (i + 1) * b], self.pair_layers(rng, b)) for i in range(n)]
                examples = (rng.integers(0, spec.n_examples, b) for _ in range(cfg.pair_batches))
                return [(ex, self.pair_layers(rng, b)) for ex in examples]

            sums, limit, best = self.interleaved(regime, "pairs", make_batches, spec.slice_nbytes, item_nbytes)
            for key, s in sums.items():
                t.add(
                    regime,
                    F.FORMATS[key].name,
                    s.n,
                    ms(s.mean),
                    ms(s.p95),
                    s.gbps,
                    ratio(s.gbps, limit),
                    ratio(s.gbps, best),
                    s.amplification,
                )
            self.results["pairs"][regime] = {"gbps": {k: s.gbps for k, s in sums.items()}, "limit": limit}
        lim = self.results["pairs"]
        t.note(
            f"A batch is ({b}, 2, T, D) = {item_nbytes / 2**20:.0f} MiB. Latency per batch; GB/s median of "
            f"{cfg.rounds} interleaved rounds. Limits: page-cached, memcpy of slice-sized pieces from random "
            f"offsets into a batch-sized buffer ({lim['page-cached']['limit']:.2f} GB/s); cold, one-thread random "
            f"O_DIRECT reads of one slice ({lim['cold']['limit']:.2f} GB/s). Cold batches draw their examples from "
            "a set spaced wider than the readahead window (workload 1)."
        )
        t.note(DISK_NOTE)
        t.note(
            "Ours: `read_examples` (one pread per slice into the batch); numpy: fancy indexing "
            "`mm[ex[:, None], layers]`; the others: one read per slice into the batch."
        )
        t.emit()

    # -- workload 3: single-token gathers ----------------------------------------------------
    def gathers(self) -> None:
        spec, cfg = self.spec, self.cfg
        n = cfg.gather_vectors
        item_nbytes = n * spec.vector_nbytes
        t = bl.Table(
            "peers_gather",
            f"Workload 3: random single-token gathers, batches of {n} (example, layer, token) vectors",
            ["regime", "format", "n", "mean ms", "vectors/s", "GB/s", "x limit", "x best peer", "disk/read"],
        )
        self.results["gather"] = {}
        for regime in REGIMES:
            n_batches = cfg.gather_batches if regime != "cold" else 1  # one batch right after eviction

            def make_batches(r: int, n_batches: int = n_batches) -> list[Any]:
                rng = np.random.default_rng(400 + r)
                return [tuple(rng.integers(0, m, n) for m in spec.shape[:3]) for _ in range(n_batches)]

            sums, limit, best = self.interleaved(regime, "gather", make_batches, spec.vector_nbytes, item_nbytes)
            for key, s in sums.items():
                t.add(
                    regime,
                    F.FORMATS[key].name,
                    s.n,
                    ms(s.mean),
                    s.items_per_s * n,
                    s.gbps,
                    ratio(s.gbps, limit),
                    ratio(s.gbps, best),
                    s.amplification,
                )
            self.results["gather"][regime] = {"gbps": {k: s.gbps for k, s in sums.items()}, "limit": limit}
        lim = self.results["gather"]
        block = self.block(spec.vector_nbytes)
        t.note(
            f"A vector is {spec.vector_nbytes} B; a batch {item_nbytes / 2**20:.0f} MiB; n counts batches. Limits: "
            f"page-cached, memcpy of vector-sized pieces from random offsets into a batch-sized buffer "
            f"({lim['page-cached']['limit']:.2f} GB/s); cold, one-thread random O_DIRECT reads of {block} B "
            f"({lim['cold']['limit']:.3f} GB/s, {lim['cold']['limit'] * 1e9 / block:,.0f} reads/s). A cold "
            f"measurement is one batch right after the store is evicted; its {n} random vectors of a "
            f"{spec.nbytes / 1e9:.1f} GB cache lie "
            f"~{spec.nbytes / n / 2**20:.1f} MiB apart, closer than the readahead window ({self.readahead >> 10} "
            "KiB), so readers that read ahead are served some vectors by earlier ones' readahead; on a cache much "
            "bigger than RAM that readahead would be waste (see disk/read)."
        )
        t.note(DISK_NOTE)
        t.note(
            "Ours: `layout.locate_many` then one pread per vector (saev_shards), or numpy indexing "
            "`shards[ex, layer, tok]` on the memmaps (view); numpy: `mm[ex, layer, tok]`; zarr reads the whole "
            "(1, 1, T, D) chunk of every vector; pickle.gz decompresses every shard the batch touches."
        )
        t.emit()

    # -- workload 5: open ---------------------------------------------------------------------
    def opens(self) -> None:
        cfg = self.cfg
        keys = [k for k in F.FORMATS if F.FORMATS[k].files_of is None]
        times: dict[str, dict[int, float]] = {k: {} for k in keys}
        for count in cfg.open_shards:
            spec = F.CacheSpec(n_examples=count, n_layers=2, tokens=4, d_model=8, examples_per_shard=1)
            source = F.Source(spec, extra_nbytes=1 << 20)
            stores = {}
            for key in keys:
                root = self.dir / f"open-{key}-{count}"
                F.remove(root)
                root.mkdir()
                stores[key] = F.FORMATS[key].write(root, spec, source, False)
            samples: dict[str, list[float]] = {k: [] for k in keys}
            for r in range(5):
                for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
                    gc.collect()
                    t0 = time.perf_counter()
                    reader = F.FORMATS[key].open(stores[key], spec)
                    samples[key].append(time.perf_counter() - t0)
                    reader.close()
            for key in keys:
                times[key][count] = statistics.median(samples[key])
                F.remove(stores[key].parent)
            print(f"  open: {count} shards done", flush=True)
        t = bl.Table(
            "peers_open",
            "Workload 5: time to open a cache",
            ["format", *[f"{c:,} shards ms" for c in cfg.open_shards], f"x best peer ({cfg.open_shards[-1]:,})"],
        )
        last = cfg.open_shards[-1]
        best = min(v[last] for k, v in times.items() if k not in OURS)
        for key in keys:
            t.add(F.FORMATS[key].name, *[ms(times[key][c]) for c in cfg.open_shards], ratio(best, times[key][last]))
        t.note(
            "Caches of 1 example per shard (2 layers x 4 tokens x 8 dims), so a cache of n shards has n examples; "
            "median of 5 interleaved opens, metadata in the page cache. x best peer: the best peer's time over "
            "this one's."
        )
        t.note(
            "What open does. Ours: `saev_shards.open` (parses metadata.json and shards.json, checks the hash and "
            "the name and exact size of every shard file). numpy: `np.load(mmap_mode='r')` (one file whatever the "
            "shard count). zarr v2/v3: `open_consolidated` + the array (one store; zarr v3 has one file per shard). "
            "HDF5: `h5py.File` + the dataset (one file). safetensors: `safe_open` of every shard file. pickle.gz: "
            "parse metadata.json (seed 001's ActivationDataset would also load every shard to build its index)."
        )
        t.emit()
        self.results["open"] = times

    # -- targets ----------------------------------------------------------------------------
    def targets(self) -> None:
        res = self.results
        t = bl.Table("peers_targets", "Targets (issue 6)", ["target", "measured", "met"])

        def add(name: str, value: float, goal: float, fmt: str, lower_is_better: bool = False) -> None:
            if value != value:
                t.add(name, "n/a", "not measured")
                return
            met = value <= goal if lower_is_better else value >= goal
            t.add(name, fmt.format(value), "yes" if met else "**no**")

        cached = res.get("slices_page-cached")
        if cached:
            ours = cached["gbps"]["saev"]
            add(
                "random slices, page-cached: >= 0.8 x memcpy (slice-sized pieces)",
                ours / cached["limit"],
                0.8,
                "{:.3f} x",
            )
            add(
                "  same, against large-buffer memcpy",
                ours / res["limits"]["memcpy"],
                0.8,
                "{:.3f} x",
            )
            add(
                "random slices, page-cached: >= 15 x zarr (v2, seed 000)",
                ours / cached["gbps"]["zarr2"],
                15,
                "{:.1f} x",
            )
            add("random slices, page-cached: >= 2.5 x h5py", ours / cached["gbps"]["h5"], 2.5, "{:.1f} x")
        cold = res.get("slices_cold")
        if cold:
            add(
                "random slices, cold: >= 0.8 x random O_DIRECT reads of a slice",
                cold["gbps"]["saev"] / cold["limit"],
                0.8,
                "{:.3f} x",
            )
        if "write" in res:
            add("writes: >= 0.85 x sequential O_DIRECT write", res["write"]["x_limit"]["saev"], 0.85, "{:.3f} x")
        if "open" in res:
            counts = sorted(res["open"]["saev"])
            last = counts[-1]
            add(
                f"open {last:,} shards: < 50 ms", res["open"]["saev"][last] * 1e3, 50, "{:.1f} ms", lower_is_better=True
            )
            if last < 10_000:
                t.note(f"The quick run opens at most {last:,} shards; the target is for 10,000 (full run).")
        t.note(f"Slice = {self.spec.slice_nbytes / 1024:.0f} KiB. Ours is `read_example` in a plain loop (workload 1).")
        t.emit()

    # -- all ----------------------------------------------------------------------------------
    def run(self) -> None:
        started = time.perf_counter()
        print(f"# saev_shards against its peers ({self.cfg.label} run)\n", flush=True)
        for line in self.cfg.describe():
            print(f"- {line}")
        print(f"- machine: {bl.machine()}\n", flush=True)
        try:
            import h5py  # noqa: F401 - every library imported before anything is timed
            import safetensors  # noqa: F401
            import torch
            import zarr  # noqa: F401

            # One intra-op thread, as in DataLoader workers: with 2 threads on a busy 2-core machine,
            # OpenMP's spinning made the main process's collate 30x slower.
            torch.set_num_threads(1)
            gc.freeze()  # the libraries' objects stay out of the collections we force before evicting
            self.source = F.Source(self.spec)
            steps: list[tuple[str, Callable[[], None]]] = [
                ("limits", self.limits),
                ("writes", self.writes),
                ("verify", self.verify),
                ("slices page-cached", lambda: self.slices("page-cached")),
                ("slices cold", lambda: self.slices("cold")),
                ("slice sizes", self.slice_sizes),
                ("pairs", self.pairs),
                ("gathers", self.gathers),
                ("open", self.opens),
                ("targets", self.targets),
            ]
            for name, step in steps:
                t0 = time.perf_counter()
                step()
                print(f"  [{name}: {time.perf_counter() - t0:.1f} s]\n", flush=True)
                if name == "gathers":
                    self.source = None
            if self.cfg.label == "quick":
                print("plots: skipped in the quick run")
            else:
                from scripts import plots

                for path in plots.peers(self.results, self.spec, bl.results_dir()):
                    print(f"plot: {path}")
        finally:
            if not self.keep:
                F.remove(self.dir)
        print(f"\nbench_peers took {time.perf_counter() - started:.0f} s", flush=True)


# --------------------------------------------------------------------------------------
# --scale: our cost per GB as the cache grows past RAM


def _spread_read_gbps(files: Sequence[Path], seed: int, picks: int = 6, nbytes: int = 64 << 20) -> float:
    """Sequential O_DIRECT reads of ``nbytes`` from each of ``picks`` files spread over the cache:
    the disk's sequential rate over the same stretch of disk as a full pass."""
    rng = np.random.default_rng(seed)
    chosen = rng.choice(len(files), min(picks, len(files)), replace=False)
    seconds = 0.0
    total = 0
    for i in chosen.tolist():
        size = os.stat(files[i]).st_size
        n = min(nbytes, size - size % bl.DIRECT_BLOCK)
        if n:
            seconds += n / (bl.odirect_read_gbps(files[i], limit=nbytes) * 1e9)
            total += n
    return total / seconds / 1e9 if seconds else float("nan")


def run_scale(sizes_gb: Sequence[float], keep: bool = False) -> None:
    base = F.CacheSpec(n_examples=1, n_layers=4, tokens=128, d_model=4096, examples_per_shard=64)
    out_dir = bl.bench_dir() / "scale"
    F.remove(out_dir)
    out_dir.mkdir(parents=True)
    limit_file = out_dir / "limit.bin"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    t = bl.Table(
        "peers_scale",
        "--scale: our cost per GB as the cache grows (cold)",
        [
            "cache GB",
            "write s/GB",
            "x O_DIRECT write",
            "random slices s/GB",
            "x O_DIRECT random",
            "sequential read s/GB",
            "x O_DIRECT read",
            "open ms",
        ],
    )
    t.note(
        f"Slices of {base.slice_nbytes >> 20} MiB ((T, D) = ({base.tokens}, {base.d_model}) float16, "
        f"{base.n_layers} layers), shards of {base.examples_per_shard * base.example_nbytes >> 20} MiB. RAM: "
        f"{ram / 2**30:.0f} GiB. Per size: write the cache (`ShardWriter`, fsync), evict it, 2,000 random "
        "distinct slices with `read_example`, evict, read it all with `read_range` one shard at a time; then "
        "delete it. Each is next to the mean of its O_DIRECT limit measured just before and just after: a "
        "512 MiB sequential write, random slice-sized reads and 64 MiB sequential reads from 6 random shards, "
        "on the cache's own shard files "
        "(a small limit file could be served by a host-side cache). The O_DIRECT read limit keeps one 8 MiB "
        "request in flight; large buffered reads keep several (readahead), so they can beat it."
    )
    t.note(f"Machine: {bl.machine()}.")
    rows: list[dict[str, float]] = []
    try:
        for size in sizes_gb:
            n = max(base.examples_per_shard, round(size * 1e9 / base.example_nbytes))
            spec = dataclasses.replace(base, n_examples=n)
            free = shutil.disk_usage(out_dir).free
            if free < spec.nbytes + (4 << 30):
                t.note(f"Stopped before {size:g} GB: {free / 1e9:.0f} GB free on the disk.")
                break
            source = F.Source(spec)
            w0 = bl.odirect_write_gbps(limit_file, 512 << 20)
            root = out_dir / "cache"
            F.remove(root)
            root.mkdir()
            t0 = time.perf_counter()
            store = F.write_saev(root, spec, source)
            write_s = time.perf_counter() - t0
            del source
            w1 = bl.odirect_write_gbps(limit_file, 512 << 20)
            opens = []
            for _ in range(5):
                t0 = time.perf_counter()
                shards = ss.open(store)
                opens.append(time.perf_counter() - t0)
                shards.close()
            files = F.files(store)
            shard_files = [p for p in files if p.name.startswith("acts")]
            # Limits on the cache's own files: a small limit file may sit in a host-side cache.
            r0 = bl.odirect_random_read_files(shard_files, base.slice_nbytes, 256, seed=1)[0]
            bl.drop_cache(files)
            reader = F.SaevReader(store, spec)
            rng = np.random.default_rng(0)
            k = min(2000, n * spec.n_layers)
            pick = rng.permutation(n * spec.n_layers)[:k]
            out = np.empty((spec.tokens, spec.d_model), F.DTYPE)
            t0 = time.perf_counter()
            for p in pick.tolist():
                reader.read(p // spec.n_layers, p % spec.n_layers, out)
            rand_s = time.perf_counter() - t0
            reader.close()
            r1 = bl.odirect_random_read_files(shard_files, base.slice_nbytes, 256, seed=2)[0]
            s0 = _spread_read_gbps(shard_files, 0)
            bl.drop_cache(files)
            shards = ss.open(store)
            buf = np.empty((spec.examples_per_shard, *spec.shape[1:]), F.DTYPE)
            t0 = time.perf_counter()
            for k_ in range(spec.n_shards):
                start, stop = spec.shard_range(k_)
                shards.read_range(start, stop, buf[: stop - start])
            seq_s = time.perf_counter() - t0
            shards.close()
            s1 = _spread_read_gbps(shard_files, 1)
            F.remove(root)
            gbytes = spec.nbytes / 1e9
            rand_gb = k * spec.slice_nbytes / 1e9
            row = {
                "gb": gbytes,
                "write": write_s / gbytes,
                "write_x": gbytes / write_s / ((w0 + w1) / 2),
                "rand": rand_s / rand_gb,
                "rand_x": rand_gb / rand_s / ((r0 + r1) / 2),
                "seq": seq_s / gbytes,
                "seq_x": gbytes / seq_s / ((s0 + s1) / 2),
                "open": statistics.median(opens) * 1e3,
            }
            rows.append(row)
            t.add(
                gbytes,
                row["write"],
                row["write_x"],
                row["rand"],
                row["rand_x"],
                row["seq"],
                row["seq_x"],
                row["open"],
            )
            print(t.render(), flush=True)
    finally:
        if not keep:
            F.remove(out_dir)
    if rows:
        flat = [max(r[c] for r in rows) / min(r[c] for r in rows) for c in ("write", "rand", "seq")]
        t.note(
            f"Spread (largest / smallest cost per GB across sizes): write {flat[0]:.2f}, random slices "
            f"{flat[1]:.2f}, sequential read {flat[2]:.2f}; the disk's own limits drift as much (see the x columns)."
        )
    t.emit()
    if rows:
        from scripts import plots

        print(f"plot: {plots.scale(rows, bl.results_dir())}")


# --------------------------------------------------------------------------------------


SCALE_SIZES = (1.0, 2.0, 5.0, 10.0, 20.0, 40.0)
QUICK_SCALE_SIZES = (0.25, 0.5, 1.0)


def main(quick: bool = False, scale: bool = False) -> None:
    """`make bench` entry: the comparison (full, or ``quick``), then with ``scale`` the scale study too.

    ``quick`` with ``scale`` grows the cache to 1 GB only (a check that the study runs).
    """
    Bench(QUICK if quick else FULL).run()
    if scale:
        run_scale(QUICK_SCALE_SIZES if quick else SCALE_SIZES)


def _cli(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="tiny cache, under a minute")
    parser.add_argument("--scale", action="store_true", help="then our cost per GB from 1 GB to 40 GB (> RAM)")
    parser.add_argument("--scale-only", action="store_true", help="the scale study alone")
    parser.add_argument("--sizes", type=float, nargs="+", help=f"scale study sizes in GB (default {list(SCALE_SIZES)})")
    parser.add_argument("--examples", type=int, help="examples in the comparison's cache (default 512: 2.1 GB)")
    parser.add_argument("--budget", type=float, help="seconds per measurement")
    parser.add_argument("--keep", action="store_true", help="keep the data files in bench_out/")
    args = parser.parse_args(argv)
    if not args.scale_only:
        cfg = QUICK if args.quick else FULL
        if args.examples:
            cfg = dataclasses.replace(cfg, spec=dataclasses.replace(cfg.spec, n_examples=args.examples))
        if args.budget:
            cfg = dataclasses.replace(cfg, budget_s=args.budget)
        Bench(cfg, keep=args.keep).run()
    if args.scale or args.scale_only:
        sizes = args.sizes or (QUICK_SCALE_SIZES if args.quick else SCALE_SIZES)
        run_scale(sizes, keep=args.keep)


if __name__ == "__main__":
    _cli()
