"""Our reader against what a user would pick instead, on identical data, in the same run.

Workloads (the zarr activation logs' validation and training reads, plus gathers, writes
and open time), each in two regimes: page-cached (files read once just before) and cold
(``POSIX_FADV_DONTNEED`` on every file of the store just before, and queries spread further
apart than the disk's readahead window, so no read is served by an earlier one's readahead,
as in a cache much bigger than RAM):

1. k random ``(example, layer)`` slice reads: mean, median, p95 latency and GB/s; a plain
   loop, then through a PyTorch DataLoader with 0, 4 and 8 workers (`slices.py`);
2. the training pattern: batches of b random examples x 2 random distinct layers;
3. random single-token gathers: batches of 4096 ``(example, layer, token)`` vectors;
4. write throughput for the whole cache (every format ends with its files fsynced);
5. time to open a cache of 1, 100 and 10,000 shards (`workloads.py`).

Every figure is printed next to the machine's relevant limit measured in the same run,
interleaved with the contenders (memcpy, O_DIRECT sequential and random reads and writes),
and next to the best peer. Tables go to results/peers_*.md, plots to results/peers*.png.
The package: `data.py` (the data and the adapters' contract), `adapters.py` (one per
format), `harness.py` (sizes, timing, shared state), `workloads.py` and `slices.py` (the
tables), `scale.py` (``--scale``), `plots.py`, and this module, which runs them in order.

    python benchmarks/peers/main.py                 # the full comparison (a 2 GB cache, ~20 minutes)
    python benchmarks/peers/main.py --quick         # tiny cache, under a minute
    python benchmarks/peers/main.py --scale-only    # our cost per GB from 1 GB to 40 GB (> RAM), ~30 min
    python benchmarks/peers/main.py --scale         # both
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root on the path, for `benchmarks`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import benchlib as bl
from benchmarks import tables
from benchmarks.peers import slices, workloads
from benchmarks.peers.data import Source, remove
from benchmarks.peers.harness import FULL, QUICK, Config, Harness
from benchmarks.peers.scale import QUICK_SCALE_SIZES, SCALE_SIZES, run_scale


def steps(h: Harness) -> list[tuple[str, Callable[[], None]]]:
    """The comparison's tables, in the order they run (later ones read earlier results)."""
    return [
        ("limits", lambda: workloads.limits(h)),
        ("writes", lambda: workloads.writes(h)),
        ("verify", lambda: workloads.verify(h)),
        ("slices page-cached", lambda: slices.slices(h, "page-cached")),
        ("slices cold", lambda: slices.slices(h, "cold")),
        ("slice sizes", lambda: slices.slice_sizes(h)),
        ("pairs", lambda: workloads.pairs(h)),
        ("gathers", lambda: workloads.gathers(h)),
        ("open", lambda: workloads.opens(h)),
        ("targets", lambda: workloads.targets(h)),
    ]


def compare(cfg: Config, keep: bool = False) -> None:
    """The whole comparison: every table, then the plots (full runs only)."""
    h = Harness(cfg, keep)
    started = time.perf_counter()
    print(f"# saev_shards against its peers ({cfg.label} run)\n", flush=True)
    for line in cfg.describe():
        print(f"- {line}")
    print(f"- machine: {tables.machine()}\n", flush=True)
    try:
        import h5py  # noqa: F401 - every library imported before anything is timed
        import safetensors  # noqa: F401
        import torch
        import zarr  # noqa: F401

        # One intra-op thread, as in DataLoader workers: with 2 threads on a busy 2-core machine,
        # OpenMP's spinning made the main process's collate 30x slower.
        torch.set_num_threads(1)
        gc.freeze()  # the libraries' objects stay out of the collections we force before evicting
        # Free memory compacted, so the stores read whole into the page cache get large folios (`Harness.prepare`).
        if settled := bl.settle_memory():
            print(f"- before writing the stores: {settled}\n", flush=True)
        h.source = Source(h.spec)
        for name, step in steps(h):
            t0 = time.perf_counter()
            step()
            print(f"  [{name}: {time.perf_counter() - t0:.1f} s]\n", flush=True)
            if name == "gathers":
                h.source = None
        if cfg.label == "quick":
            print("plots: skipped in the quick run")
        else:
            from benchmarks.peers import plots

            for path in plots.peers(h.results, h.spec, tables.results_dir()):
                print(f"plot: {path}")
    finally:
        if not keep:
            remove(h.dir)
    print(f"\nthe peers benchmark took {time.perf_counter() - started:.0f} s", flush=True)


def main(quick: bool = False, scale: bool = False) -> None:
    """`make bench` entry: the comparison (full, or ``quick``), then with ``scale`` the scale study too.

    ``quick`` with ``scale`` grows the cache to 1 GB only (a check that the study runs).
    """
    compare(QUICK if quick else FULL)
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
        compare(cfg, keep=args.keep)
    if args.scale or args.scale_only:
        sizes = args.sizes or (QUICK_SCALE_SIZES if args.quick else SCALE_SIZES)
        run_scale(sizes, keep=args.keep)


if __name__ == "__main__":
    _cli()
