"""Shuffle benchmark: `saev-shards shuffle` against the machine's own limits.

Three tables, every figure a same-run ratio:

1. the shuffle's wall time against one sequential O_DIRECT read plus one sequential O_DIRECT
   write of the same bytes (the output's), measured in the same run (target <= 2.5 x: the
   two passes each read and write every byte once);
2. training reads from the shuffled cache, cold, against sequential O_DIRECT reads of its
   files (target >= 0.9 for the ordered read that gives a perfectly shuffled epoch), beside
   the windowed loader over the source;
3. batch diversity on an ImageNet-1k-sized cache, from the plans and the order alone (no
   data): the windowed loader, the shuffled cache's first epoch, cheap later epochs (the
   windowed loader over the shuffled cache with a new seed), and the perfect value.

    .venv/bin/python benchmarks/shuffle.py [--quick] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import saev_shards as ss
from benchmarks import benchlib as bl
from benchmarks import tables
from benchmarks.core import make_metadata
from benchmarks.loaders import (
    BATCH,
    build_cache,
    disk_limits,
    loader_table,
    shard_files,
    virtual_cache,
    virtual_shards,
)
from saev_shards import loaders
from saev_shards.errors import ShuffleError
from saev_shards.selection import SelectionSpec, parse_selection
from saev_shards.shuffle import bucket_of, plan_shuffle, run_plan, sort_keys
from saev_shards.shuffle.plan import output_metadata

GIB = 1 << 30


# --------------------------------------------------------------------------------------
# 1. shuffle time against one sequential read plus one sequential write


def read_plus_write_seconds(src: ss.Shards, path: Path, nbytes: int) -> tuple[float, float, float]:
    """``(seconds, write GB/s, read GB/s)``: an O_DIRECT write of ``nbytes`` to a new file (fsynced)
    and an O_DIRECT read of as many bytes of the source's shard files.

    The read is of files not just written: this virtual disk serves a file read right after it
    was written from a host-side cache, at up to twice its sequential rate.
    """
    write = bl.odirect_write_gbps(path, nbytes)
    path.unlink()
    read = bl.odirect_files_gbps(shard_files(src), limit=nbytes)
    return nbytes / write / 1e9 + nbytes / read / 1e9, write, read


def timed_shuffle(src: ss.Shards, out: Path, memory: int, **kwargs: Any) -> tuple[float, float, float, ss.Shards]:
    """``(seconds, scatter seconds, write seconds, result)`` of one shuffle from a cold source."""
    plan = plan_shuffle(src, out, memory_bytes=memory, **kwargs)
    if plan.path.exists():
        ss.store.remove(plan.path)
    bl.drop_cache(src.path)
    marks: dict[str, float] = {}

    def mark(kind: str, index: int) -> None:
        marks.setdefault(kind, time.perf_counter())

    start = time.perf_counter()
    result = run_plan(plan, after_step=mark)
    seconds = time.perf_counter() - start
    scatter = marks["scattered"] - start
    return seconds, scatter, marks["published"] - marks["scattered"], result


def bench_speed(src: ss.Shards, out: Path, quick: bool) -> ss.Shards:
    """Table 1; returns the layer-11 shuffled cache for the read benchmark."""
    memory = (128 << 20) if quick else GIB
    rounds = 1 if quick else 2
    cases: list[tuple[str, dict[str, Any]]] = [
        ("layer 11, content tokens", {"layers": 11}),
        ("both layers, content tokens", {"layers": None}),
    ]
    if not quick:
        cases.append(("both layers, content tokens, 2 processes", {"layers": None, "workers": 2}))
    table = tables.Table(
        "shuffle_speed",
        f"Shuffle time against one sequential read plus one sequential write of the output's bytes "
        f"(memory budget {memory >> 20} MiB)",
        ["shuffle", "output", "buckets", "shuffle (s)", "scatter / write (s)", "read + write limit (s)",
         "ratio to limit", "O_DIRECT write / read GB/s"],
    )  # fmt: skip
    kept: ss.Shards | None = None
    for label, kwargs in cases:
        plan = plan_shuffle(src, out, memory_bytes=memory, **kwargs)
        nbytes = plan.output.nbytes
        limits, shuffles = [], []
        limit_file = tables.bench_dir() / "shuffle-limit.bin"
        for _ in range(rounds):  # each shuffle bracketed by two limits: the disk's rate drifts by 2x in minutes
            if kept is not None:  # its folder may be shuffled into again (removed first): let go of it
                kept.close()
            before = read_plus_write_seconds(src, limit_file, nbytes)
            seconds, scatter, write, result = timed_shuffle(src, out, memory, **kwargs)
            after = read_plus_write_seconds(src, limit_file, nbytes)
            limits.append(tuple((a + b) / 2 for a, b in zip(before, after, strict=True)))
            shuffles.append((seconds, scatter, write))
            if kwargs == {"layers": 11}:
                kept = result
            else:
                result.close()
                ss.store.remove(result.path)
        limit = statistics.median(s for s, _, _ in limits)
        took = statistics.median(s for s, _, _ in shuffles)
        table.add(
            label,
            tables.gb(nbytes),
            plan.n_buckets,
            took,
            f"{statistics.median(s for _, s, _ in shuffles):.1f} / {statistics.median(w for _, _, w in shuffles):.1f}",
            limit,
            took / limit,
            f"{statistics.median(w for _, w, _ in limits):.2f} / {statistics.median(r for _, _, r in limits):.2f}",
        )
    table.note(
        f"Source: ViT-B/16-shaped cache of {src.n_examples:,} examples ({src.metadata.nbytes / 1e9:.1f} GB, 2 layers x "
        "197 tokens x 768, float16), page cache dropped before each shuffle. The limit is an O_DIRECT sequential write "
        "of the output's size (fsynced) plus an O_DIRECT sequential read of as many bytes of the source's files, "
        "measured just before and just after each shuffle (their mean); "
        f"medians of {rounds} rounds. The shuffle reads the source once, writes and reads scratch runs once and "
        "writes the output once: two reads and two writes of every byte, so 2.0 x is the floor on one disk. "
        "Target: <= 2.5 x."
    )
    table.emit()
    assert kept is not None
    return kept


# --------------------------------------------------------------------------------------
# 2. training reads from the shuffled cache


def bench_reads(shuffled: ss.Shards, src: ss.Shards, quick: bool) -> None:
    md = shuffled.metadata
    buffer = (64 if quick else 512) << 20
    contenders = {
        "OrderedLoader over the shuffled cache (a perfectly shuffled epoch)": lambda: loaders.OrderedLoader(
            shuffled, BATCH
        ),
        "OrderedLoader, 4 read threads, 16 MiB blocks, 256 MiB buffer": lambda: loaders.OrderedLoader(
            shuffled, BATCH, read_threads=4, block_bytes=16 << 20, buffer_bytes=256 << 20
        ),
        "ShuffledLoader over the shuffled cache, seed 1 (a cheap later epoch)": lambda: loaders.ShuffledLoader(
            shuffled, BATCH, seed=1, buffer_bytes=buffer
        ),
        "ShuffledLoader over the source, layer 11 (windowed shuffle)": lambda: loaders.ShuffledLoader(
            src, BATCH, layers=11, buffer_bytes=buffer
        ),
    }
    rounds = 1 if quick else 3
    table = loader_table(
        "shuffle_reads",
        f"Training reads, cold cache ({md.nbytes / 1e9:.1f} GB shuffled layer 11): ratio to sequential O_DIRECT "
        "reads and to buffered reads of the shuffled cache's files",
        disk_limits(shuffled, min(md.nbytes, 4 << 30)),
        contenders,
        rounds,
        before_each=lambda: bl.drop_cache([shuffled.path, src.path]),
    )
    table.note(
        f"Batches of {BATCH} token vectors of layer 11 (1,536 bytes each); page cache dropped before each sample; "
        f"median of {rounds} interleaved rounds, each timed from its first batch. Windows of {buffer >> 20} MiB for "
        "the windowed loaders. The limit reads with one 8 MiB request at a time; the loaders keep several in flight "
        "(OrderedLoader: 2 by default), which this virtual disk serves faster. "
        "Target for the ordered read of the shuffled cache: >= 0.9 x O_DIRECT."
    )
    table.emit()


# --------------------------------------------------------------------------------------
# 3. batch diversity (from plans and the order alone)


def ordinals_at(n_tokens: int, seed: int, rows: np.ndarray[Any, Any], n_buckets: int = 4096) -> np.ndarray[Any, Any]:
    """The source ordinal at each of ``rows`` of a shuffled cache of ``n_tokens``, without the whole order.

    The external shuffle's own method, in memory: count the keys per bucket, then sort only
    the buckets the rows fall in (two passes over the keys, never all of them held).
    """
    chunk = 1 << 24
    counts = np.zeros(n_buckets, dtype=np.int64)
    for a in range(0, n_tokens, chunk):
        keys = sort_keys(seed, np.arange(a, min(n_tokens, a + chunk), dtype=np.int64))
        counts += np.bincount(bucket_of(keys, n_buckets), minlength=n_buckets)
    first = np.concatenate([[0], np.cumsum(counts)])
    bucket_of_row = np.searchsorted(first, rows, side="right") - 1
    wanted = np.zeros(n_buckets, dtype=bool)
    wanted[bucket_of_row] = True
    parts: list[tuple[np.ndarray[Any, Any], ...]] = []
    for a in range(0, n_tokens, chunk):
        ordinals = np.arange(a, min(n_tokens, a + chunk), dtype=np.int64)
        keys = sort_keys(seed, ordinals)
        buckets = bucket_of(keys, n_buckets)
        keep = wanted[buckets]
        parts.append((buckets[keep], keys[keep], ordinals[keep]))
    buckets, keys, ordinals = (np.concatenate([p[i] for p in parts]) for i in range(3))
    ordinals = ordinals[np.lexsort((ordinals, keys, buckets))]  # bucket, then key, then source order
    segment = np.zeros(n_buckets + 1, dtype=np.int64)
    segment[1:] = np.cumsum(np.where(wanted, counts, 0))
    found: np.ndarray[Any, Any] = ordinals[segment[bucket_of_row] + (rows - first[bucket_of_row])]
    return found


def _diversity(examples: list[np.ndarray[Any, Any]], eps: int) -> tuple[float, float, float]:
    distinct = float(np.mean([len(np.unique(b)) for b in examples]))
    shards = float(np.mean([len(np.unique(b // eps)) for b in examples]))
    most = float(np.mean([np.unique(b, return_counts=True)[1].max() for b in examples]))
    return distinct, shards, most


def _with_mates(ids: np.ndarray[Any, Any]) -> float:
    _, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
    return float((counts[inverse] > 1).mean())


def bench_quality(quick: bool) -> None:
    n_examples = 64_000 if quick else 1_281_167  # ImageNet-1k train
    n_batches = 20 if quick else 100
    source = virtual_shards(n_examples)
    smd = source.metadata
    per_example = smd.patches_per_ex
    n_tokens = n_examples * per_example
    eps = smd.examples_per_shard
    selection = parse_selection(source, SelectionSpec(layers=11), ShuffleError)
    shuffled = virtual_cache(output_metadata(source, selection, 0, n_tokens, smd.dtype, smd.patches_per_shard))
    rng = np.random.default_rng(0)
    need = n_batches * BATCH

    def batches(values: np.ndarray[Any, Any]) -> list[np.ndarray[Any, Any]]:
        return [values[i * BATCH : (i + 1) * BATCH] for i in range(n_batches)]

    table = tables.Table(
        "shuffle_quality",
        f"Batch diversity: ImageNet-1k-sized cache ({n_examples:,} examples, {smd.n_shards} shards of {eps:,}), "
        f"layer 11 content tokens, batches of {BATCH}",
        ["epoch", "order", "distinct examples / batch", "distinct source shards / batch",
         "max tokens of one example / batch", "rows with an epoch-0 batch-mate"],
    )  # fmt: skip
    perfect = [rng.choice(n_tokens, BATCH, replace=False) for _ in range(n_batches)]
    table.add("any", "perfect (uniform, without replacement)", *_diversity([p // per_example for p in perfect], eps),
              f"{np.mean([_with_mates(p // BATCH) for p in perfect]):.1%}")  # fmt: skip
    window = loaders.ShuffledLoader(source, BATCH, layers=11, buffer_bytes=GIB)
    table.add("any", "ShuffledLoader over the source, 1 GiB window",
              *_diversity(batches(window.epoch_examples(0, need)), eps), "")  # fmt: skip
    window.close()
    first = ordinals_at(n_tokens, 0, np.arange(need, dtype=np.int64))
    table.add("0", "shuffled cache read in order (OrderedLoader)", *_diversity(batches(first // per_example), eps), "")
    for block in (4 << 20, 256 << 10):
        later = loaders.ShuffledLoader(shuffled, BATCH, seed=1, buffer_bytes=GIB, block_bytes=block)
        rows = later.epoch_examples(1, need)  # rows of the shuffled cache
        later.close()
        ordinals = ordinals_at(n_tokens, 0, rows)
        table.add(
            "1, 2, ...",
            f"ShuffledLoader over the shuffled cache, new seed, 1 GiB window, {block >> 10} KiB blocks",
            *_diversity(batches(ordinals // per_example), eps),
            f"{np.mean([_with_mates(b // BATCH) for b in batches(rows)]):.1%}",
        )
    table.note(
        f"Means over the first {n_batches} batches, computed from the loaders' plans and the shuffle order alone (no "
        "data is read). A row's epoch-0 batch is row // batch size in the shuffled cache; the last column is the "
        "share of rows that meet a row of their epoch-0 batch again (a fresh perfect shuffle: about batch^2 / tokens). "
        "A new `saev-shards shuffle --seed` gives a perfect later epoch at the cost of a shuffle."
    )
    table.emit()


# --------------------------------------------------------------------------------------


def main(quick: bool = False, keep: bool = False) -> None:
    print(f"Machine: {tables.machine()}\n", flush=True)
    work = tables.bench_dir() / "shuffle"
    work.mkdir(parents=True, exist_ok=True)
    n_examples = 600 if quick else 6_000  # 0.36 GB / 3.6 GB of source
    md = make_metadata(n_examples, "shuffle", patches_per_shard=200_000)  # 507 examples (307 MB) per shard
    src = build_cache(work, md)
    out = work / "shuffled"
    shuffled = None
    try:
        shuffled = bench_speed(src, out, quick)
        bench_reads(shuffled, src, quick)
    finally:
        src.close()
        if shuffled is not None:
            shuffled.close()
        if not keep:
            shutil.rmtree(work / md.hash, ignore_errors=True)
            with contextlib.suppress(OSError):
                for path in out.iterdir():
                    if path.name.startswith(".shuffle-"):  # a failed shuffle's scratch runs (no cache)
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        ss.store.remove(path)
                out.rmdir()
    bench_quality(quick)
    with contextlib.suppress(OSError):
        work.rmdir()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, one round (about a minute)")
    parser.add_argument("--keep", action="store_true", help="keep the source cache for the next run")
    args = parser.parse_args()
    main(args.quick, args.keep)
