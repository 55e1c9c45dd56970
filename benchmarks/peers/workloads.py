"""The peers benchmark's workloads but the slice reads (`slices.py`): the limits, writing the
whole cache (workload 4), checking every reader's values, training batches of pairs (2),
single-token gathers (3), opening a cache (5), and the targets. Each takes the `Harness`,
emits one table and leaves its figures in ``h.results``.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import numpy as np

from benchmarks import benchlib as bl
from benchmarks import tables
from benchmarks.peers import adapters as F
from benchmarks.peers.data import DTYPE, CacheSpec, Source, files, remove
from benchmarks.peers.harness import DISK_NOTE, OURS, REGIMES, Harness, SliceDataset, loader_run, ms, ratio


def limits(h: Harness) -> None:
    """The machine's limits every later table is compared with, interleaved: one table."""
    spec, cfg = h.spec, h.cfg
    write_nbytes = cfg.limit_nbytes
    fns = {
        "memcpy": lambda: bl.memcpy_gbps(min(256 << 20, cfg.limit_nbytes)),
        "memcpy_slice": lambda: h.memcpy_limit(spec.slice_nbytes),
        "memcpy_vector": lambda: h.memcpy_limit(spec.vector_nbytes),
        "write": lambda: bl.odirect_write_gbps(h.limit_file, write_nbytes),
        "read": lambda: bl.odirect_read_gbps(h.limit_file),
        "rand4k": lambda: h.random_limit(4096),
        "rand1m": lambda: h.random_limit(1 << 20),
        "rand_slice": lambda: h.random_limit(spec.slice_nbytes),
        "rand_vector": lambda: h.random_limit(spec.vector_nbytes),
    }
    got = bl.interleaved(fns, rounds=max(1, cfg.rounds))
    iops4k = h.random_limit(4096) / 4096 * 1e9
    h.results["limits"] = got
    t = tables.Table("peers_limits", "The machine's limits (same run)", ["limit", "GB/s", "how"])
    slice_kib = f"{spec.slice_nbytes / 1024:.0f} KiB"
    vec_kib = f"{h.block(spec.vector_nbytes) / 1024:.0f} KiB"
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
    t.note(f"Medians of {max(1, cfg.rounds)} interleaved rounds. Machine: {tables.machine()}.")
    t.note("Each workload below re-measures its own limit, interleaved with its rounds.")
    t.emit()


def writes(h: Harness) -> None:
    """Workload 4: every format writes the whole cache, fsynced, between O_DIRECT write limits."""
    spec, cfg = h.spec, h.cfg
    assert h.source is not None
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
    limits = [bl.odirect_write_gbps(h.limit_file, sample_nbytes)]
    rates: dict[str, list[tuple[float, float]]] = {}
    for k in sequence:
        key = k.rstrip("*")
        root = h.dir / (f"{key}-scratch" if k.endswith("*") else key)
        remove(root)
        root.mkdir()
        gc.collect()
        t0 = time.perf_counter()
        store = F.FORMATS[key].write(root, spec, h.source, True)
        dt = time.perf_counter() - t0
        limits.append(bl.odirect_write_gbps(h.limit_file, sample_nbytes))
        limit = (limits[-2] + limits[-1]) / 2
        rates.setdefault(key, []).append((spec.nbytes / dt / 1e9, limit))
        if k.endswith("*"):
            remove(root)
        else:
            h.stores[key] = store
        print(f"  wrote {F.FORMATS[key].name}: {dt:.1f} s", flush=True)
    for k, fmt in F.FORMATS.items():
        if fmt.files_of:
            h.stores[k] = h.stores[fmt.files_of]
    gbps = {k: statistics.median(g for g, _ in v) for k, v in rates.items()}
    x_limit = {k: statistics.median(g / lim for g, lim in v) for k, v in rates.items()}
    best = h.best_peer(gbps)
    t = tables.Table(
        "peers_write",
        "Workload 4: writing the whole cache",
        ["format", "n", "s", "GB/s", "x O_DIRECT write", "x best peer", "on disk GB", "files"],
    )
    for k in order:
        paths = files(h.stores[k])
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
    h.results["write"] = {"gbps": gbps, "x_limit": x_limit, "limit": statistics.median(limits)}


