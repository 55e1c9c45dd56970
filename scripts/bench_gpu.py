"""GPU-node benchmark (issues 15 and 34): the loaders beside the node's own limits, measured in one run.

Parts, in this order (``--parts`` picks some; each ends in one or two tables):

* ``build``: two caches of one ViT-B/16 shape (2 layers x 197 tokens x 768): float16, ``--gb``
  GB (8 by default), and float8_e4m3 of as many examples (about half the bytes), each
  written by one process per core (`ShardWriter` ranks, then `finalize`) from a random batch
  repeated, so 8 GB take seconds, not minutes.
* ``limits``: the node. memcpy by threads; ``pread`` of random 4 MiB blocks, and of random
  layer slices (what a one-layer loader reads), of the page-cached float16 cache into pinned
  memory, by threads; host-to-device copies (pinned, pageable), device-to-host, device to
  device; and reading into pinned memory *and* uploading at once (each read thread copies
  its blocks to the GPU on a stream of its own: the device-side shuffle's work, nothing else).
* ``modes``: `ShuffledLoader` page-cached, batches on the GPU: host gather (pageable,
  pinned), device-side shuffle (layer 11, every layer), stacked layers (host, device).
  Target: the device-side shuffle >= 0.8 of the pread limit.
* ``float8``: float8_e4m3 against float16, page-cached: tokens/s and bytes moved per token.
* ``sae``: a top-k SAE step (`saev_shards.sae`) on data already on the GPU against the same
  step fed by the loader. Target: >= 0.98.
* ``cold``: the page cache dropped before each sample: the loader against sequential and
  parallel O_DIRECT reads and parallel buffered reads of the same files. Target: >= 0.9 of
  the disk.
* ``threads``: the host gather by gather threads (issue 15).

Every loader sample also records where the loader's threads and the training loop spend
their time (their Python stacks sampled every 5 ms): docs/bench/gpu.md says from it what
limits each row.

Every table lands in the results file (``--results``, default results/gpu_results.json) the
moment it is done, so a part stopped at its time limit (scripts/gpu_session.sh gives each
one) loses only itself. ``--render FILE`` prints docs/bench/gpu.md made from such a file:
the machine, the tables, what limits each row, what would close each gap. Without CUDA the
host parts run, the device modes run on the CPU (``device="cpu"``: their host side only)
and the SAE step runs small on the CPU; the tables say so.

    .venv/bin/python scripts/bench_gpu.py [--quick] [--gb N] [--seconds S] [--parts a,b] [--keep]
    .venv/bin/python scripts/bench_gpu.py --render results/gpu_results.json > docs/bench/gpu.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import saev_shards as ss
from saev_shards import float8
from saev_shards.loaders.token_loader import default_read_threads, usable_cores
from scripts import benchlib as bl
from scripts.bench_core import D_MODEL, LAYERS, PATCHES

# torch (and with it saev_shards.loaders) is imported inside the parts that use it: the
# build part forks its writers from a process that never imported it.

BATCH = 4096
BLOCK = 4 << 20
LAYER = 11
#: Shards per cache: one writer process each, up to the cores.
SHARDS = 16
PARTS = ("build", "limits", "modes", "float8", "sae", "cold", "threads")
TARGETS = {"page_cached": 0.8, "cold": 0.9, "sae": 0.98}
#: Test runs scripts/gpu_session.sh records in the results (``--mark``), in words.
TEST_RUNS = {
    "cuda_tests": "The tests that need CUDA (test_cuda.py, the pinned-batch test, the docs' GPU block)",
    "suite": "The loader, recorder and float8 tests under this node's Python, numpy and torch",
}
F16, F8 = "float16", "float8_e4m3"


def thread_counts(limit: int) -> list[int]:
    """1, 2, 4, ... up to ``limit`` (and ``limit`` itself)."""
    counts = [1]
    while counts[-1] * 2 <= limit:
        counts.append(counts[-1] * 2)
    if counts[-1] != limit:
        counts.append(limit)
    return counts


# --------------------------------------------------------------------------------------
# the results file


class Results:
    """The results JSON: read at the start of each part, written after each table."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if path.exists():
            self.data: dict[str, Any] = json.loads(path.read_text())
        else:
            self.data = {
                "schema": 1,
                "started": now(),
                "machine": {},
                "caches": {},
                "limits": {},
                "cold": {},
                "tables": {},
                "parts": {},
            }

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_jsonable))
        os.replace(tmp, self.path)

    def table(self, part: str, table: bl.Table, rows: list[dict[str, Any]]) -> None:
        """Print ``table`` and keep it, with the figures behind each row (``rows``)."""
        table.emit()
        self.data["tables"][part] = {
            "name": table.name,
            "title": table.title,
            "columns": table.columns,
            "rows": table.rows,
            "notes": table.notes,
            "data": rows,
        }
        self.save()

    def part(self, name: str, status: str, seconds: float | None = None) -> None:
        self.data["parts"][name] = {"status": status, "seconds": seconds}
        self.save()


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON: {type(value).__name__}")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# --------------------------------------------------------------------------------------
# the machine


def machine_info(cuda: bool | None) -> dict[str, Any]:
    """The node, its disk, and (``cuda`` not None) torch and the GPU."""
    info: dict[str, Any] = {"summary": bl.machine(), "usable_cores": usable_cores(), "kernel": platform.release()}
    with contextlib.suppress(ImportError):
        import numba

        info["numba"] = numba.__version__
    info["float8_kernels"] = float8.kernels_in_use()
    work = bl.bench_dir()
    info["bench_dir"] = str(work)
    info["filesystem"] = filesystem_of(work)
    info["readahead_kb"] = bl.readahead_nbytes(work) // 1024
    if cuda is None:
        return info
    import torch

    info["torch"] = torch.__version__
    info["cuda"] = cuda
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["gpu_sms"] = props.multi_processor_count
        info["cuda_runtime"] = torch.version.cuda
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            fields = (
                "driver_version,pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max,pcie.link.width.max"
            )
            out = subprocess.run(
                ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            ).stdout.splitlines()[0]
            driver, gen, width, gen_max, width_max = (v.strip() for v in out.split(","))
            info["driver"] = driver
            info["pcie"] = f"gen {gen} x{width} (max gen {gen_max} x{width_max})"
    return info


def filesystem_of(path: Path) -> str:
    """``type (device)`` of the mount holding ``path``, from /proc/mounts."""
    best = ("", "?", "?")
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            dev, mount, kind = line.split()[:3]
            if str(path.resolve()).startswith(mount) and len(mount) >= len(best[0]):
                best = (mount, kind, dev)
    return f"{best[1]} ({best[2]} on {best[0]})"


def meminfo_cached_gb() -> float:
    """The page cache's size (``Cached`` of /proc/meminfo), GB; NaN where unknown."""
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


# --------------------------------------------------------------------------------------
# the caches


