"""Scale benchmark: costs as the work grows past RAM.

Every other suite's cache fits in the page cache. Here each measurement runs in a child
process held to a quarter of its cache's size by a cgroup of its own (`benchmarks.cgroup`:
v2 ``memory.max``, or v1 ``memory.limit_in_bytes`` on hybrid hosts), so the page cache can
hold neither the cache nor the shuffle's scratch runs: every byte comes from the disk, as on
a machine whose memory the cache outgrows. Three tables, every figure a same-run ratio:

1. the shuffle's time against a read plus a write of the same bytes by a child under the
   same limit (target <= 2.2 x; the floor is 2.0: the shuffle reads and writes every byte
   twice);
2. cold loaders against the disk: each loader's rate for the bytes its selection needs
   against a sequential read of every shard file (``cat``) under the same limit (target
   >= 0.9), with the bytes the disk was asked for per byte delivered, and one layer of two
   read as before `windows.WindowLoader.slice_reads` (whole examples, or slices without hints);
3. time and peak memory of `ss.open` and of a loader's first batch on caches of 1 GB to
   10 TB of logical size (sparse files: no data, the metadata and the plans only), each
   with its growth stated (constant, linear in shards, linear in tokens) from the sizes and
   from the largest size again with a quarter of the shards.

Where no memory limit can be set (no writable cgroup memory controller) tables 1 and 2 say
so and are skipped; table 3 needs none. Children are this file run with ``--child``.

    .venv/bin/python benchmarks/scale.py [--quick | --scale] [--keep]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pickle
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

import saev_shards as ss
from benchmarks import benchlib as bl
from benchmarks import cgroup, tables

#: The cgroup holds this fraction of the cache's bytes (memory and page cache together).
LIMIT_FRACTION = 4
#: No limit below this: the interpreter, numpy and torch alone take about 300 MB.
MIN_LIMIT = 512 << 20
#: Shards of the sparse caches: 200,000 patches, ~305 MB (10 TB is ~33,000 shards).
SPARSE_PATCHES_PER_SHARD = 200_000
#: What the rows held to a memory limit need, said where they are skipped.
NEEDS_CGROUP = "These rows need a writable cgroup memory controller (run as root on Linux)."
#: Free disk space the shuffle needs, in cache sizes: its output and its scratch runs.
SHUFFLE_SPACE = 2.2
#: A child's line that carries its result.
RESULT = "RESULT "
#: A figure is constant when it grows by less than this many times its value at the smallest size.
CONSTANT_BELOW = 1.0


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What one run measures: the cold cache's bytes, the sparse caches' logical bytes, rounds."""

    cold_bytes: int
    narrow_bytes: int  # the cache of small slices (0: none)
    sparse_bytes: tuple[int, ...]
    rounds: int
    #: Rounds of the shuffle table: each pairs one shuffle with the read + write limits
    #: measured just before and after it (the disk's rate drifts by a quarter from minute to minute).
    shuffle_rounds: int


def sizes_for(quick: bool, scale: bool) -> Sizes:
    """The quick run (development), the default (`make bench`: a few minutes) and ``--scale``."""
    if quick:
        return Sizes(512 << 20, 0, (10**9, 10**11, 10**13), 1, 1)
    if scale:
        return Sizes(8 << 30, 2 << 30, tuple(10**e for e in range(9, 14)), 3, 3)
    return Sizes(2 << 30, 1 << 30, tuple(10**e for e in range(9, 14)), 2, 5)


