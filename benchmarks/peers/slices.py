"""Workload 1 of the peers benchmark: random ``(example, layer)`` slice reads, page-cached and
cold, in a plain loop and through a PyTorch DataLoader, then page-cached at other slice sizes.
"""

from __future__ import annotations

import os
import statistics
import warnings
from pathlib import Path

import numpy as np

from benchmarks import benchlib as bl
from benchmarks import tables
from benchmarks.peers import adapters as F
from benchmarks.peers.data import DTYPE, CacheSpec, Source, remove
from benchmarks.peers.harness import DISK_NOTE, OURS, Harness, Run, SliceDataset, Summary, loader_run, ms, ratio

#: A row of workload 1's table: ``(format key, mode, summary, the limit it is compared with)``.
Row = tuple[str, str, Summary, float]


def _loop(h: Harness, regime: str) -> tuple[dict[str, Summary], float]:
    """Every format's slice reads in a plain loop, interleaved with the limit: summaries, median limit."""
    spec, cfg = h.spec, h.cfg
    runs: dict[str, list[Run]] = {k: [] for k in F.FORMATS}
    limits: list[float] = []
    slow: set[str] = set()
    for r in range(cfg.rounds):
        queries = h.slice_queries(regime, seed=r)
        limits.append(h.memcpy_limit(spec.slice_nbytes) if regime != "cold" else h.random_limit(spec.slice_nbytes))
        for key in h.keys(r):
            if key in slow:
                continue
            run = h.measure(key, regime, "read", queries.tolist(), spec.slice_nbytes)
            runs[key].append(run)
            if run.lat.max() > cfg.budget_s:
                slow.add(key)  # one item outlasts the budget: one round is enough
    return {k: Summary.of(v) for k, v in runs.items()}, statistics.median(limits)


def _through_loaders(h: Harness, regime: str, loop: dict[str, Summary]) -> tuple[list[Row], list[str]]:
    """The same reads through a DataLoader with each worker count: rows, and the formats too slow to try."""
    spec, cfg = h.spec, h.cfg
    rows: list[Row] = []
    skipped: list[str] = []
    for w in cfg.workers:
        w_limit = (
            h.memcpy_limit(spec.slice_nbytes) if regime != "cold" else h.random_limit(spec.slice_nbytes, max(1, w))
        )
        queries = h.slice_queries(regime, seed=200 + w)
        for key in h.keys(w):
            per_batch = loop[key].mean * cfg.loader_batch * (1 + w / 2 if w else 1)
            if per_batch > cfg.budget_s * 2:
                skipped.append(f"{F.FORMATS[key].name} (w={w}: one batch would take ~{per_batch:.0f} s)")
                continue
            h.prepare(h.stores[key], regime)
            ds = SliceDataset(key, h.stores[key], spec, queries)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch: non-writable numpy arrays
                before = bl.disk_read_bytes()
                run = loader_run(ds, w, cfg.loader_batch, cfg.budget_s)
                if w == 0 and before >= 0:  # workers' reads are not in our /proc/self/io
                    run.disk = bl.disk_read_bytes() - before
            rows.append((key, f"DataLoader w={w}", Summary.of([run]), w_limit))
    return rows, skipped


