"""`make bench`: every benchmark suite, each figure a same-run ratio to the machine's limits.

    .venv/bin/python benchmarks/run_all.py [--quick] [--scale] [--suite core,loaders,...] [--page PATH]

Suites, in this order: core, loaders, writers, dump, shuffle, scale, peers, convert, float8, remote.

Tables print to stdout as each suite goes and are saved, with plots, under results/. The
runner also writes every table of the run, whole, as one page: docs/bench/latest.md after a
full run of every suite (what `make bench` does; the peers' plots are copied beside it), and
results/bench.md after a quick or partial one, whose figures are not for publishing
(``--page`` names another file). A suite that fails is reported on the page and the run goes
on; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root on the path, for `benchmarks`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import tables

#: (name, module): run in this order; each module exposes main(quick=..., [scale=...]).
SUITES = [
    ("core", "benchmarks.core"),
    ("loaders", "benchmarks.loaders"),
    ("writers", "benchmarks.writers"),
    ("dump", "benchmarks.dump"),
    ("shuffle", "benchmarks.shuffle"),
    ("scale", "benchmarks.scale"),
    ("peers", "benchmarks.peers.main"),
    ("convert", "benchmarks.convert"),
    ("float8", "benchmarks.float8"),
    ("remote", "benchmarks.remote"),
]
#: The page a full `make bench` writes, and the plots copied beside it.
PAGE = tables.REPO / "docs" / "bench" / "latest.md"
PLOTS = ("peers.png", "peers_scale.png")


def commit() -> str:
    """The checkout's commit, and whether files it tracks were changed (outside docs/bench)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], check=False, cwd=tables.REPO, capture_output=True, text=True
        )
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs/bench"],
            check=False,
            cwd=tables.REPO,
            capture_output=True,
            text=True,
        )
    except OSError:
        return "unknown (no git)"
    if head.returncode != 0:
        return "unknown (not a git checkout)"
    return head.stdout.strip() + (" with uncommitted changes" if status.stdout.strip() else "")


def header(args: argparse.Namespace, names: list[str], started: datetime.datetime, page: Path) -> list[str]:
    """The page's title and what it came from: when, which commit, which machine, which command."""
    kind = "quick (small sizes, one round: not for publishing)" if args.quick else "full"
    flags = " ".join(f for f, on in (("--quick", args.quick), ("--scale", args.scale)) if on)
    if args.suite:
        flags += f" --suite {args.suite}"
    command = "`make bench` (`benchmarks/run_all.py`)" if not flags else f"`benchmarks/run_all.py {flags.strip()}`"
    here = page.resolve().parent
    guide, gpu, earlier = (
        os.path.relpath(tables.REPO / "docs" / name, here)
        for name in ("contributing/benchmarks.md", "bench/gpu.md", "bench/earlier.md")
    )
    return [
        "# `make bench` results",
        "",
        f"Written whole by {command}, a {kind} run started {started:%Y-%m-%d %H:%M} UTC at commit {commit()}, "
        f"on: {tables.machine()}. Suites: {', '.join(names)}.",
        "",
        "Every figure is a ratio to a limit of this machine measured in the same run (benchmarks/benchlib.py), or "
        "to the best alternative run on identical data; a disk's own rates drift between runs, so compare ratios, "
        f"not GB/s, with other runs. What each suite measures, and why: [docs/contributing/benchmarks.md]({guide}). "
        "Edit the benchmarks, not this page: the next full `make bench` replaces it. A GPU node's figures are in "
        f"[gpu.md]({gpu}), and figures of earlier runs in [earlier.md]({earlier}).",
        "",
    ]


def run_suite(name: str, module_name: str, args: argparse.Namespace) -> tuple[list[str], str | None]:
    """Run one suite: the tables it emitted, and the error that stopped it (None when it finished)."""
    mark = len(tables.emitted_since(0))
    print(f"## {name}\n", flush=True)
    start = time.perf_counter()
    error = None
    try:
        module = importlib.import_module(module_name)
        kwargs: dict[str, bool] = {"quick": args.quick}
        if "scale" in inspect.signature(module.main).parameters:
            kwargs["scale"] = args.scale
        module.main(**kwargs)
    except Exception as e:
        traceback.print_exc()
        error = f"{type(e).__name__}: {e}"
    seconds = time.perf_counter() - start
    print(f"({name}: {seconds:.0f} s{', FAILED' if error else ''})\n", flush=True)
    lines = [f"## {name}", "", f"{seconds:.0f} s." if error is None else f"Stopped after {seconds:.0f} s: {error}", ""]
    return lines + tables.emitted_since(mark), error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes and one round: under a minute per suite")
    parser.add_argument("--scale", action="store_true", help="also grow the peers' cache past RAM (hours)")
    parser.add_argument("--suite", "--only", default="", help="comma-separated suites to run (default: all)")
    parser.add_argument("--page", type=Path, default=None, help="write the page here (default: see above)")
    args = parser.parse_args(argv)
    known = [name for name, _ in SUITES]
    chosen = [s for s in args.suite.split(",") if s]
    if unknown := [s for s in chosen if s not in known]:
        parser.error(f"unknown suite {', '.join(unknown)}; the suites are {', '.join(known)}")
    names = [n for n in known if not chosen or n in chosen]
    full = not args.quick and not chosen
    page = args.page or (PAGE if full else tables.results_dir() / "bench.md")
    started = datetime.datetime.now(datetime.UTC)
    print(f"# saev_shards benchmarks ({'quick' if args.quick else 'full'})\n")
    print(f"Machine: {tables.machine()}")
    print(f"Data under {tables.bench_dir()}, tables and plots under {tables.results_dir()}, the page: {page}\n")
    lines = header(args, names, started, page)
    failed = []
    for name, module_name in SUITES:
        if name in names:
            suite_lines, error = run_suite(name, module_name, args)
            lines += suite_lines
            if error:
                failed.append(name)
    page.parent.mkdir(parents=True, exist_ok=True)
    if page == PAGE:  # the plots this run drew (a scale plot of an earlier --scale run stays out)
        for plot in PLOTS:
            path = tables.results_dir() / plot
            if path.exists() and path.stat().st_mtime >= started.timestamp():
                shutil.copyfile(path, PAGE.parent / plot)
                lines += [f"![{plot}]({plot})", ""]
    page.write_text("\n".join(lines).rstrip("\n") + "\n")
    print(f"The page: {page}" + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
