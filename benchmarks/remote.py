"""Remote caches benchmark: against a local S3-compatible server (moto, in a process
of its own on 127.0.0.1), every figure a same-run ratio.

1. The clients on this job: obstore (the ``[remote]`` extra) and fsspec + s3fs, on parallel
   ranged reads, one whole-object read and a multipart upload, against the same server;
   plus their import time and installed size.
2. The limits and the library: the client's own parallel ranged-read throughput (the
   limit for a cold read), the library's own reads alone (blocks fetched, verified,
   stored and copied out, no loader: what a cold epoch's reads cost), ``open`` latency,
   the shuffled loader's tokens/s from the remote cache with a cold block cache (in a
   running process, and in a new one) and a warm one (the first epoch of a process of
   its own, of a cache opened again, and later epochs) beside the local cache read from
   the page cache in the same rounds (targets: cold >= 0.8 of the ranged-read limit,
   warm >= 0.9 of local), ``push`` and ``pull`` against the client's own upload and
   download throughput (target >= 0.8), and what bounds each (CPU per GB here and in the
   server).
3. The shuffle with 1 and 2 processes (``--rank``/``--world-size``, real processes),
   byte-identical, on local disk.

    .venv/bin/python benchmarks/remote.py [--quick]

moto keeps objects in Python and reads a whole object for every ranged request, so its
absolute figures are far below a real object store's; the ratios compare the library with
the client against the same server.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import queue
import shutil
import statistics
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
from benchmarks import benchlib as bl
from benchmarks import tables
from benchmarks.core import make_metadata
from saev_shards import store
from saev_shards.remote.client import Client, requests_in_flight
from saev_shards.store.remote import PUSH_FILES
from tests.support.caches import tree_bytes
from tests.support.remote_servers import create_bucket, moto_process, s3_environment

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


def ranges(files: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """``(name, start, stop)`` of every `RANGE` of ``files`` (16 MiB: a block each)."""
    return [(name, a, min(a + RANGE, size)) for name, size in files for a in range(0, size, RANGE)]


def ranged_reads(client: Client, files: list[tuple[str, int]], threads: int) -> int:
    """Every byte of ``files`` in `RANGE` requests, ``threads`` in flight (obstore, no checks)."""
    with ThreadPoolExecutor(threads) as pool:
        return sum(memoryview(b).nbytes for b in pool.map(lambda j: client.get_range(*j), ranges(files)))


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
    table = tables.Table(
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


@dataclasses.dataclass(frozen=True)
class Sample:
    """One timed run: bytes per second, and CPU seconds per GB of this process and the server's."""

    rate: float
    client: float
    server: float


class Meter:
    """Times a run and reads the CPU time it took here (every thread) and in the server process."""

    def __init__(self, server_pid: int) -> None:
        self.stat = Path(f"/proc/{server_pid}/stat")

    def server_cpu(self) -> float:
        try:  # utime + stime, fields 14 and 15 (after the command name in parentheses)
            fields = self.stat.read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return float("nan")

    def run(self, fn: Callable[[], int], setup: Callable[[], object] | None = None) -> Sample:
        """``fn()`` returns the bytes it moved; ``setup()`` runs first, off the clock."""
        if setup is not None:
            setup()
        t0, c0, s0 = time.perf_counter(), os.times(), self.server_cpu()
        nbytes = fn()
        t1, c1, s1 = time.perf_counter(), os.times(), self.server_cpu()
        gbytes = nbytes / 1e9
        client = (c1.user - c0.user + c1.system - c0.system) / gbytes
        return Sample(nbytes / (t1 - t0), client, (s1 - s0) / gbytes)


def rounds(
    meter: Meter,
    fns: dict[str, Callable[[], int | Sample]],
    n: int,
    setups: dict[str, Callable[[], object]] | None = None,
) -> dict[str, list[Sample]]:
    """Each run once per round, in turn (the machine's drift is spread over all of them),
    each after its setup (off the clock). A run returns the bytes it moved, timed here, or a
    `Sample` it timed itself (a process of its own: `new_process_epoch`)."""
    out: dict[str, list[Sample]] = {k: [] for k in fns}
    for _ in range(n):
        for name, fn in fns.items():
            out[name].append(_timed(meter, fn, (setups or {}).get(name)))
    return out