def _notes(h: Harness, t: tables.Table, regime: str, limit: float, skipped: list[str]) -> None:
    cfg = h.cfg
    slice_kib = f"{h.spec.slice_nbytes / 1024:.0f} KiB"
    if regime == "cold":
        t.note(
            f"Cold: every file of the store evicted (POSIX_FADV_DONTNEED) and the reader opened anew before each "
            f"measurement; the queries are one random layer of examples spaced more than the disk's readahead "
            f"window ({h.readahead >> 10} KiB) apart, so no read finds another's readahead in the page cache "
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
    if cfg.label == "quick" and regime == "cold":
        t.note(
            "Quick run: the files are a few MiB, no bigger than one readahead window, so opening a store or "
            "the first read pulls in whole files: cold figures here mean little. Use the full run."
        )
    if skipped:
        t.note("Not run through the DataLoader: " + "; ".join(skipped) + ".")
    for line in cfg.describe()[:2]:
        t.note(line)
    t.note("Formats: " + " ".join(f"**{f.name}**: {f.note}." for f in F.FORMATS.values()))


def slices(h: Harness, regime: str) -> None:
    """Workload 1 in one regime: the plain loop, then each DataLoader worker count; one table."""
    loop, limit = _loop(h, regime)
    loaders, skipped = _through_loaders(h, regime, loop)
    rows: list[Row] = [(k, "loop", s, limit) for k, s in loop.items()] + loaders
    order = {k: i for i, k in enumerate(F.FORMATS)}
    rows.sort(key=lambda r: (r[1] != "loop", r[1], order[r[0]]))
    name = "peers_slices_cached" if regime != "cold" else "peers_slices_cold"
    t = tables.Table(
        name,
        f"Workload 1: random (example, layer) slice reads, {regime}",
        ["format", "mode", "n", "mean ms", "median ms", "p95 ms", "GB/s", "x limit", "x best peer", "disk/read"],
    )
    by_mode: dict[str, dict[str, float]] = {}
    for key, mode, s, _ in rows:
        by_mode.setdefault(mode, {})[key] = s.gbps
    for key, mode, s, lim in rows:
        best = h.best_peer(by_mode[mode])
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
    _notes(h, t, regime, limit, skipped)
    t.emit()
    h.results[f"slices_{regime}"] = {"gbps": {k: s.gbps for k, s in loop.items()}, "limit": limit, "loop": loop}


def _other_shape(h: Harness, tokens: int, d_model: int, keys: list[str]) -> tuple[dict[str, Summary], float]:
    """Workload 1's page-cached loop on a small cache of ``(T, D) = (tokens, d_model)`` slices of its
    own, written in every format of ``keys`` and deleted after: summaries, median memcpy limit."""
    cfg = h.cfg
    example = h.spec.n_layers * tokens * d_model * DTYPE.itemsize
    eps = max(1, (32 << 20) // example)
    spec = CacheSpec(
        n_examples=max(eps, cfg.sweep_nbytes // example),
        n_layers=h.spec.n_layers,
        tokens=tokens,
        d_model=d_model,
        examples_per_shard=eps,
    )
    source = Source(spec, extra_nbytes=16 << 20)
    stores: dict[str, Path] = {}
    for key in keys:
        fmt = F.FORMATS[key]
        if fmt.files_of:
            stores[key] = stores[fmt.files_of]
            continue
        root = h.dir / f"size-{key}"
        remove(root)
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
        limits.append(h.memcpy_limit(spec.slice_nbytes))
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            runs[key].append(h.measure(key, "page-cached", "read", queries, spec.slice_nbytes, spec, stores[key]))
    for key, store in stores.items():
        if not F.FORMATS[key].files_of:
            remove(store.parent)
    return {k: Summary.of(v) for k, v in runs.items()}, statistics.median(limits)


def slice_sizes(h: Harness) -> None:
    """Page-cached random slices of other (T, D) shapes: how the ratios depend on the slice size."""
    cfg = h.cfg
    if not cfg.sweep_shapes:
        return
    keys = [k for k in F.FORMATS if k != "pickle_gz"]  # far below everyone at 1 MiB already
    t = tables.Table(
        "peers_slice_sizes",
        "Workload 1 at other slice sizes: random (example, layer) reads, page-cached, plain loop",
        ["slice (T, D)", "KiB", "saev_shards GB/s", "mean us", "x memcpy", "best peer", "best peer GB/s",
         "x best peer", "x zarr v2", "x h5py"],
    )  # fmt: skip
    for tokens, d_model in (*cfg.sweep_shapes, (h.spec.tokens, h.spec.d_model)):
        if (tokens, d_model) == (h.spec.tokens, h.spec.d_model):
            loop, limit = h.results["slices_page-cached"]["loop"], h.results["slices_page-cached"]["limit"]
        else:
            loop, limit = _other_shape(h, tokens, d_model, keys)
        peers = {k: v.gbps for k, v in loop.items() if k not in OURS and k in keys}
        best = max(peers, key=lambda k: peers[k])
        ours = loop["saev"]
        kib = tokens * d_model * DTYPE.itemsize / 1024
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
        h.results.setdefault("sizes", []).append(
            {"kib": kib, "ours": ours.gbps, "zarr2": peers["zarr2"], "h5": peers["h5"], "best": peers[best]}
        )
    t.note(
        f"Each other shape gets its own ~{cfg.sweep_nbytes >> 20} MiB cache in every format but pickle.gz "
        f"({h.spec.n_layers} layers, same adapters as above); the last row is workload 1's. "
        f"k={cfg.queries} queries, median of {cfg.rounds} interleaved rounds; x memcpy: against memcpy of "
        "slice-sized pieces measured alongside. Per-call overheads (zarr ~1 ms, h5py ~0.1 ms) weigh more on "
        "small slices, so the ratios to the peers grow as slices shrink, while big slices approach memcpy."
    )
    t.emit()