def verify(h: Harness) -> None:
    """Every reader returns the source's values (a benchmark of wrong data is void)."""
    spec = h.spec
    assert h.source is not None
    rng = np.random.default_rng(1)
    # A few examples in the first, a middle and the last shard: enough to catch wrong offsets
    # without making pickle.gz decompress every shard.
    examples = np.array([0, 1, spec.n_examples // 2, spec.n_examples - 1])
    for key in F.FORMATS:
        reader = h.open_reader(key, "page-cached")
        try:
            for e in examples[[0, 2, 3]].tolist():
                layer = int(rng.integers(spec.n_layers))
                got = reader.read(e, layer, np.empty((spec.tokens, spec.d_model), DTYPE))
                if not np.array_equal(got, h.source.example(e)[layer]):
                    raise RuntimeError(f"{key}: read({e}, {layer}) returned wrong values")
            ex = examples[[3, 1]]
            layers = h.pair_layers(rng, 2)
            got = reader.read_pairs(ex, layers, np.empty((2, 2, spec.tokens, spec.d_model), DTYPE))
            want = np.stack([h.source.example(int(e))[lay] for e, lay in zip(ex, layers, strict=True)])
            if not np.array_equal(got, want):
                raise RuntimeError(f"{key}: read_pairs returned wrong values")
            g = [rng.choice(examples, 8), *(rng.integers(0, n, 8) for n in spec.shape[1:3])]
            got = reader.gather(g[0], g[1], g[2], np.empty((8, spec.d_model), DTYPE))
            want = np.stack([h.source.example(int(e))[lay, t] for e, lay, t in zip(*g, strict=True)])
            if not np.array_equal(got, want):
                raise RuntimeError(f"{key}: gather returned wrong values")
        finally:
            reader.close()
    print("  every reader returned the written values", flush=True)
    # A DataLoader loads modules of its own on first use, and the suite dropped the clean page
    # cache before writing the stores (`main.compare`): read them now, not in a timed run.
    cfg = h.cfg
    queries = h.slice_queries("page-cached", seed=9)[: 2 * cfg.loader_batch]
    for w in sorted({0, *cfg.workers}):
        loader_run(SliceDataset(OURS[0], h.stores[OURS[0]], spec, queries), w, cfg.loader_batch, 0.0)


def pairs(h: Harness) -> None:
    """Workload 2: batches of b random examples x 2 random distinct layers, page-cached and cold."""
    spec, cfg = h.spec, h.cfg
    b = cfg.pair_examples
    item_nbytes = b * 2 * spec.slice_nbytes
    t = tables.Table(
        "peers_pairs",
        f"Workload 2: training batches of b={b} random examples x 2 random distinct layers",
        ["regime", "format", "n", "mean ms", "p95 ms", "GB/s", "x limit", "x best peer", "disk/read"],
    )
    h.results["pairs"] = {}
    for regime in REGIMES:

        def make_batches(r: int, regime: str = regime) -> list[Any]:
            rng = np.random.default_rng(300 + r)
            if regime == "cold":
                ex = h.sparse_examples(r)
                if len(ex) < b:  # a cache too small to space b examples out (the quick run)
                    ex = rng.permutation(spec.n_examples)[:b]
                n = max(1, min(cfg.pair_batches, len(ex) // b))
                return [(ex[i * b : (i + 1) * b], h.pair_layers(rng, b)) for i in range(n)]
            examples = (rng.integers(0, spec.n_examples, b) for _ in range(cfg.pair_batches))
            return [(ex, h.pair_layers(rng, b)) for ex in examples]

        sums, limit, best = h.interleaved(regime, "pairs", make_batches, spec.slice_nbytes, item_nbytes)
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
        h.results["pairs"][regime] = {"gbps": {k: s.gbps for k, s in sums.items()}, "limit": limit}
    lim = h.results["pairs"]
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


def gathers(h: Harness) -> None:
    """Workload 3: batches of random single-token vectors, page-cached and cold."""
    spec, cfg = h.spec, h.cfg
    n = cfg.gather_vectors
    item_nbytes = n * spec.vector_nbytes
    t = tables.Table(
        "peers_gather",
        f"Workload 3: random single-token gathers, batches of {n} (example, layer, token) vectors",
        ["regime", "format", "n", "mean ms", "vectors/s", "GB/s", "x limit", "x best peer", "disk/read"],
    )
    h.results["gather"] = {}
    for regime in REGIMES:
        n_batches = cfg.gather_batches if regime != "cold" else 1  # one batch right after eviction

        def make_batches(r: int, n_batches: int = n_batches) -> list[Any]:
            rng = np.random.default_rng(400 + r)
            return [tuple(rng.integers(0, m, n) for m in spec.shape[:3]) for _ in range(n_batches)]

        sums, limit, best = h.interleaved(regime, "gather", make_batches, spec.vector_nbytes, item_nbytes)
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
        h.results["gather"][regime] = {"gbps": {k: s.gbps for k, s in sums.items()}, "limit": limit}
    lim = h.results["gather"]
    block = h.block(spec.vector_nbytes)
    t.note(
        f"A vector is {spec.vector_nbytes} B; a batch {item_nbytes / 2**20:.0f} MiB; n counts batches. Limits: "
        f"page-cached, memcpy of vector-sized pieces from random offsets into a batch-sized buffer "
        f"({lim['page-cached']['limit']:.2f} GB/s); cold, one-thread random O_DIRECT reads of {block} B "
        f"({lim['cold']['limit']:.3f} GB/s, {lim['cold']['limit'] * 1e9 / block:,.0f} reads/s). A cold "
        f"measurement is one batch right after the store is evicted; its {n} random vectors of a "
        f"{spec.nbytes / 1e9:.1f} GB cache lie "
        f"~{spec.nbytes / n / 2**20:.1f} MiB apart, closer than the readahead window ({h.readahead >> 10} "
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


def opens(h: Harness) -> None:
    """Workload 5: the time to open caches of 1, 100 and 10,000 one-example shards."""
    cfg = h.cfg
    keys = [k for k in F.FORMATS if F.FORMATS[k].files_of is None]
    times: dict[str, dict[int, float]] = {k: {} for k in keys}
    for count in cfg.open_shards:
        spec = CacheSpec(n_examples=count, n_layers=2, tokens=4, d_model=8, examples_per_shard=1)
        source = Source(spec, extra_nbytes=1 << 20)
        stores = {}
        for key in keys:
            root = h.dir / f"open-{key}-{count}"
            remove(root)
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
            remove(stores[key].parent)
        print(f"  open: {count} shards done", flush=True)
    t = tables.Table(
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
        "parse metadata.json (the pickle shards' ActivationDataset would also load every shard to build its index)."
    )
    t.emit()
    h.results["open"] = times


def targets(h: Harness) -> None:
    """Our figures against the targets set for them, from the results of the tables before."""
    res = h.results
    t = tables.Table("peers_targets", "Targets", ["target", "measured", "met"])

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
            "random slices, page-cached: >= 15 x zarr (v2, the zarr activation logs' layout)",
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
        add(f"open {last:,} shards: < 50 ms", res["open"]["saev"][last] * 1e3, 50, "{:.1f} ms", lower_is_better=True)
        if last < 10_000:
            t.note(f"The quick run opens at most {last:,} shards; the target is for 10,000 (full run).")
    t.note(f"Slice = {h.spec.slice_nbytes / 1024:.0f} KiB. Ours is `read_example` in a plain loop (workload 1).")
    t.emit()