def gpu_metadata(n_examples: int, dtype: str) -> ss.Metadata:
    """The benchmark's ViT-B/16-shaped cache in ``dtype``, about `SHARDS` shards."""
    per_shard = max(1, -(-n_examples // SHARDS))
    return ss.Metadata(
        family="clip",
        ckpt="bench/ViT-B-16",
        layers=LAYERS,
        patches_per_ex=PATCHES,
        cls_token=True,
        d_model=D_MODEL,
        n_examples=n_examples,
        patches_per_shard=per_shard * (PATCHES + 1) * len(LAYERS),
        data={"bench": "gpu"},
        dataset="/bench",
        dtype=dtype,
    )


def _write_share(job: tuple[Path, ss.Metadata, int, int]) -> None:
    """Writer ``rank`` of ``world``: its examples, a random batch of 32 repeated."""
    root, md, rank, world = job
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((32, *md.shape[1:]), dtype=np.float32)
    x[..., :4] *= 20  # a few outlier dimensions, as a residual stream has
    batch: Any = x.astype(np.float16)
    scales = None
    if md.dtype == F8:
        batch, scales = float8.quantize_numpy(x)
    with ss.ShardWriter(root, md, rank=rank, world_size=world, durable=False) as w:
        for a in range(w.next_example, w.stop, len(x)):
            n = min(len(x), w.stop - a)
            w.write(batch[:n], scales=None if scales is None else scales[:n])


def build_cache(root: Path, md: ss.Metadata) -> tuple[ss.Shards, float | None]:
    """``md`` under ``root`` (kept from an earlier part when there); seconds taken, None if kept."""
    path = root / md.hash
    if path.exists():
        return ss.open(path), None
    world = max(1, min(usable_cores(), md.n_shards))
    t = time.perf_counter()
    jobs = [(root, md, r, world) for r in range(world)]
    if world == 1:
        _write_share(jobs[0])
    else:
        with multiprocessing.get_context("fork").Pool(world) as pool:
            pool.map(_write_share, jobs)
        ss.finalize(root, md, verify=False, durable=False)
    return ss.open(path), time.perf_counter() - t


def cache_nbytes(shards: ss.Shards) -> int:
    return sum(n for _, n, _ in shards.manifest.files())


def open_caches(res: Results, gb: float) -> dict[str, ss.Shards]:
    """The float16 and float8 caches of ``gb`` GB (float16), writing any that is missing."""
    n = max(64, int(gb * 1e9 / gpu_metadata(1, F16).example_nbytes))
    root = bl.bench_dir() / "gpu"
    root.mkdir(parents=True, exist_ok=True)
    caches = {}
    for dtype in (F16, F8):
        md = gpu_metadata(n, dtype)
        shards, seconds = build_cache(root, md)
        caches[dtype] = shards
        if seconds is not None:
            nbytes = cache_nbytes(shards)
            res.data["caches"][dtype] = {
                "path": str(shards.path),
                "examples": n,
                "shards": shards.n_shards,
                "nbytes": nbytes,
                "write_seconds": round(seconds, 1),
                "writers": max(1, min(usable_cores(), md.n_shards)),
            }
            print(
                f"(wrote the {dtype} cache, {nbytes / 1e9:.1f} GB in {shards.n_shards} shards, in {seconds:.1f} s)",
                flush=True,
            )
    res.save()
    return caches


def shard_files(shards: ss.Shards) -> list[Path]:
    files = [shards.shard_path(k) for k in range(shards.n_shards)]
    if shards.metadata.dtype == F8:
        files += [p for p in shards.path.rglob("*scales*") if p.is_file()]
    return files


def warm(shards: ss.Shards, threads: int = 8) -> None:
    """Every file of the cache read once (in parallel), so that it sits in the page cache."""
    files = [p for p in shards.path.rglob("*") if p.is_file()]
    bl.in_threads(threads, lambda i: bl.warm_cache(files[i::threads]))


def drop(paths: list[Path], drop_all: bool) -> str:
    """Evict ``paths`` from the page cache; ``drop_all``: the whole page cache as well
    (/proc/sys/vm/drop_caches, root only). Returns the method that worked."""
    bl.drop_cache(paths)
    if not drop_all:
        return "posix_fadvise(DONTNEED) per file"
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as err:
        return f"posix_fadvise(DONTNEED) per file (drop_caches refused: {err.strerror})"
    return "drop_caches (echo 3 > /proc/sys/vm/drop_caches) after posix_fadvise(DONTNEED) per file"


# --------------------------------------------------------------------------------------
# where the time goes: the threads' Python stacks, sampled


#: Functions of the loaders, by the stage of their work the stack sampler counts them in.
STAGES = {
    "device.host_waits": "upload wait",
    "windows._index": "index",
    "plan.index_window": "index",
    "windows._read_block": "read",
    "mapped.make_resident": "read",
    "device._upload": "upload",
    "host_run._chunk": "gather",
    "device._batch": "batch",
    "host_run._consume": "batch",
}


class Sampler:
    """Every ``interval`` seconds, the innermost frame of each thread: `profile` gives, for the
    training loop ("main"), the read threads and the gather threads, the share of samples in
    each place (``module.function``, ``[wait]`` when blocked in a lock, queue or future)."""

    WAITS = ("threading.py", "queue.py", "_base.py", "thread.py")

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.counts: dict[str, Counter[str]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self.stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                role = self.role(names.get(ident, ""))
                if role is not None:
                    self.counts.setdefault(role, Counter())[self.place(frame)] += 1

    @staticmethod
    def role(name: str) -> str | None:
        if name == "MainThread":
            return "main"
        for prefix, role in (("saev-loader-read", "read"), ("saev-loader-gather", "gather")):
            if name.startswith(prefix):
                return role
        return None

    def place(self, frame: Any) -> str:
        """The stage of the innermost known function on the stack (`STAGES`), else the innermost
        frame of this library or of this script; `` [wait]`` when blocked in Python's threading."""
        waiting = Path(frame.f_code.co_filename).name in self.WAITS
        suffix = " [wait]" if waiting else ""
        fallback = None
        f = frame
        while f is not None:
            path = f.f_code.co_filename
            name = f"{Path(path).stem}.{f.f_code.co_name}"
            if name in STAGES:
                return STAGES[name] + suffix
            if fallback is None and ("saev_shards" in path or path.endswith("bench_gpu.py")):
                fallback = name
            f = f.f_back
        if fallback is not None:
            return ("loop" if fallback.startswith("bench_gpu.") else fallback) + suffix
        return "idle [wait]" if waiting else f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_name}"

    def profile(self, top: int = 4) -> dict[str, list[tuple[str, float]]]:
        out = {}
        for role, counts in self.counts.items():
            total = sum(counts.values())
            out[role] = [(place, round(n / total, 3)) for place, n in counts.most_common(top)]
        return out


# --------------------------------------------------------------------------------------
# the node's limits


def memcpy_threads_gbps(threads: int, nbytes: int = 256 << 20) -> float:
    """``threads`` threads each copying their own ``nbytes`` buffer (numpy releases the GIL)."""
    pairs = [(np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)) for _ in range(threads)]
    for src, dst in pairs:
        np.copyto(dst, src)

    def work(i: int) -> None:
        src, dst = pairs[i]
        for _ in range(3):
            np.copyto(dst, src)

    return 3 * threads * nbytes / bl.in_threads(threads, work) / 1e9


def host_buffer(nbytes: int, pinned: bool) -> np.ndarray[Any, Any]:
    import torch

    if pinned:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
    return np.ones(nbytes, np.uint8)  # touched, as a loader's reused buffers are


def random_jobs(paths: list[Path], block: int, n: int, seed: int = 0) -> tuple[list[int], list[tuple[int, int]]]:
    """``n`` random ``(fd, offset)`` reads of ``block`` bytes over ``paths`` (fds to close)."""
    sizes = [os.stat(p).st_size for p in paths]
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(paths), n)
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    return fds, [(fds[k], int(rng.integers(0, max(1, sizes[k] - block)))) for k in picks.tolist()]


