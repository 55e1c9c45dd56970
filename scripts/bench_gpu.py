"""GPU-node benchmark (issue 15): the loaders beside the node's own limits, all measured in one run.

Tables, each figure a ratio to a limit measured in the same run:

1. the node: memcpy and pread of random 4 MiB blocks of the cache's shards into (pinned)
   memory, by threads; host-to-device copies, pinned and pageable; sequential disk reads;
2. the loader by threads (host gather), against parallel pread into pinned memory;
3. the loader by mode: host, host pinned, device-side shuffle, stacked layers;
4. a top-k SAE step (saev_shards.sae) on data already on the device against the same step
   fed by the loader (host pinned, device-side);
5. cold: the page cache dropped, against sequential O_DIRECT reads of the same files.

Without CUDA it says so and runs the host parts (the device mode then runs on the CPU,
which measures its host side only; the SAE step runs on the CPU).

    .venv/bin/python scripts/bench_gpu.py [--quick] [--keep] [--gb N]
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import saev_shards as ss
from saev_shards import loaders
from saev_shards.loaders.token_loader import usable_cores
from scripts import benchlib as bl
from scripts.bench_core import make_metadata
from scripts.bench_loaders import build_cache, odirect_files_gbps

BATCH = 4096
BLOCK = 4 << 20


def thread_counts(limit: int) -> list[int]:
    """1, 2, 4, ... up to ``limit`` (and ``limit`` itself)."""
    counts = [1]
    while counts[-1] * 2 <= limit:
        counts.append(counts[-1] * 2)
    if counts[-1] != limit:
        counts.append(limit)
    return counts


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

    tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    return tensor.numpy()


def pread_threads_gbps(shards: ss.Shards, threads: int, total: int, pinned: bool) -> float:
    """Random ``BLOCK`` preads of the shard files (page-cached) into one (pinned) buffer per thread."""
    paths = [shards.shard_path(k) for k in range(shards.n_shards)]
    sizes = [os.stat(p).st_size for p in paths]
    rng = np.random.default_rng(0)
    n = max(threads, total // BLOCK)
    picks = rng.integers(0, len(paths), n)
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    jobs = [(fds[k], int(rng.integers(0, max(1, sizes[k] - BLOCK)))) for k in picks.tolist()]
    buffers = [host_buffer(BLOCK, pinned) for _ in range(threads)]

    def work(i: int) -> None:
        view = buffers[i].data
        for fd, off in jobs[i::threads]:
            os.preadv(fd, [view], off)

    try:
        pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        start = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        return n * BLOCK / (time.perf_counter() - start) / 1e9
    finally:
        for fd in fds:
            os.close(fd)


def h2d_gbps(pinned: bool, nbytes: int = 256 << 20) -> float:
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=pinned)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        dev.copy_(host, non_blocking=pinned)
    torch.cuda.synchronize()
    return 5 * nbytes / (time.perf_counter() - start) / 1e9


def bench_limits(shards: ss.Shards, cuda: bool, quick: bool) -> dict[str, float]:
    """Table 1; returns the limits the other tables compare with."""
    bl.warm_cache(shards.path)
    cores = usable_cores()
    total = (256 if quick else 2048) << 20
    table = bl.Table(
        "gpu_limits", f"The node's limits ({cores} usable cores, CUDA: {cuda})", ["what", "threads", "GB/s"]
    )
    limits: dict[str, float] = {}
    for threads in thread_counts(min(cores, 16)):
        table.add("memcpy, 256 MiB buffers", threads, memcpy_threads_gbps(threads))
    for threads in thread_counts(min(2 * cores, 16)):
        gbps = pread_threads_gbps(shards, threads, total, pinned=cuda)
        limits["pread"] = max(limits.get("pread", 0.0), gbps)
        what = "pread of random 4 MiB blocks (page-cached) into " + ("pinned" if cuda else "pageable") + " memory"
        table.add(what, threads, gbps)
    if cuda:
        limits["h2d_pinned"] = h2d_gbps(True)
        table.add("host-to-device copy, pinned", "", limits["h2d_pinned"])
        table.add("host-to-device copy, pageable", "", h2d_gbps(False))
    bl.drop_cache(shards.path)
    limits["disk"] = odirect_files_gbps(shards, limit=min(shards.metadata.nbytes, 2 << 30))
    table.add("sequential O_DIRECT read of the shard files (disk)", 1, limits["disk"])
    table.note("Each figure from this run. The pread limit used below is the best over thread counts.")
    table.emit()
    return limits


# --------------------------------------------------------------------------------------
# the loader


def loader_rate(make: Callable[[], Any], max_batches: int, to_device: bool) -> tuple[float, float]:
    """``(GB/s of stored bytes, seconds to the first batch)`` over up to ``max_batches`` batches."""
    loader = make()
    itemsize = loader.shards.metadata.itemsize
    start = time.perf_counter()
    it = iter(loader)
    first = next(it)
    if to_device:
        first.acts.to("cuda", non_blocking=True)
    t = time.perf_counter()
    nbytes = 0
    for i, batch in enumerate(it):
        if to_device and batch.acts.device.type != "cuda":
            batch.acts.to("cuda", non_blocking=True)
        nbytes += batch.acts.numel() * itemsize
        if i + 1 >= max_batches:
            break
    if to_device:
        import torch

        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    del it, first
    loader.close()
    return nbytes / max(dt, 1e-9) / 1e9, t - start


def bench_threads(shards: ss.Shards, limits: dict[str, float], cuda: bool, quick: bool) -> None:
    cores = usable_cores()
    buffer = (128 if quick else 1024) << 20
    batches = 200 if quick else 2000
    table = bl.Table(
        "gpu_loader_threads",
        "ShuffledLoader by threads, layer 11, page-cached: ratio to parallel pread into pinned memory",
        ["gather threads", "read threads", "GB/s", "ratio to pread limit"],
    )
    table.add("pread limit", "", limits["pread"], 1.0)
    for g in thread_counts(min(2 * cores, 64)):
        for r in sorted({4, loaders.default_read_threads()}):
            options: dict[str, Any] = dict(gather_threads=g, read_threads=r, pin_memory=cuda)
            gbps, _ = loader_rate(
                functools.partial(loaders.ShuffledLoader, shards, BATCH, layers=11, buffer_bytes=buffer, **options),
                batches,
                False,
            )
            table.add(g, r, gbps, gbps / limits["pread"])
    table.note(
        f"{batches} batches of {BATCH} per sample, {buffer >> 20} MiB windows. Defaults here: gather_threads="
        f"{loaders.default_gather_threads()}, read_threads={loaders.default_read_threads()} "
        f"(device mode {loaders.default_read_threads(True)}). Target: no fall from 4 to 16 threads."
    )
    table.emit()


def bench_modes(shards: ss.Shards, limits: dict[str, float], cuda: bool, quick: bool) -> None:
    buffer = (128 if quick else 1024) << 20
    batches = 200 if quick else 2000
    device = "cuda" if cuda else "cpu"
    modes: dict[str, tuple[Callable[[], Any], bool]] = {
        "host gather": (lambda: loaders.ShuffledLoader(shards, BATCH, layers=11, buffer_bytes=buffer), cuda),
        "host gather, pin_memory": (
            lambda: loaders.ShuffledLoader(shards, BATCH, layers=11, buffer_bytes=buffer, pin_memory=True),
            cuda,
        ),
        f"device-side shuffle ({device})": (
            lambda: loaders.ShuffledLoader(shards, BATCH, layers=11, buffer_bytes=buffer, device=device),
            False,
        ),
        "stacked layers (B, 2, D), host": (
            lambda: loaders.ShuffledLoader(shards, BATCH, buffer_bytes=buffer, stack_layers=True, pin_memory=True),
            cuda,
        ),
        f"stacked layers (B, 2, D), device ({device})": (
            lambda: loaders.ShuffledLoader(shards, BATCH, buffer_bytes=buffer, stack_layers=True, device=device),
            False,
        ),
    }
    table = bl.Table(
        "gpu_loader_modes",
        "ShuffledLoader by mode, page-cached, batches delivered "
        + ("on the GPU" if cuda else "on the host (no CUDA)")
        + ": ratio to parallel pread",
        ["mode", "GB/s", "ratio to pread limit", "first batch (s)"],
    )
    table.add("pread limit", limits["pread"], 1.0, "")
    for name, (make, move) in modes.items():
        gbps, startup = loader_rate(make, batches, move)
        table.add(name, gbps, gbps / limits["pread"], startup)
    table.note(
        "Host modes include the batch's copy to the GPU (non_blocking) when CUDA is present. "
        "Target for the device-side shuffle: >= 0.8 of the pread limit."
    )
    table.emit()


def bench_sae(shards: ss.Shards, cuda: bool, quick: bool) -> None:
    import torch

    from saev_shards.sae import TopKSAE

    device = torch.device("cuda" if cuda else "cpu")
    d = shards.metadata.d_model
    n_latents = 16_384 if cuda else 2_048
    steps = 30 if quick else 300
    sae = TopKSAE(d, n_latents, k=32).to(device)
    opt = torch.optim.Adam(sae.parameters(), lr=1e-4)
    dtype = torch.bfloat16 if cuda else torch.float32

    def step(x: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=cuda):
            x_hat, _ = sae(x.float())
            loss = ((x_hat.float() - x.float()) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    resident = torch.randn(steps, BATCH, d, device=device).to(torch.float16)
    step(resident[0])
    sync()
    t = time.perf_counter()
    for i in range(steps):
        step(resident[i])
    sync()
    on_device = steps * BATCH / (time.perf_counter() - t)
    table = bl.Table(
        "gpu_sae_step",
        f"Top-k SAE {d} -> {n_latents:,}, k=32, Adam, on {device.type}: loader-fed against data already there",
        ["data", "tokens/s", "ratio to on-device"],
    )
    table.add("already on the device", on_device, 1.0)
    buffer = (128 if quick else 1024) << 20
    feeds: dict[str, Callable[[], Any]] = {
        "ShuffledLoader, host gather, pin_memory": lambda: loaders.ShuffledLoader(
            shards, BATCH, layers=11, buffer_bytes=buffer, pin_memory=True
        ),
        "ShuffledLoader, host gather": lambda: loaders.ShuffledLoader(shards, BATCH, layers=11, buffer_bytes=buffer),
    }
    if cuda:
        feeds["ShuffledLoader, device-side shuffle"] = lambda: loaders.ShuffledLoader(
            shards, BATCH, layers=11, buffer_bytes=buffer, device="cuda"
        )
    for name, make in feeds.items():
        loader = make()
        it = iter(loader)
        step(next(it).acts.to(device, non_blocking=True))
        sync()
        t = time.perf_counter()
        done = 0
        for batch in it:
            step(batch.acts.to(device, non_blocking=True))
            done += 1
            if done >= steps:
                break
        sync()
        rate = done * BATCH / (time.perf_counter() - t)
        del it
        loader.close()
        table.add(name, rate, rate / on_device)
    table.note(f"{steps} steps of {BATCH} tokens (layer 11, float16 in the cache). Target: >= 0.98 of on-device.")
    table.emit()


def bench_cold(shards: ss.Shards, limits: dict[str, float], cuda: bool, quick: bool) -> None:
    buffer = (128 if quick else 1024) << 20
    table = bl.Table(
        "gpu_cold",
        "From disk (page cache dropped before each sample): ratio to sequential O_DIRECT reads and to buffered "
        "reads of the same files",
        ["loader", "GB/s", "ratio to disk", "ratio to buffered read"],
    )
    files = [shards.shard_path(k) for k in range(shards.n_shards)]
    threads = loaders.default_read_threads(device_side=cuda)
    bl.drop_cache(shards.path)
    buffered = bl.buffered_read_gbps(files, threads, limit=2 << 30)
    table.add("sequential O_DIRECT reads (limit)", limits["disk"], 1.0, limits["disk"] / buffered)
    table.add(f"buffered read of the shards, 4 MiB preads, {threads} threads (limit)", buffered,
              buffered / limits["disk"], 1.0)  # fmt: skip
    device = "cuda" if cuda else None
    for name, layers in (("all layers", None), ("layer 11", 11)):
        bl.drop_cache(shards.path)
        gbps, _ = loader_rate(
            functools.partial(
                loaders.ShuffledLoader, shards, BATCH, layers=layers, buffer_bytes=buffer, device=device,
                mix_layers=layers is None,
            ),
            10**9,
            False,
        )  # fmt: skip
        table.add(
            f"ShuffledLoader, {name}" + (", device-side shuffle" if cuda else ""),
            gbps,
            gbps / limits["disk"],
            gbps / buffered,
        )
    table.note(
        "Target: at the disk's limit (layer 11 reads half of each example, slice by slice). The buffered read "
        "keeps as many 4 MiB requests in flight as the loader's read threads."
    )
    table.emit()


def main(quick: bool = False, keep: bool = False, gb: float | None = None) -> None:
    import torch

    cuda = torch.cuda.is_available()
    print(f"Machine: {bl.machine()}\n", flush=True)
    if cuda:
        print(f"GPU: {torch.cuda.get_device_name()}\n", flush=True)
    else:
        print("No CUDA GPU: the host parts only (device mode runs on the CPU; the SAE step on the CPU).\n", flush=True)
    work = bl.bench_dir() / "gpu"
    work.mkdir(parents=True, exist_ok=True)
    size = gb if gb is not None else (0.4 if quick else 8.0)
    md = make_metadata(max(64, int(size * 1e9 / 605_184)), "gpu", patches_per_shard=2_400_000)
    shards = build_cache(work, md)
    try:
        limits = bench_limits(shards, cuda, quick)
        bl.warm_cache(shards.path)
        bench_threads(shards, limits, cuda, quick)
        bench_modes(shards, limits, cuda, quick)
        bench_sae(shards, cuda, quick)
        bench_cold(shards, limits, cuda, quick)
    finally:
        shards.close()
        if not keep:
            shutil.rmtree(work / md.hash, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 0.4 GB cache and short samples (a minute or two)")
    parser.add_argument("--keep", action="store_true", help="keep the benchmark cache for the next run")
    parser.add_argument("--gb", type=float, default=None, help="cache size in GB (default 8; keep it inside RAM)")
    args = parser.parse_args()
    main(args.quick, args.keep, args.gb)