def _timed(meter: Meter, fn: Callable[[], int | Sample], setup: Callable[[], object] | None) -> Sample:
    got: list[int | Sample] = []

    def run() -> int:
        got.append(fn())
        return got[0] if isinstance(got[0], int) else 1

    timed = meter.run(run, setup)
    return got[0] if isinstance(got[0], Sample) else timed


#: One epoch of the shuffled loader in a process of its own (`new_process_epoch`), timed there
#: from the loader's creation to its last batch, as `library_table`'s ``epoch`` is here.
_CHILD_EPOCH = """
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import torch  # imported before the clock starts, as in the process it is compared with
import saev_shards as ss
from saev_shards.loaders import ShuffledLoader
shards = ss.open(sys.argv[2])
token_bytes = shards.metadata.d_model * shards.metadata.itemsize
t0, c0 = time.perf_counter(), os.times()
loader = ShuffledLoader(
    shards, batch_size=4096, layers=list(shards.metadata.layers), mix_layers=True, buffer_bytes=int(sys.argv[3])
)
moved = sum(len(b.acts) for b in loader) * token_bytes
t1, c1 = time.perf_counter(), os.times()
print(json.dumps({"bytes": moved, "seconds": t1 - t0, "cpu": c1.user - c0.user + c1.system - c0.system}))
"""


def new_process_epoch(url: str, meter: Meter) -> Sample:
    """The first epoch of the cache at ``url`` (a URL or a local folder) in a new process (its
    imports and ``open`` off the clock): what a training run started on a node whose block
    cache (or page cache) is warm sees."""
    s0 = meter.server_cpu()
    root = str(Path(__file__).resolve().parent.parent)
    done = subprocess.run(
        [sys.executable, "-c", _CHILD_EPOCH, root, url, str(64 * MIB)], check=True, capture_output=True, text=True
    )
    got = json.loads(done.stdout.strip().splitlines()[-1])
    gbytes = got["bytes"] / 1e9
    return Sample(got["bytes"] / got["seconds"], got["cpu"] / gbytes, (meter.server_cpu() - s0) / gbytes)


def med(samples: list[Sample], field: str = "rate") -> float:
    return float(statistics.median(getattr(s, field) for s in samples))


def mbps(samples: list[Sample]) -> str:
    """``median MB/s (min-max)``."""
    rates = [s.rate / 1e6 for s in samples]
    return f"{statistics.median(rates):,.0f} MB/s ({min(rates):,.0f}-{max(rates):,.0f})"