def pread_threads_gbps(paths: list[Path], threads: int, total: int, pinned: bool, block: int = BLOCK) -> float:
    """Random ``block``-byte preads of page-cached ``paths`` into one (pinned) buffer per thread."""
    fds, jobs = random_jobs(paths, block, max(threads, total // block))
    buffers = [host_buffer(block, pinned) for _ in range(threads)]

    def work(i: int) -> None:
        view = buffers[i].data
        for fd, off in jobs[i::threads]:
            os.preadv(fd, [view], off)

    try:
        return len(jobs) * block / bl.in_threads(threads, work) / 1e9
    finally:
        for fd in fds:
            os.close(fd)


def read_upload_gbps(paths: list[Path], threads: int, total: int) -> float:
    """Random 4 MiB preads into pinned memory, each block then copied to the GPU on the
    thread's own stream (two pinned buffers per thread, one filling while the other uploads):
    the device-side shuffle's work without anything else."""
    import torch

    fds, jobs = random_jobs(paths, BLOCK, max(threads, total // BLOCK), seed=1)
    pinned = [[torch.empty(BLOCK, dtype=torch.uint8, pin_memory=True) for _ in range(2)] for _ in range(threads)]
    dev = torch.empty((threads, 2, BLOCK), dtype=torch.uint8, device="cuda")
    streams = [torch.cuda.Stream() for _ in range(threads)]

    def work(i: int) -> None:
        events: list[Any] = [None, None]
        with torch.cuda.stream(streams[i]):
            for j, (fd, off) in enumerate(jobs[i::threads]):
                k = j % 2
                if events[k] is not None:
                    events[k].synchronize()
                os.preadv(fd, [pinned[i][k].numpy().data], off)
                dev[i, k].copy_(pinned[i][k], non_blocking=True)
                events[k] = torch.cuda.Event()
                events[k].record()
            streams[i].synchronize()

    try:
        return len(jobs) * BLOCK / bl.in_threads(threads, work) / 1e9
    finally:
        for fd in fds:
            os.close(fd)


def copy_gbps(kind: str, nbytes: int = 512 << 20, repeats: int = 8) -> float:
    """``h2d`` (pinned), ``h2d_pageable``, ``d2h`` (pinned) or ``d2d`` (bytes read + written) copies."""
    import torch

    pinned = kind != "h2d_pageable"
    host = torch.ones(nbytes, dtype=torch.uint8).pin_memory() if pinned else torch.ones(nbytes, dtype=torch.uint8)
    dev = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty_like(dev)
    src, dst = {"h2d": (host, dev), "h2d_pageable": (host, dev), "d2h": (dev, host), "d2d": (dev, dev2)}[kind]
    dst.copy_(src, non_blocking=pinned)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src, non_blocking=pinned)
    torch.cuda.synchronize()
    moved = repeats * nbytes * (2 if kind == "d2d" else 1)
    return moved / (time.perf_counter() - start) / 1e9


def part_limits(res: Results, caches: dict[str, ss.Shards], cuda: bool, quick: bool) -> None:
    shards = caches[F16]
    warm(shards)
    cores = usable_cores()
    total = (512 if quick else 4096) << 20
    files = shard_files(shards)
    md = shards.metadata
    slice_bytes = md.tokens_per_ex * md.d_model * md.itemsize
    table = bl.Table(
        "gpu_limits",
        f"The node's limits ({cores} usable cores; float16 cache page-cached; CUDA: {cuda})",
        ["what", "threads", "GB/s"],
    )
    rows: list[dict[str, Any]] = []
    limits: dict[str, float] = {}

    def add(key: str | None, what: str, threads: int | str, gbps: float) -> None:
        table.add(what, threads, gbps)
        rows.append({"key": key, "what": what, "threads": threads, "gbps": gbps})
        if key is not None:
            limits[key] = max(limits.get(key, 0.0), gbps)

    for threads in thread_counts(min(cores, 16)):
        add("memcpy", "memcpy, 256 MiB buffers per thread", threads, memcpy_threads_gbps(threads))
    where = "pinned" if cuda else "pageable"
    for threads in thread_counts(min(2 * cores, 32)):
        add(
            "pread",
            f"pread of random 4 MiB blocks into {where} memory",
            threads,
            pread_threads_gbps(files, threads, total, cuda),
        )
    for threads in sorted({4, default_read_threads(device_side=True), min(2 * cores, 32)}):
        add(
            "pread_slices",
            f"pread of random layer slices ({slice_bytes:,} B) into {where} memory",
            threads,
            pread_threads_gbps(files, threads, total // 2, cuda, block=slice_bytes),
        )
    if cuda:
        add("h2d", "host-to-device copy, pinned, 512 MiB", 1, copy_gbps("h2d"))
        add("h2d_pageable", "host-to-device copy, pageable, 512 MiB", 1, copy_gbps("h2d_pageable"))
        add("d2h", "device-to-host copy, pinned, 512 MiB", 1, copy_gbps("d2h"))
        add("d2d", "device-to-device copy (bytes read + written)", 1, copy_gbps("d2d"))
        for threads in sorted({4, default_read_threads(device_side=True)}):
            add(
                "read_upload",
                "pread of random 4 MiB blocks into pinned memory + upload, one stream per thread",
                threads,
                read_upload_gbps(files, threads, total),
            )
    table.note(
        "Each figure from this run, once. The pread limit the loader tables use is the best over thread counts "
        "of the 4 MiB row; 'read + upload' is what the device-side shuffle does, nothing else."
    )
    res.data["limits"].update(limits)
    res.table("limits", table, rows)


# --------------------------------------------------------------------------------------
# loaders


def vector_nbytes(shards: ss.Shards) -> int:
    """Stored bytes per token vector: values, and a float8_e4m3 cache's float32 scale."""
    md = shards.metadata
    return md.d_model * md.itemsize + (4 if md.dtype == F8 else 0)


def loader_sample(make: Callable[[], Any], seconds: float, move: bool, cuda: bool, epochs: int = 0) -> dict[str, Any]:
    """One loader's batches for ``seconds``, timed from its first batch, epoch after epoch
    (``epochs``: at most that many; 0, as many as fit): GB/s of stored bytes and vectors/s
    with the later epochs' start-ups (``iter`` to their first batch) left out and reported
    apart, seconds to the first batch, process CPU seconds per GB, and where the threads spent
    the time (`Sampler`). ``move``: copy each batch's acts to the GPU (non_blocking from pinned
    memory), as training would."""
    import torch

    loader = make()
    per_vector = vector_nbytes(loader.shards)
    d = loader.shards.metadata.d_model

    def moved(batch: Any) -> Any:
        return batch.acts.to("cuda", non_blocking=batch.acts.is_pinned()) if move and cuda else batch.acts

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    start = time.perf_counter()
    it = iter(loader)
    moved(next(it))
    sync()
    first = time.perf_counter() - start
    vectors = batches = 0
    restarts: list[float] = []
    with Sampler() as sampler:
        t, cpu = time.perf_counter(), time.process_time()
        while True:
            for batch in it:
                moved(batch)
                vectors += batch.acts.numel() // d
                batches += 1
                if time.perf_counter() - t >= seconds:
                    break
            else:  # the epoch ended: the next one, unless the time or the epochs are up
                if time.perf_counter() - t < seconds and (not epochs or len(restarts) + 1 < epochs):
                    r = time.perf_counter()
                    it = iter(loader)
                    batch = next(it, None)
                    restarts.append(time.perf_counter() - r)
                    if batch is not None:
                        moved(batch)
                        vectors += batch.acts.numel() // d
                        batches += 1
                        continue
            break
        sync()
        dt, cpu = time.perf_counter() - t, time.process_time() - cpu
    del it
    loader.close()
    nbytes = vectors * per_vector
    steady = max(dt - sum(restarts), 1e-9)
    return {
        "gbps": nbytes / steady / 1e9,
        "vectors_per_s": vectors / steady,
        "first_batch_s": first,
        "epoch_restarts": len(restarts),
        "restart_s": statistics.mean(restarts) if restarts else 0.0,
        "restart_share": sum(restarts) / max(dt, 1e-9),
        "cpu_s_per_gb": cpu / max(nbytes / 1e9, 1e-9),
        "cores_busy": cpu / dt,
        "batches": batches,
        "seconds": dt,
        "bytes_per_vector": per_vector,
        "profile": sampler.profile(),
    }


def shuffled(shards: ss.Shards, **kwargs: Any) -> Callable[[], Any]:
    from saev_shards import loaders

    return lambda: loaders.ShuffledLoader(shards, BATCH, **kwargs)


def device_name(cuda: bool) -> str:
    return "cuda" if cuda else "cpu"


def ratio(value: float, limit: float | None) -> float:
    return value / limit if limit else float("nan")


def part_modes(res: Results, caches: dict[str, ss.Shards], cuda: bool, seconds: float) -> None:
    shards = caches[F16]
    warm(shards)
    limits = res.data["limits"]
    dev = device_name(cuda)
    modes: dict[str, tuple[str, Callable[[], Any], bool]] = {
        "host gather": ("host", shuffled(shards, layers=LAYER), True),
        "host gather, pin_memory": ("host", shuffled(shards, layers=LAYER, pin_memory=True), True),
        f"device-side shuffle ({dev})": ("device", shuffled(shards, layers=LAYER, device=dev), False),
        f"device-side shuffle ({dev}), every layer": ("device", shuffled(shards, mix_layers=True, device=dev), False),
        "stacked layers (B, 2, D), host, pin_memory": (
            "host",
            shuffled(shards, stack_layers=True, pin_memory=True),
            True,
        ),
        f"stacked layers (B, 2, D), device ({dev})": ("device", shuffled(shards, stack_layers=True, device=dev), False),
    }
    table = bl.Table(
        "gpu_loader_modes",
        "ShuffledLoader by mode, float16 cache page-cached, batches of 4,096 delivered "
        + ("on the GPU" if cuda else "on the host (no CUDA)")
        + ": ratio to parallel pread into pinned memory and to reading + uploading",
        [
            "mode",
            "GB/s",
            "tokens/s",
            "ratio to pread limit",
            "ratio to read + upload",
            "first batch (s)",
            "epoch start-up (s)",
            "CPU cores busy",
        ],
    )
    table.add("pread limit", limits.get("pread", float("nan")), "", 1.0, "", "", "", "")
    if "read_upload" in limits:
        table.add(
            "read + upload limit",
            limits["read_upload"],
            "",
            ratio(limits["read_upload"], limits.get("pread")),
            1.0,
            "",
            "",
            "",
        )
    rows = []
    for name, (kind, make, move) in modes.items():
        s = loader_sample(make, seconds, move, cuda)
        table.add(
            name,
            s["gbps"],
            s["vectors_per_s"],
            ratio(s["gbps"], limits.get("pread")),
            ratio(s["gbps"], limits.get("read_upload")),
            s["first_batch_s"],
            s["restart_s"] if s["epoch_restarts"] else "",
            s["cores_busy"],
        )
        rows.append({"mode": name, "kind": kind, **s})
    table.note(
        f"Layer {LAYER} unless said (every layer: both layers' vectors, mixed on purpose); {seconds:g} s per row "
        "from its first batch, one sample, epoch after epoch, the later epochs' start-ups (iter() to their first "
        "batch) left out of the rates and shown apart (their mean); GB/s counts stored bytes delivered. Host "
        "modes include each batch's copy to the GPU. Target: the device-side shuffle >= 0.8 of the pread limit."
    )
    res.table("modes", table, rows)


def part_float8(res: Results, caches: dict[str, ss.Shards], cuda: bool, seconds: float) -> None:
    for shards in caches.values():
        warm(shards)
    dev = device_name(cuda)
    d = D_MODEL
    table = bl.Table(
        "gpu_float8",
        "float8_e4m3 against float16, page-cached, batches of 4,096 on the "
        + ("GPU" if cuda else "host (no CUDA)")
        + ": tokens/s and bytes moved per token",
        [
            "mode",
            "cache",
            "tokens/s",
            "float8 / float16",
            "GB/s stored",
            "bytes read / token",
            "bytes to the GPU / token",
        ],
    )
    modes: dict[str, tuple[dict[str, Any], bool]] = {
        f"device-side shuffle ({dev}), layer {LAYER}": ({"layers": LAYER, "device": dev}, False),
        f"stacked layers, device ({dev})": ({"stack_layers": True, "device": dev}, False),
        f"host gather, pin_memory, layer {LAYER}": ({"layers": LAYER, "pin_memory": True}, True),
    }
    rows = []
    for name, (kwargs, move) in modes.items():
        rates = {}
        for dtype in (F16, F8):
            s = loader_sample(shuffled(caches[dtype], **kwargs), seconds, move, cuda)
            rates[dtype] = s["vectors_per_s"]
            values = d * (2 if dtype == F16 else 1) + (4 if dtype == F8 else 0)
            per_unit = 2 if kwargs.get("stack_layers") else 1
            # device path: the values (and scales) of each vector, its 8-byte gather index, and
            # per row three int64 of metadata; host path: the float16 batch (dequantized on the host).
            to_gpu = values + 8 + 24 // per_unit if not move else 2 * d
            table.add(name, dtype, s["vectors_per_s"], rates[dtype] / rates[F16], s["gbps"], values, to_gpu)
            rows.append(
                {"mode": name, "cache": dtype, "bytes_read_per_token": values, "bytes_to_gpu_per_token": to_gpu, **s}
            )
    table.note(
        f"{seconds:g} s per row from its first batch, one sample; tokens are token vectors (a stacked row holds "
        "two). float8 batches come out float16, dequantized on the device (device path) or on the host. Bytes to "
        "the GPU count the window slots' values, scales, gather index and metadata (device path), or the "
        "float16 batch (host path)."
    )
    res.table("float8", table, rows)


def part_sae(res: Results, caches: dict[str, ss.Shards], cuda: bool, seconds: float) -> None:
    import torch

    from saev_shards.sae import TopKSAE

    for shards in caches.values():
        warm(shards)
    device = torch.device(device_name(cuda))
    n_latents, k = (16_384, 32) if cuda else (1_024, 32)
    sae = TopKSAE(D_MODEL, n_latents, k=k).to(device)
    opt = torch.optim.Adam(sae.parameters(), lr=1e-4)

    def step(x: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            x_hat, _ = sae(x.float())
            loss = ((x_hat.float() - x.float()) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    warmup = 10 if cuda else 2  # a step on a CPU takes a good part of a second

    def timed(batches: Iterator[torch.Tensor], restarts: list[float] | None = None) -> float:
        """Tokens/s of the steps over ``batches`` for ``seconds``, after ``warmup`` untimed steps,
        less the loader's epoch start-ups (``restarts``, appended to as they happen)."""
        restarts = [] if restarts is None else restarts
        for _ in range(warmup):
            step(next(batches))
        sync()
        t, n, before = time.perf_counter(), 0, len(restarts)
        while time.perf_counter() - t < seconds:
            step(next(batches))
            n += 1
        sync()
        return n * BATCH / (time.perf_counter() - t - sum(restarts[before:]))

    resident = [torch.randn(BATCH, D_MODEL, device=device).half() for _ in range(16)]

    def on_device() -> float:
        return timed(resident[i % len(resident)] for i in range(10**9))

    def fed(shards: ss.Shards, **kwargs: Any) -> Callable[[], float]:
        def run() -> float:
            from saev_shards import loaders

            loader = loaders.ShuffledLoader(shards, BATCH, layers=LAYER, **kwargs)
            pinned = bool(kwargs.get("pin_memory"))
            restarts: list[float] = []
            try:
                return timed((b.acts.to(device, non_blocking=pinned) for b in epochs(loader, restarts)), restarts)
            finally:
                loader.close()

        return run

    feeds = {
        "already on the device": on_device,
        "float16, device-side shuffle": fed(caches[F16], device=device.type),
        "float16, host gather, pin_memory": fed(caches[F16], pin_memory=True),
        "float8_e4m3, device-side shuffle": fed(caches[F8], device=device.type),
    }
    rounds = 2
    medians = bl.interleaved(feeds, rounds=rounds)
    base = medians["already on the device"]
    table = bl.Table(
        "gpu_sae_step",
        f"Top-k SAE {D_MODEL} -> {n_latents:,}, k={k}, Adam, bf16 autocast, batches of 4,096, on {device.type}: "
        "fed by the loader against data already there",
        ["data", "tokens/s", "ratio to on-device", "loader GB/s needed"],
    )
    rows = []
    for name, rate in medians.items():
        cache = caches[F8] if "float8" in name else caches[F16]
        need = rate * vector_nbytes(cache) / 1e9
        table.add(name, rate, rate / base, need if name != "already on the device" else "")
        rows.append({"data": name, "tokens_per_s": rate, "ratio": rate / base, "loader_gbps_needed": need})
    table.note(
        f"Median of {rounds} interleaved rounds of {seconds:g} s each ({warmup} untimed steps first; the loader's "
        f"epoch start-ups left out, as in the loader tables); layer {LAYER}. "
        "'Loader GB/s needed': stored bytes per second the loader delivers at that rate. Target: >= 0.98 of "
        "on-device."
    )
    res.table("sae", table, rows)


def epochs(loader: Any, restarts: list[float]) -> Iterator[Any]:
    """The loader's batches, epoch after epoch; the seconds from the end of each epoch to the
    next one's first batch are appended to ``restarts``."""
    ended = None
    while True:
        for i, batch in enumerate(loader):
            if i == 0 and ended is not None:
                restarts.append(time.perf_counter() - ended)
            yield batch
        ended = time.perf_counter()


def disk_limits(
    paths: list[Path], threads: int, seconds: float, drop_all: bool
) -> tuple[list[tuple[str, int, float]], str]:
    """Sequential O_DIRECT (one 8 MiB request at a time), random 4 MiB O_DIRECT with
    ``threads`` requests in flight, and buffered 4 MiB preads in file order by ``threads``
    threads, each cold and sized to take about ``seconds``: ``[(what, threads, GB/s)]``, method."""
    total = sum(os.stat(p).st_size for p in paths)
    method = drop(paths, drop_all)
    probe_bytes = min(total, 256 << 20)
    probe = odirect_files_gbps(paths, probe_bytes)
    budget = int(min(total, max(probe_bytes, probe * 1e9 * seconds)))
    out = [("sequential O_DIRECT reads, 8 MiB requests", 1, odirect_files_gbps(paths, budget))]
    drop(paths, drop_all)
    block = min(BLOCK, max(os.stat(p).st_size for p in paths) // bl.ALIGN * bl.ALIGN)  # small caches' shards
    gbps, _ = bl.odirect_random_read_files(paths, block, max(threads, budget // block), threads)
    out.append((f"random O_DIRECT reads, {block >> 10:,} KiB requests", threads, gbps))
    drop(paths, drop_all)
    out.append(("buffered 4 MiB preads in file order", threads, bl.buffered_read_gbps(paths, threads, limit=budget)))
    return out, method


def odirect_files_gbps(paths: list[Path], limit: int) -> float:
    """Sequential O_DIRECT reads of ``paths`` in turn, up to ``limit`` bytes in all."""
    done, elapsed = 0, 0.0
    for path in paths:
        size = min(os.stat(path).st_size, limit - done)
        if size < bl.DIRECT_BLOCK:
            break
        gbps = bl.odirect_read_gbps(path, limit=size)
        read = size - size % bl.DIRECT_BLOCK
        elapsed += read / gbps / 1e9
        done += read
    return done / max(elapsed, 1e-9) / 1e9


def part_cold(res: Results, caches: dict[str, ss.Shards], cuda: bool, seconds: float, drop_all: bool) -> None:
    t = time.perf_counter()
    os.sync()  # the caches were written moments ago: their pages must be clean to be dropped
    synced = time.perf_counter() - t
    files16 = shard_files(caches[F16])
    every = [p for c in caches.values() for p in c.path.rglob("*") if p.is_file()]
    before = meminfo_cached_gb()
    threads = default_read_threads(device_side=cuda)
    limit_rows, method = disk_limits(files16, threads, seconds, drop_all)
    after = meminfo_cached_gb()
    disk = max(g for _, _, g in limit_rows)
    res.data["cold"] = {
        "method": method,
        "sync_seconds": round(synced, 1),
        "cached_gb_before_drop": before,
        "cached_gb_after_drop": after,
        "disk": disk,
    }
    res.data["limits"]["disk"] = disk
    res.save()
    dev = "cuda" if cuda else None
    table = bl.Table(
        "gpu_cold",
        "From disk, the page cache dropped before each sample: ratio to the disk's best reader",
        ["reader", "threads", "GB/s", "tokens/s", "ratio to disk", "first batch (s)"],
    )
    rows: list[dict[str, Any]] = []
    for what, n, gbps in limit_rows:
        table.add(what + " (limit)", n, gbps, "", gbps / disk, "")
        rows.append({"reader": what, "limit": True, "threads": n, "gbps": gbps})
    where = ", device-side shuffle" if cuda else ", host gather"
    loaders_rows: dict[str, tuple[ss.Shards, dict[str, Any]]] = {
        f"ShuffledLoader, float16, every layer{where}": (caches[F16], {"mix_layers": True}),
        f"ShuffledLoader, float16, layer {LAYER}{where}": (caches[F16], {"layers": LAYER}),
        f"ShuffledLoader, float8_e4m3, every layer{where}": (caches[F8], {"mix_layers": True}),
        f"ShuffledLoader, float8_e4m3, layer {LAYER}{where}": (caches[F8], {"layers": LAYER}),
    }
    for name, (shards, kwargs) in loaders_rows.items():
        drop(every, drop_all)
        s = loader_sample(shuffled(shards, device=dev, **kwargs), seconds, False, cuda, epochs=1)
        table.add(name, threads, s["gbps"], s["vectors_per_s"], s["gbps"] / disk, s["first_batch_s"])
        rows.append({"reader": name, "limit": False, "threads": threads, **s})
    table.note(
        f"Page cache dropped by {method}; before the first drop the page cache held {before:.1f} GB, after it "
        f"{after:.1f} GB. Each row about {seconds:g} s from its first batch (limits sized to take as long), one "
        "sample. GB/s counts stored bytes (a float8 cache's scales too): a float8 row at the disk's rate "
        "delivers about twice float16's tokens/s. Target: >= 0.9 of the disk's best reader."
    )
    res.table("cold", table, rows)


def part_threads(res: Results, caches: dict[str, ss.Shards], cuda: bool, seconds: float) -> None:
    shards = caches[F16]
    warm(shards)
    limits = res.data["limits"]
    table = bl.Table(
        "gpu_loader_threads",
        f"ShuffledLoader host gather by threads, layer {LAYER}, page-cached, pin_memory: ratio to the pread limit",
        ["gather threads", "GB/s", "ratio to pread limit", "CPU cores busy"],
    )
    rows = []
    for g in thread_counts(min(usable_cores(), 16)):
        s = loader_sample(shuffled(shards, layers=LAYER, gather_threads=g, pin_memory=True), seconds, True, cuda)
        table.add(g, s["gbps"], ratio(s["gbps"], limits.get("pread")), s["cores_busy"])
        rows.append({"gather_threads": g, **s})
    table.note(f"{seconds:g} s per row, one sample; read_threads at its default. Target: no fall from 4 to 16.")
    res.table("threads", table, rows)


# --------------------------------------------------------------------------------------
# docs/bench/gpu.md


def render(data: dict[str, Any]) -> str:
    """docs/bench/gpu.md from a results file: the machine, the tables, what limits each row,
    what would close each gap (every sentence computed from the file's own figures)."""
    m, tables, limits = data.get("machine", {}), data.get("tables", {}), data.get("limits", {})
    out = ["# GPU node benchmark", ""]
    out += [
        f"`make bench-gpu` (`scripts/bench_gpu.py`), run {data.get('started', '?')} "
        + (
            "by `scripts/gpu_session.sh`, which also ran the tests that need a GPU (below). "
            if "cuda_tests" in data.get("parts", {})
            else "as `" + data.get("command", "scripts/bench_gpu.py") + "`. "
        )
        + "Every ratio is to a limit of the same node measured in the same run. This page is written by "
        "`scripts/bench_gpu.py --render` from that run's results file; edit the script, not the page.",
        "",
        "## The machine",
        "",
    ]
    out += _machine_lines(m, data)
    missing = [p for p in PARTS if p not in data.get("parts", {}) or data["parts"][p]["status"] != "ok"]
    if missing:
        out += ["", "Parts that did not finish: " + "; ".join(_part_status(data, p) for p in missing) + "."]
    tests = {k: v for k, v in data.get("parts", {}).items() if k in TEST_RUNS}
    if tests:
        out += ["", "## The tests on this GPU", ""]
        out += [f"- {TEST_RUNS[k]}: {v['status']}" for k, v in tests.items()]
    out += ["", "## The tables", ""]
    for t in tables.values():
        out += [f"### {t['title']}", "", *_md_table(t["columns"], t["rows"]), ""]
        out += [*t["notes"], ""] if t["notes"] else []
    out += ["## What limits each row", ""]
    out += _limits_section(tables, limits, data)
    out += ["", "## Targets, and what would close each gap", ""]
    out += _targets_section(tables, limits, data)
    return "\n".join(out).rstrip() + "\n"


def _part_status(data: dict[str, Any], part: str) -> str:
    got = data.get("parts", {}).get(part)
    if got is None:
        return f"`{part}` (not run)"
    return f"`{part}` ({got['status']})"


def _machine_lines(m: dict[str, Any], data: dict[str, Any]) -> list[str]:
    lines = [
        f"- CPU: {m.get('summary', '?')}; {m.get('usable_cores', '?')} usable cores; kernel {m.get('kernel', '?')}"
    ]
    if m.get("gpu"):
        lines.append(
            f"- GPU: {m['gpu']}, {m.get('gpu_memory_gib', '?')} GiB, {m.get('gpu_sms', '?')} SMs; driver "
            f"{m.get('driver', '?')}, CUDA runtime {m.get('cuda_runtime', '?')}; PCIe {m.get('pcie', '?')}"
        )
    elif "cuda" in m:
        lines.append("- GPU: none (CUDA not available): host parts only, device modes on the CPU")
    lines.append(
        f"- torch {m.get('torch', '?')}; numba {m.get('numba', 'absent')} (float8 kernels in use: "
        f"{m.get('float8_kernels', '?')})"
    )
    lines.append(f"- Benchmark files on {m.get('filesystem', '?')}, readahead {m.get('readahead_kb', '?')} KiB")
    for dtype, c in data.get("caches", {}).items():
        lines.append(
            f"- {dtype} cache: {c['examples']:,} examples x 2 layers x 197 tokens x 768, {c['nbytes'] / 1e9:.2f} GB "
            f"in {c['shards']} shards, written by {c['writers']} processes in {c['write_seconds']} s"
        )
    cold = data.get("cold", {})
    if cold:
        lines.append(
            f"- Cold samples: {cold['method']}; page cache {cold['cached_gb_before_drop']:.1f} GB before the "
            f"first drop, {cold['cached_gb_after_drop']:.1f} GB after it"
        )
    return lines


def _md_table(columns: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


#: The stack sampler's stages (`STAGES`), in words.
PLACES = {
    "read": "reading (pread)",
    "upload wait": "waiting for an upload before refilling a staging slot",
    "index": "computing window indexes",
    "upload": "queueing uploads",
    "gather": "gathering rows",
    "batch": "issuing batches",
    "batch [wait]": "waiting for a window or a batch",
    "idle [wait]": "idle",
    "loop": "the benchmark's loop (moving batches to the GPU, synchronising)",
}


def _words(place: str) -> str:
    return PLACES.get(place, f"`{place}`")


def _profile_text(profile: dict[str, list[list[Any]]]) -> str:
    parts = []
    names = {"main": "training loop", "read": "read threads", "gather": "gather threads"}
    for role in ("main", "read", "gather"):
        top = profile.get(role)
        if top:
            parts.append(f"{names[role]}: " + ", ".join(f"{_words(p)} {s:.0%}" for p, s in top[:3]))
    return "; ".join(parts)


def _share(profile: dict[str, list[list[Any]]], role: str, *keys: str) -> float:
    return float(sum(s for p, s in profile.get(role, []) if any(p.startswith(k) for k in keys)))


def _bottleneck(row: dict[str, Any], limits: dict[str, float]) -> str:
    """A sentence saying what limits a loader row, from its figures and its threads' profile."""
    prof = row.get("profile", {})
    reading = _share(prof, "read", "read")
    upload_wait = _share(prof, "read", "upload wait")
    idle_read = _share(prof, "read", "idle")
    main_wait = _share(prof, "main", "batch [wait]")
    main_busy = _share(prof, "main", "batch") - main_wait
    main_loop = _share(prof, "main", "loop") - _share(prof, "main", "loop [wait]")
    gather = _share(prof, "gather", "gather")
    indexing = _share(prof, "read", "index")
    if upload_wait >= 0.3:
        return (
            f"the read threads spend {upload_wait:.0%} of their time waiting for uploads: the host-to-device "
            "copies (or the slots they free) set the pace"
        )
    if indexing >= 0.3:
        return (
            f"the read threads spend {indexing:.0%} of their time computing window indexes (numpy, on the host): "
            "each window waits for its index"
        )
    if reading >= 0.5:
        return f"the read threads are reading {reading:.0%} of the time: reading (pread) sets the pace"
    if main_loop >= 0.5:
        return (
            f"the loop's own work, copying each batch to the GPU, takes {main_loop:.0%} of its thread: that copy "
            "sets the pace"
        )
    if main_busy >= 0.6 and idle_read >= 0.3:
        return (
            f"the training loop's thread is busy {main_busy:.0%} of the time and the read threads idle "
            f"{idle_read:.0%}: the per-batch work on the loop's thread sets the pace"
        )
    if gather >= 0.5:
        return f"the gather threads are gathering {gather:.0%} of the time: the host gather (CPU) sets the pace"
    if main_wait >= 0.5 and idle_read >= 0.3:
        return (
            f"the loop waits for windows {main_wait:.0%} of the time while the read threads idle {idle_read:.0%}: "
            "too few windows in flight (two slots) for the read threads to stay busy"
        )
    return "no single stage dominates the sampled stacks"


def _limits_section(tables: dict[str, Any], limits: dict[str, float], data: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    pread, h2d, ru = limits.get("pread"), limits.get("h2d"), limits.get("read_upload")
    if "limits" in tables:
        text = (
            f"- **The node.** Parallel pread into pinned memory peaks at {pread:.1f} GB/s"
            if pread
            else "- **The node.**"
        )
        if h2d:
            text += f"; one pinned host-to-device copy stream moves {h2d:.1f} GB/s"
            if limits.get("h2d_pageable"):
                text += f" ({limits['h2d_pageable']:.1f} from pageable memory)"
        if ru:
            text += f"; reading and uploading together reach {ru:.1f} GB/s, " + (
                "the upload being the narrower of the two."
                if h2d and h2d < (pread or 0)
                else "so reads and uploads overlap."
                if pread and ru >= 0.9 * min(pread, h2d or pread)
                else "less than either alone: reads and uploads contend (memory bandwidth, or the copy engine)."
            )
        lines.append(text if text.endswith(".") else text + ".")
    for key, label in (("modes", "Loader modes"), ("float8", "float8"), ("cold", "Cold"), ("threads", "Threads")):
        t = tables.get(key)
        if t is None:
            continue
        lines.append(f"- **{label}.**")
        for row in t["data"]:
            if row.get("limit") or "profile" not in row:
                continue
            name = row.get("mode") or row.get("reader") or f"gather threads {row.get('gather_threads')}"
            if key == "float8":
                name = f"{name}, {row['cache']}"
            restart = (
                f" A new epoch's first batch came {row['restart_s']:.2f} s after the last one's end (the first "
                "window read and, on the device, uploaded before anything else); left out of the rate."
                if row.get("epoch_restarts")
                else ""
            )
            lines.append(
                f"  - {name}: {row['gbps']:.2f} GB/s, {row['cores_busy']:.1f} cores busy; "
                f"{_bottleneck(row, limits)} ({_profile_text(row['profile'])}).{restart}"
            )
    sae = tables.get("sae")
    if sae is not None:
        lines.append("- **SAE step.**")
        lines += _sae_lines(sae, tables)
    return lines


def _sae_lines(sae: dict[str, Any], tables: dict[str, Any]) -> list[str]:
    alone = _loader_alone(tables)
    lines = []
    for row in sae["data"]:
        if row["data"] == "already on the device":
            lines.append(f"  - on the device: {row['tokens_per_s']:,.0f} tokens/s, the GPU's own rate for this step.")
            continue
        need = row["loader_gbps_needed"]
        have = alone.get(row["data"])
        text = f"  - {row['data']}: {row['ratio']:.3f} of on-device, the loader delivering {need:.2f} GB/s"
        if row["ratio"] >= TARGETS["sae"]:
            text += ": the loader keeps up with the step"
        elif have is not None:
            text += f"; alone, page-cached, it delivers {have:.2f} GB/s"
            text += (
                ": it has room, so the gap is interference (its threads' CPU and GIL time, its uploads and "
                "gathers on the GPU) rather than its rate"
                if have >= 1.2 * need
                else ": the loader itself is the limit"
            )
        lines.append(text + ".")
    return lines


def _loader_alone(tables: dict[str, Any]) -> dict[str, float]:
    """The page-cached rate of the loader that feeds each SAE row, from the modes and float8 tables."""
    out = {}
    for row in tables.get("modes", {}).get("data", []):
        if row["mode"].startswith("device-side shuffle") and "every layer" not in row["mode"]:
            out["float16, device-side shuffle"] = row["gbps"]
        if row["mode"] == "host gather, pin_memory":
            out["float16, host gather, pin_memory"] = row["gbps"]
    for row in tables.get("float8", {}).get("data", []):
        if row["cache"] == F8 and row["mode"].startswith("device-side shuffle"):
            out["float8_e4m3, device-side shuffle"] = row["gbps"]
    return out


def _targets_section(tables: dict[str, Any], limits: dict[str, float], data: dict[str, Any]) -> list[str]:
    rows: list[list[str]] = []
    advice: list[str] = []
    pread = limits.get("pread")
    for row in tables.get("modes", {}).get("data", []):
        if row["kind"] == "device" and pread:
            r = row["gbps"] / pread
            rows.append([f"page-cached, {row['mode']}", ">= 0.8 of pread", f"{r:.2f}", "yes" if r >= 0.8 else "no"])
            if r < TARGETS["page_cached"]:
                advice.append(f"- {row['mode']} ({r:.2f} of the pread limit): {_advice(row, limits)}")
    for row in tables.get("cold", {}).get("data", []):
        if not row.get("limit"):
            r = row["gbps"] / data.get("cold", {}).get("disk", float("nan"))
            rows.append([f"cold, {row['reader']}", ">= 0.9 of the disk", f"{r:.2f}", "yes" if r >= 0.9 else "no"])
            if r < TARGETS["cold"]:
                advice.append(f"- cold, {row['reader']} ({r:.2f} of the disk): {_advice(row, limits)}")
    for row in tables.get("sae", {}).get("data", []):
        if row["data"] != "already on the device":
            r = row["ratio"]
            rows.append([f"SAE step, {row['data']}", ">= 0.98 of on-device", f"{r:.3f}", "yes" if r >= 0.98 else "no"])
            if r < TARGETS["sae"]:
                have = _loader_alone(tables).get(row["data"])
                advice.append(
                    f"- SAE step fed by {row['data']} ({r:.3f}): "
                    + (
                        "the loader alone is too slow for this step: close its own gap first (above)."
                        if have is not None and have < 1.2 * row["loader_gbps_needed"]
                        else "the loader has the rate but slows the step: keep its Python off the loop's thread "
                        "(fewer, larger calls per batch), give its read threads fewer cores than the node has, and "
                        "check the uploads do not share a copy engine with the step's own traffic."
                    )
                )
    f8 = tables.get("float8", {}).get("data", [])
    for mode in dict.fromkeys(r["mode"] for r in f8):
        by = {r["cache"]: r for r in f8 if r["mode"] == mode}
        if F16 in by and F8 in by:
            r = by[F8]["vectors_per_s"] / by[F16]["vectors_per_s"]
            rows.append(
                [f"float8 / float16 tokens/s, {mode}", "> 1 (half the bytes)", f"{r:.2f}", "yes" if r > 1 else "no"]
            )
            if r <= 1:
                advice.append(f"- float8, {mode} ({r:.2f} x float16): {_advice(by[F8], limits)}")
    if not rows:
        return ["No target could be judged: the parts that measure them did not finish."]
    out = _md_table(["target", "wanted", "measured", "met"], rows)
    out += ["", *(advice or ["Every target measured here is met."])]
    return out


def _advice(row: dict[str, Any], limits: dict[str, float]) -> str:
    """What would close a loader row's gap, by what limits it (`_bottleneck`)."""
    why = _bottleneck(row, limits)
    if "waiting for uploads" in why:
        return (
            why + "; more bytes per copy (larger blocks), or uploads from more than one stream so that both "
            "copy engines work, would raise it up to the read + upload limit."
        )
    if "reading (pread)" in why:
        return (
            why + "; the reads are already the work: bigger requests (block_bytes) or more read threads, up "
            "to the pread limit's best thread count, would close the rest."
        )
    if "per-batch work" in why:
        return (
            why + "; fewer Python calls per batch on that thread (larger batches per call, the index of "
            "several batches prepared at once) would close it."
        )
    if "too few windows" in why:
        return (
            why + "; a third slot (reading the window after next while one uploads and one is gathered) "
            "would keep them busy."
        )
    if "copying each batch" in why:
        return why + "; pin_memory=True (asynchronous copies) or the device-side shuffle would take it off the loop."
    if "window indexes" in why:
        return (
            why + "; computing the index of the window after next earlier, or its permutation on the device, "
            "would take it off the path."
        )
    if "host gather" in why:
        return why + "; only the device-side shuffle takes that work off the CPU."
    return why + "; a profile of this row (ncu and a longer stack sample) is the next step."


# --------------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> None:
    results = Path(args.results) if args.results else bl.results_dir() / "gpu_results.json"
    res = Results(results)
    parts = [p for p in PARTS if p in args.parts.split(",")] if args.parts else list(PARTS)
    unknown = set(args.parts.split(",")) - set(PARTS) if args.parts else set()
    if unknown:
        raise SystemExit(f"--parts: unknown {sorted(unknown)}; expected some of {', '.join(PARTS)}")
    gb = args.gb if args.gb is not None else (0.4 if args.quick else 8.0)
    seconds = args.seconds if args.seconds is not None else (1.0 if args.quick else 3.0)
    res.data["machine"].update(machine_info(None))
    res.data.setdefault("command", " ".join(["scripts/bench_gpu.py", *sys.argv[1:]]))
    print(f"Machine: {bl.machine()}\n", flush=True)
    caches: dict[str, ss.Shards] = {}
    try:
        for part in parts:
            t = time.perf_counter()
            if part == "build" or not caches:
                caches = open_caches(res, gb)
            if part == "build":
                res.part("build", "ok", time.perf_counter() - t)
                continue
            import torch

            cuda = torch.cuda.is_available()
            if "torch" not in res.data["machine"]:
                res.data["machine"].update(machine_info(cuda))
                print(
                    f"GPU: {torch.cuda.get_device_name()}\n"
                    if cuda
                    else "No CUDA GPU: host parts only (device modes on the CPU, the SAE step small on the CPU).\n",
                    flush=True,
                )
            if part == "limits":
                part_limits(res, caches, cuda, args.quick)
            elif part == "modes":
                part_modes(res, caches, cuda, seconds)
            elif part == "float8":
                part_float8(res, caches, cuda, seconds)
            elif part == "sae":
                part_sae(res, caches, cuda, seconds)
            elif part == "cold":
                part_cold(res, caches, cuda, seconds, args.drop_all)
            elif part == "threads":
                part_threads(res, caches, cuda, seconds / 2)
            res.part(part, "ok", round(time.perf_counter() - t, 1))
    finally:
        for shards in caches.values():
            shards.close()
        if not args.keep:
            shutil.rmtree(bl.bench_dir() / "gpu", ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 0.4 GB cache and 1 s samples")
    parser.add_argument("--gb", type=float, default=None, help="float16 cache size in GB (default 8; keep it in RAM)")
    parser.add_argument("--seconds", type=float, default=None, help="seconds per loader sample (default 3)")
    parser.add_argument("--parts", default=None, help=f"comma-separated, of: {', '.join(PARTS)} (default: all)")
    parser.add_argument("--keep", action="store_true", help="keep the caches for a later run (or part)")
    parser.add_argument("--results", default=None, help="results JSON (default results/gpu_results.json)")
    parser.add_argument(
        "--drop-all",
        action="store_true",
        help="cold samples also empty the whole page cache (/proc/sys/vm/drop_caches; root)",
    )
    parser.add_argument("--render", metavar="RESULTS", help="print docs/bench/gpu.md made from a results JSON")
    parser.add_argument(
        "--mark",
        nargs=2,
        metavar=("PART", "STATUS"),
        help="record in --results that PART ended with STATUS (gpu_session.sh, for a stopped part)",
    )
    args = parser.parse_args()
    if args.render:
        sys.stdout.write(render(json.loads(Path(args.render).read_text())))
    elif args.mark:
        Results(Path(args.results) if args.results else bl.results_dir() / "gpu_results.json").part(*args.mark)
    else:
        main(args)
