"""Remote caches benchmark (issue 24): against a local S3-compatible server (moto, in a process
of its own on 127.0.0.1), every figure a same-run ratio.

1. The clients on this job: obstore (the ``[remote]`` extra) and fsspec + s3fs, on parallel
   ranged reads, one whole-object read and a multipart upload, against the same server;
   plus their import time and installed size.
2. The limits and the library: the client's own parallel ranged-read throughput (the
   limit for a cold read), ``open`` latency, the shuffled loader's tokens/s from the remote
   cache with a cold and a warm block cache beside the local-disk figure (targets: cold
   >= 0.8 of the ranged-read limit, warm >= 0.9 of local), ``push`` and ``pull`` against the
   client's own upload and download throughput (target >= 0.8).
3. The shuffle with 1 and 2 processes (``--rank``/``--world-size``, real processes),
   byte-identical, on local disk.

    .venv/bin/python scripts/bench_remote.py [--quick]

moto keeps objects in Python and reads a whole object for every ranged request, so its
absolute figures are far below a real object store's; the ratios compare the library with
the client against the same server.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import saev_shards as ss
from saev_shards import store
from saev_shards.remote.client import Client, requests_in_flight
from saev_shards.store.remote import PUSH_FILES
from scripts import benchlib as bl
from scripts.bench_core import make_metadata
from tests.support.caches import tree_bytes
from tests.support.remote_servers import create_bucket, moto_server, s3_environment

MIB = 1 << 20
#: The size of one ranged request of the limit (the block size of protocol 3.1 caches).
RANGE = 16 * MIB


def build(root: Path, n_examples: int, tag: str) -> ss.Shards:
    md = make_metadata(n_examples, tag, patches_per_shard=64 * 197)  # ~38 MB shards: many objects
    if not (root / md.hash).exists():
        rng = np.random.default_rng(0)
        batch = rng.standard_normal((32, *md.shape[1:]), dtype=np.float32).astype(np.float16)
        with ss.ShardWriter(root, md, durable=False) as w:
            for start in range(0, md.n_examples, len(batch)):
                # Distinct bytes in every block: the block cache keeps one copy of equal blocks.
                w.write(batch[: min(len(batch), md.n_examples - start)] + np.float16(start / 4096))
    return ss.open(root / md.hash)


def rate(nbytes: int, fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - t)


def ranged_reads(client: Client, files: list[tuple[str, int]], threads: int) -> int:
    """Every byte of ``files`` in `RANGE` requests, ``threads`` in flight (obstore, no checks)."""
    jobs = [(name, a, min(a + RANGE, size)) for name, size in files for a in range(0, size, RANGE)]
    with ThreadPoolExecutor(threads) as pool:
        return sum(memoryview(b).nbytes for b in pool.map(lambda j: client.get_range(*j), jobs))


# --------------------------------------------------------------------------------------
# 1. the clients


def clients_table(bucket: str, endpoint: str, quick: bool) -> None:
    import obstore
    import s3fs

    size = (64 if quick else 256) * MIB
    data = np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8).tobytes()
    client = Client(f"s3://{bucket}/clients")
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
    threads = requests_in_flight()
    starts = list(range(0, size, RANGE))
    ends = [min(s + RANGE, size) for s in starts]

    def ob_put() -> None:
        obstore.put(client.store, "o.bin", iter([data[i : i + RANGE] for i in range(0, size, RANGE)]), chunk_size=RANGE)

    def ob_ranges() -> None:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda ab: client.get_range("o.bin", *ab), zip(starts, ends, strict=True)))

    def fs_ranges() -> None:
        fs.cat_ranges([f"{bucket}/clients/f.bin"] * len(starts), starts, ends)

    rows = {
        "upload (multipart, 16 MiB parts)": (
            rate(size, ob_put),
            rate(size, lambda: fs.pipe_file(f"{bucket}/clients/f.bin", data)),
        ),
        f"ranged reads, 16 MiB, {threads} in flight": (rate(size, ob_ranges), rate(size, fs_ranges)),
        "one whole-object read": (
            rate(size, lambda: bytes(obstore.get(client.store, "o.bin").bytes())),
            rate(size, lambda: fs.cat_file(f"{bucket}/clients/f.bin")),
        ),
    }
    table = bl.Table(
        "remote_clients",
        "The clients on this job (same server, same run)",
        ["", "obstore", "fsspec + s3fs", "obstore / s3fs"],
    )
    for name, (ob, fs_rate) in rows.items():
        table.add(name, f"{ob / 1e6:.0f} MB/s", f"{fs_rate / 1e6:.0f} MB/s", ob / fs_rate)
    table.add(
        "import time", f"{_import_seconds('obstore') * 1e3:.0f} ms", f"{_import_seconds('s3fs') * 1e3:.0f} ms", ""
    )
    table.add(
        "installed size", _installed("obstore"), _installed("s3fs", "aiobotocore", "botocore", "aiohttp", "fsspec"), ""
    )
    table.note(f"{size // MIB} MiB object; moto on 127.0.0.1 ({os.cpu_count()} cores shared by server and client).")
    table.emit()


def _import_seconds(module: str) -> float:
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout)


def _installed(*packages: str) -> str:
    import importlib.util

    total = 0
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        for folder in spec.submodule_search_locations:
            total += sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
    return f"{total / 1e6:.0f} MB" + (f" ({len(packages)} packages)" if len(packages) > 1 else "")


# --------------------------------------------------------------------------------------
# 2. the library against the limits


def library_table(bucket: str, local: ss.Shards, work: Path, quick: bool) -> None:
    from saev_shards.loaders import ShuffledLoader

    root_url = f"s3://{bucket}/shards"
    files = [(name, n) for name, n, _ in local.manifest.files()]
    nbytes = sum(n for _, n in files)
    client = Client(f"{root_url}/{local.metadata.hash}")
    limit_client = Client(f"s3://{bucket}/limit")

    def upload_all() -> None:  # as push does: PUSH_FILES files at once, each a multipart upload
        with ThreadPoolExecutor(PUSH_FILES) as pool:
            for future in [pool.submit(limit_client.put, n, (local.path / n).read_bytes()) for n, _ in files]:
                future.result()

    pushes = iter(range(100))

    def push_once() -> float:  # a new remote root each round: a push to a root that has it is a no-op
        return rate(nbytes, lambda: store.push(local.path, f"{root_url}-{next(pushes)}", verify=False))

    uploads = bl.interleaved({"limit": lambda: rate(nbytes, upload_all), "push": push_once}, rounds=3)
    upload_limit, push_rate = uploads["limit"], uploads["push"]
    report = store.push(local.path, root_url, verify=False)
    with bl.stopwatch() as t_verify:
        ss.open(report.url).verify()
    opens = bl.latencies(lambda i: ss.open(report.url), 5 if quick else 20)

    def epoch(shards: ss.Shards) -> float:
        layers = list(shards.metadata.layers)
        loader = ShuffledLoader(shards, batch_size=4096, layers=layers, mix_layers=True, buffer_bytes=64 * MIB)
        start = time.perf_counter()
        tokens = sum(len(b.acts) for b in loader)
        return tokens / (time.perf_counter() - start)

    token_bytes = local.metadata.d_model * local.metadata.itemsize
    bl.warm_cache(local.path)
    cache_dir = work / "block-cache"
    os.environ["SAEV_SHARDS_BLOCK_CACHE"] = str(cache_dir)

    def cold_epoch() -> float:  # an empty block cache each time
        shutil.rmtree(cache_dir, ignore_errors=True)
        return epoch(ss.open(report.url)) * token_bytes

    dest = work / "pulled"

    def pull() -> float:
        shutil.rmtree(dest, ignore_errors=True)
        return rate(nbytes, lambda: store.pull(report.url, dest, durable=False))

    # The limit, the cold loader and pull interleaved (the server's rate drifts): medians of 3.
    limits = bl.interleaved(
        {
            "limit": lambda: rate(nbytes, lambda: ranged_reads(client, files, requests_in_flight())),
            "cold": cold_epoch,
            "pull": pull,
        },
        rounds=3,
    )
    read_limit, cold, pull_rate = limits["limit"], limits["cold"] / token_bytes, limits["pull"]
    staged = work / "staged"
    shutil.rmtree(staged, ignore_errors=True)
    # The same copy from the local cache (page-cached): what writing and hashing these bytes costs here.
    disk_write = rate(nbytes, lambda: store.copy_cache(local.path, staged, durable=False))
    pull_limit = min(read_limit, disk_write)
    shutil.rmtree(dest, ignore_errors=True)  # the copies: their memory goes back to the page cache
    shutil.rmtree(staged, ignore_errors=True)

    # "warm, new process": the first epoch of a newly opened cache (each unit is checked when
    # first opened); "warm, later epoch": a process's next epochs (its units stay open).
    # Medians of rounds interleaved with the local-disk epochs, each from the page cache.
    def local_epoch() -> float:
        bl.warm_cache(local.path)
        return epoch(local)

    steady = ss.open(report.url)
    epoch(steady)
    rates = bl.interleaved(
        {"local": local_epoch, "warm": lambda: epoch(ss.open(report.url)), "steady": lambda: epoch(steady)},
        rounds=3,
    )
    local_rate, warm, warm_steady = rates["local"], rates["warm"], rates["steady"]

    table = bl.Table(
        "remote",
        "Remote caches against the client's own limits (moto on 127.0.0.1)",
        ["", "figure", "limit", "ratio", "target"],
    )
    table.add("open (median)", f"{np.median(opens) * 1e3:.1f} ms", "", "", "")
    table.add("ranged reads (the client, the limit)", f"{read_limit / 1e6:.0f} MB/s", "", "", "")
    table.add(
        "shuffled loader, cold block cache",
        f"{cold * token_bytes / 1e6:.0f} MB/s ({cold:,.0f} tokens/s)",
        f"{read_limit / 1e6:.0f} MB/s ranged reads",
        cold * token_bytes / read_limit,
        ">= 0.8",
    )
    table.add(
        "shuffled loader, warm block cache, new process",
        f"{warm:,.0f} tokens/s",
        f"{local_rate:,.0f} tokens/s local disk",
        warm / local_rate,
        ">= 0.9",
    )
    table.add(
        "shuffled loader, warm block cache, later epoch",
        f"{warm_steady:,.0f} tokens/s",
        f"{local_rate:,.0f} tokens/s local disk",
        warm_steady / local_rate,
        ">= 0.9",
    )
    table.add(
        "push (upload, sizes checked)",
        f"{push_rate / 1e6:.0f} MB/s",
        f"{upload_limit / 1e6:.0f} MB/s client upload",
        push_rate / upload_limit,
        ">= 0.8",
    )
    table.add(
        "push's verify (read back)",
        f"{nbytes / t_verify[0] / 1e6:.0f} MB/s",
        f"{read_limit / 1e6:.0f} MB/s ranged reads",
        nbytes / t_verify[0] / read_limit,
        "",
    )
    table.add(
        "pull (download, verified)",
        f"{pull_rate / 1e6:.0f} MB/s",
        f"{pull_limit / 1e6:.0f} MB/s: ranged reads, or a local stage ({disk_write / 1e6:.0f}), the lower",
        pull_rate / pull_limit,
        ">= 0.8",
    )
    per = (
        "per block (blocks.json)"
        if store.summary(ss.open(report.url))["remote_verification"] == "per block"
        else "per whole file (protocol 3.0)"
    )
    table.note(
        f"{nbytes / 1e9:.2f} GB cache, {len(files)} files; remote reads verified {per}; "
        f"{requests_in_flight()} requests in flight."
    )
    table.emit()


# --------------------------------------------------------------------------------------
# 3. the shuffle with 1 and 2 processes


def shuffle_table(local: ss.Shards, work: Path) -> None:
    out = {1: work / "shuffle-1", 2: work / "shuffle-2"}
    for folder in out.values():
        shutil.rmtree(folder, ignore_errors=True)
    args = [
        "-m",
        "saev_shards",
        "shuffle",
        str(local.path),
        "--layers",
        str(local.metadata.layers[0]),
        "--memory",
        "256M",
    ]
    seconds = {}
    t = time.perf_counter()
    subprocess.run([sys.executable, *args, "--to", str(out[1])], check=True, capture_output=True)
    seconds[1] = time.perf_counter() - t
    t = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, *args, "--to", str(out[2]), "--rank", str(r), "--world-size", "2"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for r in range(2)
    ]
    assert [p.wait() for p in procs] == [0, 0]
    seconds[2] = time.perf_counter() - t
    [name] = [p.name for p in out[1].iterdir() if not p.name.startswith(".")]
    same = tree_bytes(out[1] / name) == tree_bytes(out[2] / name)
    table = bl.Table(
        "remote_shuffle",
        "The shuffle with 1 and 2 processes (--rank/--world-size, local disk)",
        ["processes", "seconds", "speed-up", "bytes identical"],
    )
    table.add(1, seconds[1], 1.0, "")
    table.add(2, seconds[2], seconds[1] / seconds[2], "yes" if same else "NO")
    table.note(f"{os.cpu_count()} cores; one chosen layer of {local.metadata.nbytes / 1e9:.2f} GB.")
    table.emit()


@contextlib.contextmanager
def server(work: Path) -> Iterator[tuple[str, str]]:
    with moto_server() as port:
        endpoint = f"http://127.0.0.1:{port}"
        os.environ.update(s3_environment(endpoint, work / "block-cache"))
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        create_bucket(endpoint, bucket)
        yield bucket, endpoint


def main(quick: bool = False) -> None:
    work = bl.bench_dir() / "remote"
    work.mkdir(parents=True, exist_ok=True)
    local = build(work / "shards", 256 if quick else 1536, "remote")
    with server(work) as (bucket, endpoint):
        clients_table(bucket, endpoint, quick)
        library_table(bucket, local, work, quick)
    shuffle_table(local, work)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    main(parser.parse_args().quick)