def ratio(figure: list[Sample], limit: list[Sample]) -> str:
    """Median of the per-round ratios, with their range (rounds ran side by side)."""
    values = [f.rate / lim.rate for f, lim in zip(figure, limit, strict=True)]
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def library_table(bucket: str, local: ss.Shards, work: Path, meter: Meter, quick: bool) -> None:
    from saev_shards.loaders import ShuffledLoader

    root_url = f"s3://{bucket}/shards"
    files = [(name, n) for name, n, _ in local.manifest.files()]
    nbytes = sum(n for _, n in files)
    limit_client = Client(f"s3://{bucket}/limit")
    n_rounds = 2 if quick else 5
    in_flight = requests_in_flight()

    # -- uploads: push against the client uploading the same files the same way ------------
    def upload_all() -> int:  # as push does: PUSH_FILES files at once, each a multipart upload
        with ThreadPoolExecutor(PUSH_FILES) as pool:
            for future in [pool.submit(limit_client.put, n, (local.path / n).read_bytes()) for n, _ in files]:
                future.result()
        return nbytes

    pushes = iter(range(100))

    def push_once() -> int:  # a new remote root each round: a push to a root that has it is a no-op
        store.push(local.path, f"{root_url}-{next(pushes)}", verify=False)
        return nbytes

    uploads = rounds(meter, {"upload": upload_all, "push": push_once}, 2 if quick else 3)
    report = store.push(local.path, root_url, verify=False)
    client = Client(report.url)
    verify = [meter.run(lambda: ss.open(report.url).verify())]
    opens = bl.latencies(lambda i: ss.open(report.url), 5 if quick else 20)

    # -- network: the cold loader against ranged reads, pull against downloads to files -----
    token_bytes = local.metadata.d_model * local.metadata.itemsize

    def loader_of(shards: ss.Shards) -> ShuffledLoader:
        layers = list(shards.metadata.layers)
        return ShuffledLoader(shards, batch_size=4096, layers=layers, mix_layers=True, buffer_bytes=64 * MIB)

    def run_epoch(loader: ShuffledLoader) -> int:
        return sum(len(b.acts) for b in loader) * token_bytes

    def epoch(shards: ss.Shards) -> int:
        return run_epoch(loader_of(shards))

    # Cold, two ways. "cold": a process that has read before (its fetch threads started and its
    # buffers faulted in, as through most of a long epoch) lets go of every unit it holds and
    # reads the cache again with an empty block cache. "cold_new": a newly opened cache's first
    # epoch, which also faults in the process's buffers (up to about 1 GiB; a fixed cost that
    # a 1 GB cache cannot hide). Both on the clock until the block cache's writes are done.
    cache_dir = work / "block-cache"
    skipped: list[float] = []
    reader = ss.open(report.url)
    reader_files: Any = reader.files
    # One loader for every cold epoch, as a training run keeps one: its window buffers (which
    # a local cache, read in place, does without) are faulted in once, not in every round.
    # Its first epoch from an empty block cache: a loader that finds every block there maps them
    # (and keeps its map), which a later epoch is not cold for.
    shutil.rmtree(cache_dir, ignore_errors=True)
    cold_loader = loader_of(reader)
    run_epoch(cold_loader)

    def empty_block_cache() -> None:
        shutil.rmtree(cache_dir, ignore_errors=True)

    def let_go() -> None:
        reader_files.let_go()
        reader_files.flush()
        empty_block_cache()

    def cold_epoch() -> int:
        before = reader_files.skipped_bytes
        moved = run_epoch(cold_loader)
        reader_files.flush()
        skipped.append((reader_files.skipped_bytes - before) / nbytes)
        return moved

    def cold_new_epoch() -> int:
        shards = ss.open(report.url)
        moved = epoch(shards)
        shards.close()
        return moved

    # The library's own reads alone: every block fetched, verified, stored and copied out into
    # a reused buffer, as many in flight as the ranged reads (what a cold epoch does, without
    # the loader's windows and gathers). Its buffers are faulted in before the rounds.
    spare: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
    for _ in range(in_flight):
        buffer = bytearray(RANGE)
        buffer[:] = bytes(RANGE)
        spare.put(memoryview(buffer))
    jobs = ranges(files)

    def read_one(job: tuple[str, int, int]) -> int:
        name, start, stop = job
        view = spare.get()
        try:
            return int(reader_files.preadv(reader_files.open(name), [view[: stop - start]], start))
        finally:
            spare.put(view)

    def verified_reads() -> int:
        with ThreadPoolExecutor(in_flight) as pool:
            moved = sum(pool.map(read_one, jobs))
        reader_files.flush()
        return moved

    dest = work / "pulled"
    downloads = work / "downloads"

    def pull() -> int:
        shutil.rmtree(dest, ignore_errors=True)
        store.pull(report.url, dest, durable=False)
        return nbytes

    def download() -> int:  # the client alone: the same objects to local files, as many at once
        shutil.rmtree(downloads, ignore_errors=True)
        downloads.mkdir(parents=True)
        with ThreadPoolExecutor(in_flight) as pool:
            return sum(pool.map(lambda f: _download(client, f[0], f[1], downloads / f[0]), files))

    network = rounds(
        meter,
        {
            "reads": lambda: ranged_reads(client, files, in_flight),
            "verified": verified_reads,
            "cold": cold_epoch,
            "cold_new": cold_new_epoch,
            "download": download,
            "pull": pull,
        },
        n_rounds,
        {"verified": let_go, "cold": let_go, "cold_new": empty_block_cache},
    )
    reader.close()
    for folder in (dest, downloads):  # their memory goes back to the page cache
        shutil.rmtree(folder, ignore_errors=True)

    # -- warm: the block cache against the local cache, both read from the page cache --------
    # "warm": the first epoch of a new process (its entries taken on their seals, not hashed
    # again); "reopened": the first epoch of a cache opened again in this process; "steady": a
    # process's next epochs (its map, or its units, kept).
    _fill(report.url)
    steady = ss.open(report.url)
    epoch(steady)

    def warm_both() -> None:
        bl.warm_cache(local.path)
        bl.warm_cache(cache_dir / "blocks")

    reopened: list[ss.Shards] = []

    def reopen() -> None:  # off the clock, as the local cache's open is
        warm_both()
        reopened[:] = [ss.open(report.url)]

    warm = rounds(
        meter,
        {
            "local": lambda: epoch(local),
            "local_new": lambda: new_process_epoch(str(local.path), meter),
            "warm": lambda: new_process_epoch(report.url, meter),
            "reopened": lambda: epoch(reopened[0]),
            "steady": lambda: epoch(steady),
        },
        n_rounds,
        {"local": warm_both, "local_new": warm_both, "warm": warm_both, "reopened": reopen},
    )

    table = tables.Table(
        "remote",
        "Remote caches against the client's own limits (moto on 127.0.0.1; medians, range over rounds)",
        ["", "figure", "limit (the same run)", "ratio", "target"],
    )
    table.add("open (median)", f"{np.median(opens) * 1e3:.1f} ms", "", "", "")
    cold = network["cold"]
    table.add(
        "shuffled loader, cold block cache, running process",
        f"{mbps(cold)}, {med(cold) / token_bytes:,.0f} tokens/s",
        f"{mbps(network['reads'])}: ranged reads into memory, {in_flight} in flight",
        ratio(cold, network["reads"]),
        ">= 0.8",
    )
    # What the cores allow: the reads use (client + server) CPU per GB; a cold epoch does the
    # same and the loader's own work besides (the local-cache epoch's CPU per GB), on the cores
    # the server shares. Where the reads are bound by the cores, the cold loader is bound at
    # reads / (reads + loader) of them, and its own CPU per GB says what it spends beyond that.
    reads_cpu = med(network["reads"], "client") + med(network["reads"], "server")
    loader_cpu = med(warm["local"], "client")
    cold_cpu = med(cold, "client") + med(cold, "server")
    table.add(
        "  cold loader's ceiling if bound by these cores",
        f"CPU s/GB: {cold_cpu:.2f} (client + server)",
        f"{reads_cpu:.2f} for the reads + {loader_cpu:.2f} for the loader's own work",
        f"{reads_cpu / (reads_cpu + loader_cpu):.2f} (at {reads_cpu / cold_cpu:.2f} now)",
        "",
    )
    verified_cpu = med(network["verified"], "client") + med(network["verified"], "server")
    table.add(
        "  the library's reads alone: fetched, verified, stored, copied out (no loader)",
        f"{mbps(network['verified'])}, CPU s/GB: {verified_cpu:.2f}",
        "the ranged reads above",
        ratio(network["verified"], network["reads"]),
        "",
    )
    table.add(
        "  the cold loader against them",
        "",
        f"the ceiling with them bound by these cores: {reads_cpu / (verified_cpu + loader_cpu):.2f} of the reads",
        ratio(cold, network["verified"]),
        "",
    )
    table.add(
        "  the same, first epoch of a new process",
        f"{mbps(network['cold_new'])}",
        "the ranged reads above",
        ratio(network["cold_new"], network["reads"]),
        "",
    )
    for name, label, limit, limit_label in (
        ("warm", "first epoch of a new process", "local_new", "the same of the local cache"),
        ("warm", "first epoch of a new process", "local", "local cache, page cache, in this process"),
        ("reopened", "cache opened again in this process", "local", "local cache, page cache"),
        ("steady", "later epoch", "local", "local cache, page cache"),
    ):
        table.add(
            f"shuffled loader, warm block cache, {label}",
            f"{med(warm[name]) / token_bytes:,.0f} tokens/s",
            f"{med(warm[limit]) / token_bytes:,.0f} tokens/s: {limit_label}",
            ratio(warm[name], warm[limit]),
            ">= 0.9",
        )
    table.add(
        "push (upload, sizes checked)",
        mbps(uploads["push"]),
        f"{mbps(uploads['upload'])}: the client uploading the files, {PUSH_FILES} at once",
        ratio(uploads["push"], uploads["upload"]),
        ">= 0.8",
    )
    table.add("push's verify (read back)", mbps(verify), "", "", "")
    table.add(
        "pull (download, verified)",
        mbps(network["pull"]),
        f"{mbps(network['download'])}: the client downloading the objects to files, {in_flight} at once",
        ratio(network["pull"], network["download"]),
        ">= 0.8",
    )
    table.add(
        "pull against ranged reads into memory",
        "",
        mbps(network["reads"]),
        ratio(network["pull"], network["reads"]),
        "",
    )
    per = (
        "per block (blocks.json)"
        if store.summary(ss.open(report.url))["remote_verification"] == "per block"
        else "per whole file (protocol 3.0)"
    )
    table.note(
        f"{nbytes / 1e9:.2f} GB cache, {len(files)} files; remote reads verified {per}; {in_flight} requests in "
        f"flight; {n_rounds} rounds. Cold epochs left {statistics.median(skipped):.0%} of the bytes out of the "
        "block cache (median; its write backlog was full: best effort)."
    )
    table.emit()
    bounds_table(network, warm, uploads, verify, work, nbytes)


