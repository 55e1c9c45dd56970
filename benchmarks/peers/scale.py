"""The peers benchmark's scale study (``--scale``): our cost per GB of writing, of cold random
slices and of a cold sequential read as the cache grows from 1 GB past the machine's RAM,
each beside its O_DIRECT limit measured just before and just after, on the cache's own files.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

import saev_shards as ss
from benchmarks import benchlib as bl
from benchmarks import tables
from benchmarks.peers import adapters as F
from benchmarks.peers.data import DTYPE, CacheSpec, Source, files, remove

SCALE_SIZES = (1.0, 2.0, 5.0, 10.0, 20.0, 40.0)
QUICK_SCALE_SIZES = (0.25, 0.5, 1.0)


#: The cache the study grows: 1 MiB slices, 4 layers, 64 examples (256 MiB) per shard.
BASE = CacheSpec(n_examples=1, n_layers=4, tokens=128, d_model=4096, examples_per_shard=64)


def _write(spec: CacheSpec, out_dir: Path, limit_file: Path) -> tuple[Path, float, float]:
    """Write the cache (ours, fsynced) between two O_DIRECT write limits: its path, seconds, mean limit."""
    source = Source(spec)
    w0 = bl.odirect_write_gbps(limit_file, 512 << 20)
    root = out_dir / "cache"
    remove(root)
    root.mkdir()
    t0 = time.perf_counter()
    store = F.write_saev(root, spec, source)
    write_s = time.perf_counter() - t0
    del source
    w1 = bl.odirect_write_gbps(limit_file, 512 << 20)
    return store, write_s, (w0 + w1) / 2


def _random_slices(store: Path, spec: CacheSpec, shard_files: list[Path]) -> tuple[float, float, float]:
    """2,000 random distinct slices from the evicted cache between two random O_DIRECT limits on its
    own shard files (a small limit file may sit in a host-side cache): seconds, GB read, mean limit."""
    r0 = bl.odirect_random_read_files(shard_files, spec.slice_nbytes, 256, seed=1)[0]
    bl.drop_cache(files(store))
    reader = F.SaevReader(store, spec)
    rng = np.random.default_rng(0)
    k = min(2000, spec.n_examples * spec.n_layers)
    pick = rng.permutation(spec.n_examples * spec.n_layers)[:k]
    out = np.empty((spec.tokens, spec.d_model), DTYPE)
    t0 = time.perf_counter()
    for p in pick.tolist():
        reader.read(p // spec.n_layers, p % spec.n_layers, out)
    rand_s = time.perf_counter() - t0
    reader.close()
    r1 = bl.odirect_random_read_files(shard_files, spec.slice_nbytes, 256, seed=2)[0]
    return rand_s, k * spec.slice_nbytes / 1e9, (r0 + r1) / 2


def _sequential(store: Path, spec: CacheSpec, shard_files: list[Path]) -> tuple[float, float]:
    """The evicted cache read whole, one shard at a time, between two spread O_DIRECT read limits:
    seconds, mean limit."""
    s0 = bl.odirect_spread_read_gbps(shard_files, 0)
    bl.drop_cache(files(store))
    shards = ss.open(store)
    buf = np.empty((spec.examples_per_shard, *spec.shape[1:]), DTYPE)
    t0 = time.perf_counter()
    for k in range(spec.n_shards):
        start, stop = spec.shard_range(k)
        shards.read_range(start, stop, buf[: stop - start])
    seq_s = time.perf_counter() - t0
    shards.close()
    s1 = bl.odirect_spread_read_gbps(shard_files, 1)
    return seq_s, (s0 + s1) / 2


def _one_size(spec: CacheSpec, out_dir: Path, limit_file: Path) -> dict[str, float]:
    """One row of the study: write, open, random slices, sequential read, each against its limit."""
    store, write_s, write_limit = _write(spec, out_dir, limit_file)
    opens = []
    for _ in range(5):
        t0 = time.perf_counter()
        shards = ss.open(store)
        opens.append(time.perf_counter() - t0)
        shards.close()
    shard_files = [p for p in files(store) if p.name.startswith("acts")]
    rand_s, rand_gb, rand_limit = _random_slices(store, spec, shard_files)
    seq_s, seq_limit = _sequential(store, spec, shard_files)
    remove(store.parent)
    gbytes = spec.nbytes / 1e9
    return {
        "gb": gbytes,
        "write": write_s / gbytes,
        "write_x": gbytes / write_s / write_limit,
        "rand": rand_s / rand_gb,
        "rand_x": rand_gb / rand_s / rand_limit,
        "seq": seq_s / gbytes,
        "seq_x": gbytes / seq_s / seq_limit,
        "open": statistics.median(opens) * 1e3,
    }


def run_scale(sizes_gb: Sequence[float], keep: bool = False) -> None:
    """The study's table (and plot) over ``sizes_gb``, stopping early when the disk is too full."""
    base = BASE
    out_dir = tables.bench_dir() / "scale"
    remove(out_dir)
    out_dir.mkdir(parents=True)
    limit_file = out_dir / "limit.bin"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    columns = ["cache GB", "write s/GB", "x O_DIRECT write", "random slices s/GB", "x O_DIRECT random",
               "sequential read s/GB", "x O_DIRECT read", "open ms"]  # fmt: skip
    t = tables.Table("peers_scale", "--scale: our cost per GB as the cache grows (cold)", columns)
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
    t.note(f"Machine: {tables.machine()}.")
    rows: list[dict[str, float]] = []
    try:
        for size in sizes_gb:
            n = max(base.examples_per_shard, round(size * 1e9 / base.example_nbytes))
            spec = dataclasses.replace(base, n_examples=n)
            free = shutil.disk_usage(out_dir).free
            if free < spec.nbytes + (4 << 30):
                t.note(f"Stopped before {size:g} GB: {free / 1e9:.0f} GB free on the disk.")
                break
            row = _one_size(spec, out_dir, limit_file)
            rows.append(row)
            t.add(*(row[c] for c in ("gb", "write", "write_x", "rand", "rand_x", "seq", "seq_x", "open")))
            print(t.render(), flush=True)
    finally:
        if not keep:
            remove(out_dir)
    if rows:
        flat = [max(r[c] for r in rows) / min(r[c] for r in rows) for c in ("write", "rand", "seq")]
        t.note(
            f"Spread (largest / smallest cost per GB across sizes): write {flat[0]:.2f}, random slices "
            f"{flat[1]:.2f}, sequential read {flat[2]:.2f}; the disk's own limits drift as much (see the x columns)."
        )
    t.emit()
    if rows:
        from benchmarks.peers import plots

        print(f"plot: {plots.scale(rows, tables.results_dir())}")
