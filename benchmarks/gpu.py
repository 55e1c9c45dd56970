"""GPU-node benchmark: the loaders beside the node's own limits, measured in one run.

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
* ``sae``: a top-k SAE step (`saev_shards.demo.sae`) on data already on the GPU against the same
  step fed by the loader. Target: >= 0.98.
* ``cold``: the page cache dropped before each sample: the loader against sequential and
  parallel O_DIRECT reads and parallel buffered reads of the same files. Target: >= 0.9 of
  the disk.
* ``threads``: the host gather by gather threads.

Every loader sample also records where the loader's threads and the training loop spend
their time (their Python stacks sampled every 5 ms): docs/bench/gpu.md says from it what
limits each row.

Every table lands in the results file (``--results``, default results/gpu_results.json) the
moment it is done, so a part stopped at its time limit (benchmarks/gpu_session.sh gives each
one) loses only itself. ``--render FILE`` prints docs/bench/gpu.md made from such a file
(`gpu_results.py`): the machine, the tables, what limits each row, what would close each
gap. Without CUDA the host parts run, the device modes run on the CPU (``device="cpu"``:
their host side only) and the SAE step runs small on the CPU; the tables say so.

    .venv/bin/python benchmarks/gpu.py [--quick] [--gb N] [--seconds S] [--parts a,b] [--keep]
    .venv/bin/python benchmarks/gpu.py --render results/gpu_results.json > docs/bench/gpu.md
"""

from __future__ import annotations

import argparse
import contextlib
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
from benchmarks import benchlib as bl
from benchmarks import tables
from benchmarks.core import D_MODEL, LAYERS, PATCHES
from benchmarks.gpu_results import F8, F16, PARTS, Results, render
from saev_shards.codecs import float8
from saev_shards.loaders.token_loader import default_read_threads, usable_cores

# torch (and with it saev_shards.loaders) is imported inside the parts that use it: the
# build part forks its writers from a process that never imported it.

BATCH = 4096
BLOCK = 4 << 20
LAYER = 11
#: Shards per cache: one writer process each, up to the cores.
SHARDS = 16


def thread_counts(limit: int) -> list[int]:
    """1, 2, 4, ... up to ``limit`` (and ``limit`` itself)."""
    counts = [1]
    while counts[-1] * 2 <= limit:
        counts.append(counts[-1] * 2)
    if counts[-1] != limit:
        counts.append(limit)
    return counts


# --------------------------------------------------------------------------------------
# the machine


def machine_info(cuda: bool | None) -> dict[str, Any]:
    """The node, its disk, and (``cuda`` not None) torch and the GPU."""
    info: dict[str, Any] = {"summary": tables.machine(), "usable_cores": usable_cores(), "kernel": platform.release()}
    with contextlib.suppress(ImportError):
        import numba

        info["numba"] = numba.__version__
    info["float8_kernels"] = float8.kernels_in_use()
    work = tables.bench_dir()
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
    root = tables.bench_dir() / "gpu"
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
            if fallback is None and ("saev_shards" in path or path == __file__):
                fallback = "loop" if path == __file__ else name  # this script's frames: the benchmark's loop
            f = f.f_back
        if fallback is not None:
            return fallback + suffix
        return "idle [wait]" if waiting else f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_name}"

    def profile(self, top: int = 4) -> dict[str, list[tuple[str, float]]]:
        out = {}
        for role, counts in self.counts.items():
            total = sum(counts.values())
            out[role] = [(place, round(n / total, 3)) for place, n in counts.most_common(top)]
        return out


# --------------------------------------------------------------------------------------
# the node's limits


def part_limits(res: Results, caches: dict[str, ss.Shards], cuda: bool, quick: bool) -> None:
    shards = caches[F16]
    warm(shards)
    cores = usable_cores()
    total = (512 if quick else 4096) << 20
    files = shard_files(shards)
    md = shards.metadata
    slice_bytes = md.tokens_per_ex * md.d_model * md.itemsize
    table = tables.Table(
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
        add("memcpy", "memcpy, 256 MiB buffers per thread", threads, bl.memcpy_threads_gbps(threads))
    where = "pinned" if cuda else "pageable"
    for threads in thread_counts(min(2 * cores, 32)):
        add(
            "pread",
            f"pread of random 4 MiB blocks into {where} memory",
            threads,
            bl.pread_threads_gbps(files, threads, total, cuda),
        )
    for threads in sorted({4, default_read_threads(device_side=True), min(2 * cores, 32)}):
        add(
            "pread_slices",
            f"pread of random layer slices ({slice_bytes:,} B) into {where} memory",
            threads,
            bl.pread_threads_gbps(files, threads, total // 2, cuda, block=slice_bytes),
        )
    if cuda:
        add("h2d", "host-to-device copy, pinned, 512 MiB", 1, bl.copy_gbps("h2d"))
        add("h2d_pageable", "host-to-device copy, pageable, 512 MiB", 1, bl.copy_gbps("h2d_pageable"))
        add("d2h", "device-to-host copy, pinned, 512 MiB", 1, bl.copy_gbps("d2h"))
        add("d2d", "device-to-device copy (bytes read + written)", 1, bl.copy_gbps("d2d"))
        for threads in sorted({4, default_read_threads(device_side=True)}):
            add(
                "read_upload",
                "pread of random 4 MiB blocks into pinned memory + upload, one stream per thread",
                threads,
                bl.read_upload_gbps(files, threads, total, BLOCK),
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
    table = tables.Table(
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
    table = tables.Table(
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

    from saev_shards.demo.sae import TopKSAE

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
    table = tables.Table(
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
    probe = bl.odirect_files_gbps(paths, probe_bytes)
    budget = int(min(total, max(probe_bytes, probe * 1e9 * seconds)))
    out = [("sequential O_DIRECT reads, 8 MiB requests", 1, bl.odirect_files_gbps(paths, budget))]
    drop(paths, drop_all)
    block = min(BLOCK, max(os.stat(p).st_size for p in paths) // bl.ALIGN * bl.ALIGN)  # small caches' shards
    gbps, _ = bl.odirect_random_read_files(paths, block, max(threads, budget // block), threads)
    out.append((f"random O_DIRECT reads, {block >> 10:,} KiB requests", threads, gbps))
    drop(paths, drop_all)
    out.append(("buffered 4 MiB preads in file order", threads, bl.buffered_read_gbps(paths, threads, limit=budget)))
    return out, method


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
    table = tables.Table(
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
    table = tables.Table(
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


def main(args: argparse.Namespace) -> None:
    results = Path(args.results) if args.results else tables.results_dir() / "gpu_results.json"
    res = Results(results)
    parts = [p for p in PARTS if p in args.parts.split(",")] if args.parts else list(PARTS)
    unknown = set(args.parts.split(",")) - set(PARTS) if args.parts else set()
    if unknown:
        raise SystemExit(f"--parts: unknown {sorted(unknown)}; expected some of {', '.join(PARTS)}")
    gb = args.gb if args.gb is not None else (0.4 if args.quick else 8.0)
    seconds = args.seconds if args.seconds is not None else (1.0 if args.quick else 3.0)
    res.data["machine"].update(machine_info(None))
    res.data.setdefault("command", " ".join(["benchmarks/gpu.py", *sys.argv[1:]]))
    print(f"Machine: {tables.machine()}\n", flush=True)
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
            shutil.rmtree(tables.bench_dir() / "gpu", ignore_errors=True)


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
        Results(Path(args.results) if args.results else tables.results_dir() / "gpu_results.json").part(*args.mark)
    else:
        main(args)
