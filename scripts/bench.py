"""`make bench`: every benchmark table, each figure a same-run ratio to the machine's limits.

    .venv/bin/python scripts/bench.py [--quick] [--scale] [--only core,loaders,...]

Suites: core, loaders, writers, dump, shuffle, peers, convert, float8, remote.

Tables print to stdout and are saved, with plots, under results/.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts import benchlib as bl

# (name, module): run in this order; each module exposes main(quick=..., [scale=...]).
SUITES = [
    ("core", "scripts.bench_core"),
    ("loaders", "scripts.bench_loaders"),
    ("writers", "scripts.bench_writers"),
    ("dump", "scripts.bench_dump"),
    ("shuffle", "scripts.bench_shuffle"),
    ("peers", "scripts.bench_peers"),
    ("convert", "scripts.bench_convert"),
    ("float8", "scripts.bench_float8"),
    ("remote", "scripts.bench_remote"),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes and one round: under a minute per suite")
    parser.add_argument("--scale", action="store_true", help="also grow the peers' cache past RAM (hours)")
    parser.add_argument("--only", default="", help="comma-separated suites to run (default: all)")
    args = parser.parse_args()
    only = {s for s in args.only.split(",") if s}
    print(f"# saev_shards benchmarks ({'quick' if args.quick else 'full'})\n")
    print(f"Machine: {bl.machine()}")
    print(f"Data under {bl.bench_dir()}, tables and plots under {bl.results_dir()}\n")
    for name, module_name in SUITES:
        if only and name not in only:
            continue
        module = importlib.import_module(module_name)
        kwargs: dict[str, bool] = {"quick": args.quick}
        if "scale" in inspect.signature(module.main).parameters:
            kwargs["scale"] = args.scale
        print(f"## {name}\n", flush=True)
        start = time.perf_counter()
        module.main(**kwargs)
        print(f"({name}: {time.perf_counter() - start:.0f} s)\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