def _download(client: Client, name: str, nbytes: int, path: Path) -> int:
    """``name`` into ``path``, as a user of the client would: one streamed request, buffered writes."""
    got = 0
    with open(path, "wb", buffering=0) as out:
        for piece in client.stream(name, 0, nbytes):
            view = memoryview(piece)
            got += view.nbytes
            while view.nbytes:
                view = view[out.write(view) :]
    return got


def _fill(url: str) -> None:
    """Every block of the cache at ``url`` in the block cache (it is best effort: read it all
    again, in a newly opened reader, until no block was left out)."""
    for _ in range(8):
        shards = ss.open(url)
        for name, _, _ in shards.manifest.files():
            shards.files.read(name)
        shards.close()
        if not shards.files.skipped:  # type: ignore[attr-defined]
            return


def bounds_table(
    network: dict[str, list[Sample]],
    warm: dict[str, list[Sample]],
    uploads: dict[str, list[Sample]],
    verify: list[Sample],
    work: Path,
    nbytes: int,
) -> None:
    """CPU seconds per GB of each run, here and in the server: on a machine whose cores the
    server shares, what one run spends is taken from the other."""
    table = tables.Table(
        "remote_bounds",
        "What bounds them: CPU seconds per GB, this process and the server (medians)",
        ["run", "MB/s", "client CPU s/GB", "server CPU s/GB", "cores busy"],
    )
    rows = [
        ("ranged reads into memory (the cold limit)", network["reads"]),
        ("the library's reads alone: fetched, verified, stored, copied out", network["verified"]),
        ("shuffled loader, cold block cache", network["cold"]),
        ("the same, first epoch of a new process", network["cold_new"]),
        ("shuffled loader, local cache (page cache)", warm["local"]),
        ("shuffled loader, local cache, first epoch of a new process", warm["local_new"]),
        ("shuffled loader, warm block cache, first epoch of a new process", warm["warm"]),
        ("downloads to files (pull's limit)", network["download"]),
        ("pull", network["pull"]),
        ("uploads (push's limit)", uploads["upload"]),
        ("push", uploads["push"]),
        ("verify (whole objects streamed)", verify),
    ]
    for name, samples in rows:
        client, server = med(samples, "client"), med(samples, "server")
        table.add(name, f"{med(samples) / 1e6:,.0f}", client, server, med(samples) / 1e9 * (client + server))
    for name, rate, cpu in _disk_writes(work, min(nbytes, 512 * MIB)) + _fresh_memory(min(nbytes, 512 * MIB)):
        table.add(name, f"{rate / 1e6:,.0f}", cpu, "", "")
    table.note(
        f"{os.cpu_count()} cores shared by this process and the server (moto: Python, one core at most under "
        "its GIL). A cold epoch does what the ranged reads do, plus the loader's own work (the local-cache row) "
        "and storing blocks; the block cache writes O_DIRECT from the buffers blocks arrive in (the same bytes "
        "through the page cache cost far more CPU here, fresh memory being dear on this machine), and those buffers "
        "are huge pages (the last rows)."
    )
    table.emit()