def limit_for(nbytes: int) -> int:
    """The memory limit of a child working on a cache of ``nbytes``: a quarter, page-aligned,
    never under `MIN_LIMIT`."""
    return max(MIN_LIMIT, (nbytes // LIMIT_FRACTION) >> 12 << 12)


def window_for(limit: int) -> int:
    """A loader's window under ``limit``: two windows (one read, one gathered) and the
    interpreter's own memory fit in half of it."""
    return max(16 << 20, min(1 << 30, limit // 8))


def scaled_metadata(nbytes: int, tag: str, d_model: int = 768, patches_per_shard: int = SPARSE_PATCHES_PER_SHARD,
                    patches: int = 196) -> ss.Metadata:  # fmt: skip
    """A ViT-B/16-shaped cache (layers 6 and 11, CLS + ``patches`` tokens) of about ``nbytes``."""
    example = 2 * (patches + 1) * d_model * 2
    return ss.Metadata(
        family="clip",
        ckpt="bench/ViT-B-16",
        layers=(6, 11),
        patches_per_ex=patches,
        cls_token=True,
        d_model=d_model,
        n_examples=max(1, round(nbytes / example)),
        patches_per_shard=patches_per_shard,
        data={"bench": tag},
        dataset="/bench",
    )


def growth(values: Sequence[float], fewer_shards: float, k: float, floor: float) -> str:
    """``constant``, ``linear in shards`` or ``linear in tokens``: how a figure grows with the cache.

    ``values``: the figure at each size, smallest first (at the smallest, 1 GB, every part
    that grows with the cache is negligible: the rest is what it costs at any size);
    ``fewer_shards``: the figure at the largest size with ``k`` times fewer shards. It is
    constant when it grows by less than `CONSTANT_BELOW` times its smallest value (or less
    than ``floor``, the measure's resolution); it grows with the shards when k times fewer
    of them cut its growth by at least sqrt(k), else with the tokens."""
    base = max(values[0], floor)
    grown = values[-1] - values[0]
    if grown < max(floor, CONSTANT_BELOW * base):
        return "constant"
    if fewer_shards - values[0] <= grown / math.sqrt(k):
        return "linear in shards"
    return "linear in tokens"


def ratio(value: float, limit: float) -> float:
    """``value / limit``, NaN where either is missing."""
    return value / limit if value == value and limit == limit and limit > 0 else float("nan")


def median_rows(samples: Sequence[dict[str, float]]) -> dict[str, float]:
    """The median of each figure over rounds (NaN where any round lacks it)."""
    keys = samples[0].keys() if samples else ()
    return {k: statistics.median(s.get(k, float("nan")) for s in samples) for k in keys}


# --------------------------------------------------------------------------------------
# the sparse caches (metadata-only rows)


def _zeros_digest(nbytes: int, chunk: int = 16 << 20) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    zeros = bytes(min(chunk, max(1, nbytes)))
    left = nbytes
    while left:
        n = min(left, len(zeros))
        h.update(zeros[:n] if n < len(zeros) else zeros)
        left -= n
    return h.hexdigest()


def sparse_cache(root: Path, md: ss.Metadata) -> Path:
    """A published cache described by ``md`` whose shard files are holes (read as zeros): its
    JSON files are what the writer would write, digests included; no data is on disk."""
    from saev_shards.protocol.common import BLOCKS_FILE, MANIFEST_FILE, METADATA_FILE, shard_name
    from saev_shards.protocol.manifest import Manifest, ShardEntry, ShardList
    from saev_shards.protocol.v31 import blocks_bytes, blocks_entry

    path = root / md.hash
    if (path / MANIFEST_FILE).exists():
        return path
    staging = root / f"{md.hash}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    (staging / METADATA_FILE).write_bytes(md.to_bytes())
    digests: dict[int, str] = {}
    block_size = md.rules.block_size
    blocks: dict[str, list[str]] = {}
    entries = []
    for k in range(md.n_shards):
        name, nbytes = shard_name(k), md.shard_nbytes(k)
        with open(staging / name, "wb") as f:
            f.truncate(nbytes)
        if nbytes not in digests:
            digests[nbytes] = _zeros_digest(nbytes)
        entries.append(ShardEntry(name, md.shard_n_examples(k), nbytes, digests[nbytes]))
        if block_size is not None:
            full, rest = divmod(nbytes, block_size)
            for n in (block_size, rest):
                if n and n not in digests:
                    digests[n] = _zeros_digest(n)
            blocks[name] = [digests[block_size]] * full + ([digests[rest]] if rest else [])
    manifest = Manifest(shards=ShardList.of(entries))
    if block_size is not None:
        data = blocks_bytes(block_size, blocks)
        (staging / BLOCKS_FILE).write_bytes(data)
        manifest = dataclasses.replace(manifest, blocks=blocks_entry(data))
    for name, data in md.rules.sidecars(manifest, md).items():
        (staging / name).write_bytes(data)
    (staging / MANIFEST_FILE).write_bytes(md.rules.manifest_bytes(manifest, md))
    staging.rename(path)
    return path


# --------------------------------------------------------------------------------------
# the children: one measurement each, in a process of its own (under the limit when set)


def _rss() -> int:
    """This process's peak resident bytes so far (the high-water mark, `_reset_peak` resets it)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak() -> int:
    """Reset the resident high-water mark (Linux: ``/proc/self/clear_refs``), returning the
    resident bytes now; where it cannot be reset, the peak so far (a growth under it reads 0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return _rss()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return _rss()


def child_read(files: list[str], write_to: str | None = None, write_bytes: int = 0) -> dict[str, float]:
    """``cat`` of ``files`` (8 MiB reads in file order) and, with ``write_to``, a write of
    ``write_bytes`` fsynced (``sync``): what any program pays for those bytes under the limit."""
    buf = bytearray(8 << 20)
    nbytes, start = 0, time.perf_counter()
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            while n := os.readv(fd, [buf]):
                nbytes += n
        finally:
            os.close(fd)
    read_s = time.perf_counter() - start
    out = {"read_s": read_s, "read_gbps": nbytes / read_s / 1e9, "read_bytes": float(nbytes)}
    if write_to:
        block = os.urandom(1 << 20) * 8
        start = time.perf_counter()
        with open(write_to, "wb", buffering=0) as f:
            left = write_bytes
            while left:
                left -= f.write(block[: min(left, len(block))])
            os.fsync(f.fileno())
        out["write_s"] = time.perf_counter() - start
        os.unlink(write_to)
    return out


def child_shuffle(path: str, out: str, memory: int) -> dict[str, float]:
    """One shuffle of the cache at ``path`` into ``out`` with a memory budget of ``memory``: its
    time, and that of its two passes (the scatter pass ends when every run is written)."""
    from saev_shards.shuffle import plan_shuffle, run_plan

    plan = plan_shuffle(ss.open(path), out, memory_bytes=memory)
    marks: dict[str, float] = {}

    def mark(kind: str, index: int) -> None:
        marks.setdefault(kind, time.perf_counter())

    start = time.perf_counter()
    result = run_plan(plan, after_step=mark)
    seconds = time.perf_counter() - start
    nbytes = result.metadata.nbytes
    result.close()
    ss.store.remove(result.path)
    scatter = marks["scattered"] - start
    return {"seconds": seconds, "scatter": scatter, "merge": seconds - scatter, "nbytes": float(nbytes)}


def paired_ratios(samples: Sequence[dict[str, float]], key: str) -> list[float]:
    """Each round's ``key`` over that round's limit: the limit is measured around the shuffle
    it is paired with, so the disk's drift between rounds moves both."""
    return [ratio(s[key], s["limit"]) for s in samples]


def spread(values: Sequence[float]) -> str:
    """``"lo-hi"`` of per-round ratios, for the table's range column."""
    return f"{min(values):.2f}-{max(values):.2f}" if values else ""


def child_loader(path: str, order: str, layers: int | None, before: bool, window: int) -> dict[str, float]:
    """A cold loader's rate over one epoch (stored bytes delivered from its first batch on), its first batch,
    and the bytes the disk was asked for per byte delivered. ``before``: layer selections read
    as before `WindowLoader.slice_reads` (whole examples under 128 KiB slices, else slices
    without hints)."""
    from saev_shards import loaders
    from saev_shards.codecs import gather
    from saev_shards.loaders import windows
    from saev_shards.reader.shards import Shards

    # numba's gather kernels loaded before the clocks start, as torch is imported: a process's
    # one-time cost (importing numba, its cached code, the kernels' check: 0.4-0.6 CPU s here,
    # and the garbage collector's full pass the import sets off), which a loader takes on a
    # thread of its own while its first windows use numpy. In an epoch of a second, as here, it
    # was half the loader's CPU time; in a training run it is nothing.
    gather.kernels_in_use()
    if before:
        windows.MIN_HINTED_SLICE = 1 << 62
        Shards.prefetch_slices = lambda self, start, stop, positions: None  # type: ignore[method-assign]
    shards = ss.open(path)
    itemsize = shards.metadata.itemsize
    io_before, start = bl.disk_read_bytes(), time.perf_counter()
    loader = loaders.TokenLoader(shards, 4096, layers=layers, order=order, buffer_bytes=window, mix_layers=True)
    it = iter(loader)
    first = next(it)
    t, cpu = time.perf_counter(), time.process_time()
    nbytes = 0
    for batch in it:
        nbytes += batch.acts.numel() * itemsize
    seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
    loader.close()
    delivered = nbytes + first.acts.numel() * itemsize
    io = bl.disk_read_bytes() - io_before
    return {
        "gbps": nbytes / seconds / 1e9,
        "first_s": t - start,
        "amplification": io / delivered if io >= 0 else float("nan"),
        "rss": float(_rss()),
        "cpu": cpu / (nbytes / 1e9) if nbytes else float("nan"),
    }


def child_slices(path: str, layer: int, threads: int) -> dict[str, float]:
    """The loader's cold read path for one layer alone, no gather: its 4 MiB spans in a random
    order, ``threads`` threads each taking the next span, hinting its slices
    (`Shards.prefetch_slices`) and reading them into a span's buffer (`Shards.read_slices_raw`),
    as `WindowLoader` does."""
    import itertools
    import threading

    from saev_shards.loaders import BLOCK_BYTES, MIN_SLICE_READ

    shards = ss.open(path)
    md = shards.metadata
    position = shards.layer_index(layer)
    slice_bytes = md.tokens_per_ex * md.d_model * md.itemsize
    rows = md.n_layers if slice_bytes < MIN_SLICE_READ else 1  # the span plan's examples (`plan.ReadSpans`)
    per_span = max(1, BLOCK_BYTES // (rows * slice_bytes))
    eps, n = shards.examples_per_shard, md.n_examples
    spans = [(a, min(a + per_span, n)) for lo in range(0, n, eps) for a in range(lo, min(lo + eps, n), per_span)]
    spans = [(a, min(b, (a // eps + 1) * eps)) for a, b in spans]
    order = np.random.default_rng(0).permutation(len(spans)).tolist()
    taken = itertools.count()

    def work() -> None:
        out = np.empty((per_span, rows, md.tokens_per_ex, md.d_model), shards.numpy_dtype)
        row = position if rows > 1 else 0  # the chosen layer's row in the span's buffer
        while (i := next(taken)) < len(order):
            a, b = spans[order[i]]
            shards.prefetch_slices(a, b, [position])
            shards.read_slices_raw(a, b, [position], out[: b - a], [row])

    start, cpu = time.perf_counter(), time.process_time()
    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    nbytes = md.n_examples * slice_bytes
    return {"gbps": nbytes / seconds / 1e9, "cpu": cpu / (nbytes / 1e9), "rss": float(_rss())}


def child_open(path: str, window: int, repeats: int = 3) -> dict[str, float]:
    """`ss.open` and a loader's first batch on a (sparse) cache: seconds (the best of ``repeats``)
    and peak memory (the first time) of each, and the size of the loader's saved state."""
    import torch  # noqa: F401 (imported before the clock and the memory start: a loader needs it)

    from saev_shards import loaders

    out: dict[str, float] = {}
    for i in range(repeats):
        base = _reset_peak()
        start = time.perf_counter()
        shards = ss.open(path)
        open_s = time.perf_counter() - start
        open_rss = _rss() - base
        base = _reset_peak()
        start = time.perf_counter()
        loader = loaders.TokenLoader(shards, 4096, layers=11, buffer_bytes=window)
        next(iter(loader))
        first_s = time.perf_counter() - start
        first_rss = _rss() - base
        state = len(pickle.dumps(loader.state_dict()))
        loader.close()
        shards.close()
        del loader, shards
        if i == 0:
            out = {"open_s": open_s, "open_rss": float(open_rss), "first_s": first_s,
                   "first_rss": float(first_rss), "state": float(state)}  # fmt: skip
        out["open_s"], out["first_s"] = min(out["open_s"], open_s), min(out["first_s"], first_s)
    return out


CHILDREN: dict[str, Callable[..., dict[str, float]]] = {
    "read": child_read,
    "shuffle": child_shuffle,
    "loader": child_loader,
    "slices": child_slices,
    "open": child_open,
}


def parse_result(stdout: str) -> dict[str, float]:
    """The figures a child printed (its last `RESULT` line); `RuntimeError` if it printed none."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT):
            return {k: float(v) for k, v in json.loads(line[len(RESULT) :]).items()}
    raise RuntimeError("the child printed no result")


def in_child(job: str, limit: cgroup.MemoryLimit | None, timeout: float = 3600, **kwargs: Any) -> dict[str, float]:
    """Run ``job`` in a new process (inside ``limit``'s cgroup when given): its figures;
    `RuntimeError` saying why when it failed (killed by the limit, or its error)."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps({"job": job, **kwargs})]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "cwd": tables.REPO}
    before = limit.oom_kills() if limit is not None else 0
    if limit is None:
        done = subprocess.run(argv, timeout=timeout, check=False, **pipes)  # type: ignore[call-overload]
    else:
        done = limit.run(argv, timeout=timeout, **pipes)
    oom = (limit.oom_kills() - before) if limit is not None else 0
    if done.returncode != 0:
        why = f"killed by the memory limit ({oom} processes)" if oom else done.stderr.strip()[-2000:]
        raise RuntimeError(f"{job} child failed (exit {done.returncode}): {why}")
    return parse_result(done.stdout)


def limited(nbytes: int) -> tuple[cgroup.MemoryLimit | None, str]:
    """A memory limit for work on a cache of ``nbytes``, and its description (or why none)."""
    try:
        limit = cgroup.MemoryLimit.create(limit_for(nbytes))
    except cgroup.Unavailable as e:
        return None, f"no memory limit can be set here ({e})"
    return limit, f"{limit.kind} = {limit.limit / 2**30:.2f} GiB ({limit.limit / nbytes:.2f} of the cache's bytes)"


# --------------------------------------------------------------------------------------
# tables


def skipped(name: str, title: str, why: str, needs: str = NEEDS_CGROUP) -> None:
    """A table of one row, "skipped", saying why (the suite goes on)."""
    table = tables.Table(name, title, ["row", "status"])
    table.add("every row", "skipped")
    table.note(f"Skipped: {why}. {needs}")
    table.emit()


def build(root: Path, md: ss.Metadata) -> ss.Shards:
    from benchmarks.loaders import build_cache

    return build_cache(root, md)


def bench_shuffle(shards: ss.Shards, sizes: Sizes, out: Path) -> None:
    title = f"Shuffle under a memory limit of a quarter of the cache ({tables.gb(shards.metadata.nbytes)})"
    limit, how = limited(shards.metadata.nbytes)
    if limit is None:
        return skipped("scale_shuffle", title, how)
    files = [str(shards.shard_path(k)) for k in range(shards.n_shards)]
    out.mkdir(parents=True, exist_ok=True)
    need, free = int(SHUFFLE_SPACE * shards.metadata.nbytes), shutil.disk_usage(out).free
    if free < need:
        limit.remove()
        return skipped(
            "scale_shuffle", title, f"{tables.gb(free)} free under {out}, the shuffle needs {tables.gb(need)}"
        )
    memory = limit.limit // 2  # what a machine of this much memory would give it: half
    samples: list[dict[str, float]] = []
    limits: list[float] = []
    with limit:
        for _ in range(sizes.shuffle_rounds):  # each shuffle between two read + write limits: the disk drifts
            bl.drop_cache(shards.path)
            a = in_child(
                "read", limit, files=files, write_to=str(out / "limit.bin"), write_bytes=shards.metadata.nbytes
            )
            bl.drop_cache(shards.path)
            s = in_child("shuffle", limit, path=str(shards.path), out=str(out), memory=memory)
            bl.drop_cache(shards.path)
            b = in_child(
                "read", limit, files=files, write_to=str(out / "limit.bin"), write_bytes=shards.metadata.nbytes
            )
            limits += [a["read_s"] + a["write_s"], b["read_s"] + b["write_s"]]
            rw = statistics.mean(limits[-2:])
            samples.append({"shuffle": s["seconds"], "scatter": s["scatter"], "merge": s["merge"], "limit": rw,
                            "read": (a["read_s"] + b["read_s"]) / 2, "write": (a["write_s"] + b["write_s"]) / 2,
                            "peak": float(limit.peak() or 0)})  # fmt: skip
    m = median_rows(samples)
    ratios = {key: paired_ratios(samples, key) for key in ("shuffle", "scatter", "merge")}
    m.update({f"{key}_ratio": statistics.median(r) for key, r in ratios.items()})
    table = tables.Table(
        "scale_shuffle",
        title,
        ["run", "seconds", "ratio to read + write", "range over rounds", "target", "floor"],
    )
    table.add("read of the source + write of as many bytes, fsynced (limit)", m["limit"], 1.0, "", "", "")
    table.add(f"shuffle, all layers, memory budget {memory >> 20} MiB", m["shuffle"], m["shuffle_ratio"],
              spread(ratios["shuffle"]), "<= 2.2", "2.0")  # fmt: skip
    table.add("its scatter pass (source read, runs written)", m["scatter"], m["scatter_ratio"],
              spread(ratios["scatter"]), "", "1.0")  # fmt: skip
    table.add("its write pass (runs read, output written and published)", m["merge"], m["merge_ratio"],
              spread(ratios["merge"]), "", "1.0")  # fmt: skip
    table.values.update(m)
    table.note(
        f"Each run is a child process under {how}; the page cache it fills is charged to the same cgroup, so it "
        "holds neither the source nor the scratch runs. The limit row is a child under the same limit reading every "
        f"shard file in order (8 MiB reads) then writing and fsyncing as many bytes (read {m['read']:.1f} s, write "
        f"{m['write']:.1f} s), measured before and after each shuffle. {sizes.shuffle_rounds} round(s), each a "
        "shuffle between two limits: a ratio is the median over rounds of each round's time over its own limit "
        "(the mean of the two around it), seconds the median seconds; the limit itself took "
        f"{min(limits):.2f}-{max(limits):.2f} s over this run's limits (the disk's rate drifts), so a shuffle is "
        "compared with the limits taken around it. The shuffle reads and writes every byte twice (scatter into "
        "runs, then merge), so 2.0 is its floor, 1.0 each pass's; the write pass reads the runs while it writes "
        "the output."
    )
    table.emit()


def loaders_read_threads() -> int:
    """The ShuffledLoader's default read threads on this machine."""
    from saev_shards.loaders import default_read_threads

    return default_read_threads()


def bench_cold(caches: list[ss.Shards], sizes: Sizes) -> None:
    biggest = max(s.metadata.nbytes for s in caches)
    title = "Cold loaders under a memory limit of a quarter of the cache: rate for the bytes each selection needs"
    limit, how = limited(biggest)
    if limit is None:
        return skipped("scale_cold_loaders", title, how)
    window = window_for(limit.limit)
    table = tables.Table(
        "scale_cold_loaders",
        title,
        ["cache", "loader", "GB/s", "ratio to cat", "disk bytes / byte", "CPU s/GB", "first batch (s)",
         "peak RSS (GB)"],
    )  # fmt: skip
    threads = loaders_read_threads()
    with limit:
        for shards in caches:
            md = shards.metadata
            files = [str(shards.shard_path(k)) for k in range(shards.n_shards)]
            slice_kib = md.tokens_per_ex * md.d_model * md.itemsize / 1024
            rows: dict[str, dict[str, Any]] = {
                "ShuffledLoader, both layers": dict(order="shuffled", layers=None, before=False),
                "ShuffledLoader, layer 11": dict(order="shuffled", layers=11, before=False),
                "ShuffledLoader, layer 11, read as before": dict(order="shuffled", layers=11, before=True),
                "OrderedLoader, layer 11": dict(order="ordered", layers=11, before=False),
            }
            alone = f"layer 11's hinted slice reads alone, {threads} threads, no gather"
            samples: dict[str, list[dict[str, float]]] = {k: [] for k in ["cat", alone, *rows]}
            for _ in range(sizes.rounds):
                for label, runs in samples.items():
                    bl.drop_cache(shards.path)
                    if label == "cat":
                        runs.append(in_child("read", limit, files=files))
                    elif label == alone:
                        runs.append(in_child("slices", limit, path=str(shards.path), layer=11, threads=threads))
                    else:
                        runs.append(in_child("loader", limit, path=str(shards.path), window=window, **rows[label]))
            cat = median_rows(samples["cat"])["read_gbps"]
            name = f"{tables.gb(md.nbytes)}, {slice_kib:.0f} KiB slices"
            table.add(name, "cat of every shard file (limit)", cat, 1.0, 1.0, "", "", "")
            for label in [alone, *rows]:
                m = median_rows(samples[label])
                table.add(name, label, m["gbps"], ratio(m["gbps"], cat), m.get("amplification", float("nan")),
                          m["cpu"], m.get("first_s", ""), m["rss"] / 1e9)  # fmt: skip
                table.values[f"{name}: {label}"] = ratio(m["gbps"], cat)
    table.note(
        f"Each row is a child process under {how} of the largest cache, the cache's pages dropped before it "
        f"(POSIX_FADV_DONTNEED); windows of {window >> 20} MiB, batches of 4096, median of {sizes.rounds} round(s). "
        "GB/s counts the stored bytes delivered in batches over one epoch (layer 11 alone is half of each example), "
        "from the first batch on (numba's gather kernels loaded before the clocks start, as torch is imported: "
        "a one-time cost of a process); disk bytes / byte is the bytes the process had read from storage "
        "(/proc/self/io, readahead included) per byte delivered. 'read as before' is the read path before the "
        "hinted slice reads: whole examples for slices under 128 KiB, else one slice per read thread at a time. "
        "The slice reads alone are the loaders' read path for layer 11 with nothing else (its spans in a random "
        "order, each span's slices hinted then read): where they reach cat and a loader does not, the loader's "
        "other work (CPU s/GB: the process's CPU time per GB delivered) is what holds it back. "
        "Target: >= 0.9 of cat for the bytes a selection needs."
    )
    table.emit()


def bench_open(root: Path, sizes: Sizes) -> None:
    points: list[tuple[ss.Metadata, dict[str, float]]] = []
    window = 64 << 20
    for nbytes in sizes.sparse_bytes:
        md = scaled_metadata(nbytes, "sparse")
        points.append((md, in_child("open", None, path=str(sparse_cache(root, md)), window=window)))
    big = scaled_metadata(sizes.sparse_bytes[-1], "sparse", patches_per_shard=4 * SPARSE_PATCHES_PER_SHARD)
    fewer = in_child("open", None, path=str(sparse_cache(root, big)), window=window)
    table = tables.Table(
        "scale_open",
        "Opening a cache and a loader's first batch against the cache's logical size (sparse shard files)",
        ["logical size", "shards", "open (s)", "open peak memory (MB)", "first batch (s)",
         "first batch peak memory (MB)", "loader state (bytes)"],
    )  # fmt: skip
    for md, r in [*points, (big, fewer)]:
        table.add(tables.gb(md.nbytes), f"{md.n_shards:,}", r["open_s"], r["open_rss"] / 1e6, r["first_s"],
                  r["first_rss"] / 1e6, f"{r['state']:,.0f}")  # fmt: skip
    last, first = points[-1][1], points[0][1]
    k = points[-1][0].n_shards / big.n_shards
    grows = []
    for key, label, floor in (("open_s", "open time", 1e-3), ("open_rss", "open memory", 1e6),
                              ("first_s", "first-batch time", 1e-3), ("first_rss", "first-batch memory", 1e6),
                              ("state", "loader state", 1.0)):  # fmt: skip
        how = growth([r[key] for _, r in points], fewer[key], k, floor)
        grows.append(f"{label}: {how} ({ratio(last[key], max(first[key], floor)):.1f} x from the smallest)")
    table.note(
        "Each row is a new process, torch imported before the clocks start; times are the best of 3 in it, peak "
        "memory the first time's (the growth of its resident high-water mark, reset before open and again before "
        "the loader, over what it held then; "
        "no memory limit: nothing is read from the disk but the JSON files); the first batch counts the loader's "
        "plan of the epoch and its first window. The loader state is the pickled `state_dict()`. The shard files "
        f"are holes, so the first batch reads zeros; its loader takes layer 11 with windows of {window >> 20} MiB. "
        f"The last row is the largest size again with shards {k:.0f} x larger. Growth with the cache (constant: "
        "less than doubles from the smallest size to the largest; linear in shards: a quarter of the shards at the "
        "largest size cuts its growth by half or more; else linear in tokens): " + "; ".join(grows) + "."
    )
    table.emit()


def main(quick: bool = False, scale: bool = False, keep: bool = False) -> None:
    sizes = sizes_for(quick, scale)
    root = tables.bench_dir() / "scale"
    root.mkdir(exist_ok=True)
    caches = [build(root, scaled_metadata(sizes.cold_bytes, "scale", patches_per_shard=2_400_000))]
    if sizes.narrow_bytes:  # 48 KiB slices: whole examples were read for a layer before
        caches.append(build(root, scaled_metadata(sizes.narrow_bytes, "scale-narrow", d_model=384, patches=63,
                                                  patches_per_shard=2_400_000)))  # fmt: skip
    try:
        bench_shuffle(caches[0], sizes, root / "shuffled")
        bench_cold(caches, sizes)
        bench_open(root / "sparse", sizes)
    finally:
        for c in caches:
            c.close()
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def child_main(spec: str) -> None:
    kwargs = json.loads(spec)
    figures = CHILDREN[kwargs.pop("job")](**kwargs)
    print(RESULT + json.dumps(figures), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, one round")
    parser.add_argument("--scale", action="store_true", help="an 8 GB cache under a 2 GiB limit, three rounds")
    parser.add_argument("--keep", action="store_true", help="keep the caches under bench_out/scale")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args.child)
    else:
        main(quick=args.quick, scale=args.scale, keep=args.keep)
