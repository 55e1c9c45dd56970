"""Writer scaling: 1, 2 and 4 writer processes filling one cache, against the disk's own limit.

Each writer process is what ``saev-shards dump --rank r --world-size W`` runs after the
model: a `ShardWriter` for its disjoint block of shards, with per-layer statistics (as the
dump gathers them) and durable writes (fsync of every part). The clock runs from the
moment every process is ready (data generated, Python started) until the last one has
closed; publishing (`finalize`, which joins the small column parts and writes the
manifest) is timed apart. The limit is a sequential O_DIRECT write of the same number of
bytes with one fsync, measured in the same run, interleaved with the writers.

    .venv/bin/python benchmarks/writers.py [--quick]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import saev_shards as ss
from benchmarks import benchlib as bl
from benchmarks import tables

#: A text-model-sized example: 2 layers x (CLS + 127 tokens) x 768, float16 (393 KB).
LAYERS, TOKENS, D_MODEL = (4, 8), 128, 768
#: Examples per write call, as a dump batch would hand them over.
BATCH = 32


def _metadata(n_examples: int) -> ss.Metadata:
    # ~32 MB shards: several per writer even in the quick run, so ranks share the work evenly.
    per_shard = (32 << 20) // (len(LAYERS) * TOKENS * D_MODEL * 2)
    return ss.Metadata(
        family="bench",
        ckpt="synthetic",
        layers=LAYERS,
        patches_per_ex=TOKENS - 1,
        cls_token=True,
        d_model=D_MODEL,
        n_examples=n_examples,
        patches_per_shard=per_shard * TOKENS * len(LAYERS),
        data={"bench": "writers"},
        dataset="synthetic",
    )


def _writer(root: str, md: ss.Metadata, rank: int, world: int, stats: bool, ready: Any, go: Any, out: Any) -> None:
    """One writer process: generate a batch, wait for the start, write this rank's share, close."""
    rng = np.random.default_rng(rank)
    batch = rng.standard_normal((BATCH, *md.shape[1:]), dtype=np.float32).astype(np.float16)
    lengths = rng.integers(1, TOKENS + 1, BATCH).astype(np.int32)
    writer = ss.ShardWriter(root, md, rank=rank, world_size=world, stats=stats, columns={"lengths": (np.int32, ())})
    ready.wait()
    go.wait()
    t = time.perf_counter()
    for a in range(writer.start, writer.stop, BATCH):
        n = min(BATCH, writer.stop - a)
        writer.write(batch[:n], columns={"lengths": lengths[:n]})
    writer.close()
    out.put((rank, time.perf_counter() - t))


def run_writers(root: Path, md: ss.Metadata, world: int, stats: bool) -> tuple[float, float]:
    """``(seconds until every writer closed, seconds to finalize after that)`` for ``world`` processes."""
    _remove(root)
    ctx = mp.get_context("spawn")
    ready, go = ctx.Barrier(world + 1), ctx.Barrier(world + 1)
    out: Any = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(str(root), md, r, world, stats, ready, go, out)) for r in range(world)]
    for p in procs:
        p.start()
    ready.wait()  # every process has started Python, generated its data and opened its writer
    go.wait()
    t = time.perf_counter()
    for p in procs:
        p.join()
    wall = time.perf_counter() - t
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a writer failed: exit codes {[p.exitcode for p in procs]}")
    t = time.perf_counter()
    if world > 1:  # a single writer publishes in close()
        ss.finalize(root, md, verify=False)
    publish = time.perf_counter() - t
    if not (root / md.hash).is_dir():
        raise RuntimeError(f"{root / md.hash} was not published")
    _remove(root)
    return wall, publish


def _remove(root: Path) -> None:
    """Delete a root holding published (read-only) caches."""
    if root.exists():
        for d in root.iterdir():
            if d.is_dir():
                d.chmod(0o755)
        shutil.rmtree(root)


def main(quick: bool = False) -> None:
    total = (256 << 20) if quick else (2 << 30)
    rounds = 1 if quick else 3
    md = _metadata(total // (len(LAYERS) * TOKENS * D_MODEL * 2))
    nbytes = md.nbytes
    base = tables.bench_dir() / "writers"
    base.mkdir(parents=True, exist_ok=True)
    finals: dict[str, list[float]] = {}

    def writers_rate(world: int, stats: bool) -> Any:
        def rate() -> float:
            wall, publish = run_writers(base / f"w{world}-{int(stats)}", md, world, stats)
            finals.setdefault(f"{world}-{int(stats)}", []).append(publish)
            return nbytes / (wall + publish) / 1e9  # until the cache is published

        return rate

    def odirect() -> float:
        path = base / "odirect.bin"
        try:
            return bl.odirect_write_gbps(path, nbytes)
        finally:
            path.unlink(missing_ok=True)

    configs = [(1, False), (1, True), (2, True), (4, True)]
    fns: dict[str, Any] = {"odirect": odirect}
    for world, stats in configs:
        fns[f"{world}-{int(stats)}"] = writers_rate(world, stats)
    rates = bl.interleaved(fns, rounds=rounds)
    limit = rates["odirect"]
    one = rates["1-1"]

    table = tables.Table(
        "writers",
        f"Writer scaling: one cache of {tables.gb(nbytes)} ({md.n_shards} shards of {tables.gb(md.shard_nbytes(0))}), "
        f"durable writes, median of {rounds} interleaved round(s)",
        ["writers", "statistics", "GB/s to published", "x O_DIRECT write", "x 1 writer (stats)", "finalize s"],
    )
    table.add("O_DIRECT sequential write (limit)", "-", limit, 1.0, "-", "-")
    for world, stats in configs:
        key = f"{world}-{int(stats)}"
        r = rates[key]
        table.add(
            f"{world} process{'es' if world > 1 else ''}",
            "on" if stats else "off",
            r,
            r / limit,
            r / one if stats else "-",
            float(np.median(finals[key])) if world > 1 else "in close",
        )
    table.note(f"Machine: {tables.machine()}.")
    table.note(
        "Each process runs a ShardWriter for its block of shards (what `saev-shards dump --rank r "
        "--world-size W` does after the forward pass), writing 32-example batches with a lengths column; "
        "the statistics pass (mean/var per dimension, norms, non-finite counts, padding excluded) is "
        "CPU work, so one writer with statistics is CPU-bound and more writers help until the disk "
        "saturates (x O_DIRECT near 1) or the cores run out."
    )
    table.emit()
    _remove(base)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="256 MB, one round: well under a minute")
    main(quick=parser.parse_args().quick)