def _disk_writes(work: Path, nbytes: int) -> list[tuple[str, float, float]]:
    """Writing ``nbytes`` as 16 MiB files from one buffer: O_DIRECT, then through the page cache."""
    from saev_shards.fileio import aligned_buffer, open_direct, pwrite_direct

    folder = work / "disk-writes"
    buffer = aligned_buffer(RANGE)
    buffer.write(os.urandom(RANGE))
    out = []
    for label, direct in (("storing 16 MiB blocks, O_DIRECT (the block cache)", True), ("the same, page cache", False)):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        t0, c0 = time.perf_counter(), os.times()
        for i in range(nbytes // RANGE):
            fd = os.open(folder / str(i), os.O_RDWR | os.O_CREAT, 0o600)
            direct_fd = open_direct(folder / str(i)) if direct else None
            pwrite_direct(direct_fd, fd, memoryview(buffer), 0)
            for f in (fd, direct_fd):
                if f is not None:
                    os.close(f)
        t1, c1 = time.perf_counter(), os.times()
        written = nbytes // RANGE * RANGE
        out.append((label, written / (t1 - t0), (c1.user - c0.user + c1.system - c0.system) / (written / 1e9)))
    shutil.rmtree(folder, ignore_errors=True)
    return out


def _fresh_memory(nbytes: int) -> list[tuple[str, float, float]]:
    """Filling ``nbytes`` of newly mapped 16 MiB buffers: `fileio.aligned_buffer`'s (huge pages
    where the system allows them), then the same in 4 KiB pages."""
    import mmap

    from saev_shards.fileio import aligned_buffer

    source = os.urandom(RANGE)
    out = []
    for label, make in (
        ("filling fresh 16 MiB buffers, aligned_buffer (huge pages)", lambda: aligned_buffer(RANGE)),
        ("the same, 4 KiB pages", lambda: mmap.mmap(-1, RANGE, flags=mmap.MAP_PRIVATE)),
    ):
        t0, c0 = time.perf_counter(), os.times()
        for _ in range(nbytes // RANGE):
            buffer = make()
            buffer[:] = source
            buffer.close()
        t1, c1 = time.perf_counter(), os.times()
        filled = nbytes // RANGE * RANGE
        out.append((label, filled / (t1 - t0), (c1.user - c0.user + c1.system - c0.system) / (filled / 1e9)))
    return out


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
    table = tables.Table(
        "remote_shuffle",
        "The shuffle with 1 and 2 processes (--rank/--world-size, local disk)",
        ["processes", "seconds", "speed-up", "bytes identical"],
    )
    table.add(1, seconds[1], 1.0, "")
    table.add(2, seconds[2], seconds[1] / seconds[2], "yes" if same else "NO")
    table.note(f"{os.cpu_count()} cores; one chosen layer of {local.metadata.nbytes / 1e9:.2f} GB.")
    table.emit()


@contextlib.contextmanager
def server(work: Path) -> Iterator[tuple[str, str, Meter]]:
    with moto_process() as (port, proc):
        endpoint = f"http://127.0.0.1:{port}"
        os.environ.update(s3_environment(endpoint, work / "block-cache"))
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        create_bucket(endpoint, bucket)
        yield bucket, endpoint, Meter(proc.pid)


def main(quick: bool = False) -> None:
    work = tables.bench_dir() / "remote"
    work.mkdir(parents=True, exist_ok=True)
    local = build(work / "shards", 256 if quick else 1536, "remote")
    with server(work) as (bucket, endpoint, meter):
        clients_table(bucket, endpoint, quick)
        library_table(bucket, local, work, meter, quick)
    shuffle_table(local, work)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    main(parser.parse_args().quick)
