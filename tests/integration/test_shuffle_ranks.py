"""The shuffle across processes: ``--rank R --world-size W`` over one work folder, started as
real separate processes (``python -m saev_shards shuffle``), gives the bytes of a one-process
shuffle; a rank killed mid-scatter resumes when started again; every rank exits 0 once the
output is published, whoever published it, and nothing is left beside it; ranks started with
other arguments are refused at once, naming the difference; a rank whose partners do not come
gives up after its bounded wait, naming them; and under torch.distributed (gloo on the CPU,
torchrun for the command line) the ranks meet through the process group."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import saev_shards as ss
from saev_shards.cli import main
from saev_shards.shuffle import plan_shuffle, run_rank
from saev_shards.shuffle.meeting import rendezvous_folder

from ..support.caches import small_metadata, tree_bytes, write_cache

#: A budget that cuts the small source into several chunks, buckets and output shards.
MEMORY = "64K"
#: Seconds a rank waits for missing partners in these tests (the default is half an hour).
WAIT = "3"


@pytest.fixture
def source(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    root.mkdir()
    md = small_metadata(n_examples=200, d_model=16)
    write_cache(root, md, labels=True, lengths=np.arange(200) % 5 + 1)
    return root / md.hash


@pytest.fixture
def small_source(tmp_path: Path) -> Path:
    """A source whose shuffled output (one layer, content tokens) is a single shard."""
    root = tmp_path / "small"
    root.mkdir()
    md = small_metadata(n_examples=12, d_model=8, patches_per_shard=4 * 2 * 100)
    write_cache(root, md)
    return root / md.hash


def args(source: Path, out: Path, *extra: str) -> list[str]:
    return ["shuffle", str(source), "--layers", "6,11", "--seed", "7", "--memory", MEMORY, "--to", str(out), *extra]


_RANK = """
import os, signal, sys, time
from pathlib import Path
from saev_shards import fileio
from saev_shards.cli import main
kill_after = int(os.environ.get("KILL_AFTER_RUNS", "0"))
pause_at = os.environ.get("PAUSE_AT", "")
sealed = []
def hook(name, index):
    if name == "rank-run" and kill_after:
        sealed.append(index)
        if len(sealed) == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    if name == pause_at:  # tell the test, then wait for its go
        Path(os.environ["PAUSE_FILE"]).write_text("paused")
        while not Path(os.environ["PAUSE_FILE"] + ".go").exists():
            time.sleep(0.05)
fileio.fault_hook = hook
sys.exit(main(sys.argv[1:]))
"""


def clean_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, **extra}
    for name in ("RANK", "WORLD_SIZE", "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_JOB_ID",
                 "MASTER_ADDR", "MASTER_PORT"):  # fmt: skip
        env.pop(name, None)
    return env


def start_rank(argv: list[str], rank: int, world: int, kill_after: int = 0, **env: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-c", textwrap.dedent(_RANK), *argv, "--rank", str(rank), "--world-size", str(world)]
    environ = clean_env(KILL_AFTER_RUNS=str(kill_after), **env)
    return subprocess.Popen(cmd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for(condition: object, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def only_the_output(out: Path, name: str) -> None:
    """Nothing beside the published cache: no scratch, staging, lock or rendezvous folder."""
    assert sorted(p.name for p in out.iterdir()) == [name]


def one_process(source: Path, out: Path, *extra: str) -> Path:
    assert main(args(source, out, *extra)) == 0
    [published] = [p for p in out.iterdir() if not p.name.startswith(".")]
    return published


@pytest.mark.parametrize("extra", [(), ("--dtype", "float8_e4m3")], ids=["as-stored", "float8"])
def test_two_ranks_give_the_bytes_of_one_process(source: Path, tmp_path: Path, extra: tuple[str, ...]) -> None:
    expected = one_process(source, tmp_path / "one", *extra)
    out = tmp_path / "two"
    procs = [start_rank(args(source, out, *extra), r, 2) for r in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert results[0][0].decode().strip() == str(out / expected.name)  # rank 0 publishes and prints it
    assert b"rank 0 publishes" in results[1][1]
    assert tree_bytes(out / expected.name) == tree_bytes(expected)
    only_the_output(out, expected.name)  # the scratch folder and the ranks' rendezvous are gone
    shuffled = ss.open(out / expected.name)
    assert shuffled.verify() > 0
    assert shuffled.metadata.dtype == ("float8_e4m3" if extra else "float16")


def test_a_killed_rank_resumes(source: Path, tmp_path: Path) -> None:
    expected = one_process(source, tmp_path / "one")
    out = tmp_path / "three"
    rank0 = start_rank(args(source, out), 0, 3)
    rank2 = start_rank(args(source, out), 2, 3)
    killed = start_rank(args(source, out), 1, 3, kill_after=1)
    killed.communicate(timeout=300)
    assert killed.returncode == -9
    work = out / f".shuffle-{expected.name}"
    assert work.is_dir() and any(work.glob("run*.json"))  # what the killed rank sealed stays
    assert rank0.poll() is None  # rank 0 waits for rank 1's runs
    again = start_rank(args(source, out), 1, 3)
    results = [p.communicate(timeout=300) for p in (rank0, rank2, again)]
    assert [p.returncode for p in (rank0, rank2, again)] == [0, 0, 0], results
    assert tree_bytes(out / expected.name) == tree_bytes(expected)
    only_the_output(out, expected.name)


def test_ranks_must_share_one_plan(source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mixed"
    first = start_rank(args(source, out), 1, 2, kill_after=1)  # seals one run, then dies
    first.communicate(timeout=300)
    other = ["shuffle", str(source), "--layers", "6,11", "--seed", "7", "--memory", "1M", "--to", str(out)]
    assert main([*other, "--rank", "0", "--world-size", "2"]) == 1
    assert "need one plan" in capsys.readouterr().err


# -- fewer output shards than ranks, and run_rank alone ----------------------------------------


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_exits_0_when_the_output_has_fewer_shards_than_ranks(
    small_source: Path, tmp_path: Path, world: int
) -> None:
    """Before the fix rank 0 always exited 1 with AlreadyPublishedError (its one writer had
    published already) and left its scratch folder behind, though the output was right."""
    base = ["shuffle", str(small_source), "--layers", "11", "--seed", "3", "--to"]
    assert main([*base, str(tmp_path / "one")]) == 0
    [expected] = [p for p in (tmp_path / "one").iterdir() if not p.name.startswith(".")]
    assert ss.open(expected).metadata.n_shards == 1
    out = tmp_path / "ranks"
    procs = [start_rank([*base, str(out)], r, world) for r in range(world)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * world, results
    assert results[0][0].decode().strip() == str(out / expected.name)
    assert tree_bytes(out / expected.name) == tree_bytes(expected)
    only_the_output(out, expected.name)


def test_run_rank_of_one_publishes(small_source: Path, tmp_path: Path) -> None:
    """``run_rank(plan, 0, 1)`` raised AlreadyPublishedError before the fix."""
    plan = plan_shuffle(small_source, tmp_path / "out", layers=11, seed=3)
    shuffled = run_rank(plan, 0, 1, durable=False)
    assert shuffled is not None and shuffled.path == plan.path and shuffled.verify() > 0
    only_the_output(tmp_path / "out", plan.output.hash)
    again = run_rank(plan, 0, 1, durable=False)  # published already: returned at once
    assert again is not None and again.path == plan.path


# -- refused at once ---------------------------------------------------------------------------


@pytest.mark.parametrize(("rank", "world"), [(2, 2), (-1, 2), (0, 0), (5, 3)])
def test_a_rank_outside_the_world_is_refused_at_once(small_source: Path, tmp_path: Path, rank: int, world: int) -> None:
    """Before the fix ``run_rank(plan, 2, 2)`` waited forever for runs no rank would write."""
    plan = plan_shuffle(small_source, tmp_path / "out", layers=11)
    with pytest.raises(ss.ShuffleError, match=r"rank: expected 0 <= rank < world_size"):
        run_rank(plan, rank, world, wait=1)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    proc = subprocess.run(
        [sys.executable, "-m", "saev_shards", "shuffle", str(small_source), "--layers", "11", "--to",
         str(tmp_path / "cli"), "--rank", str(rank), "--world-size", str(world)],
        check=False, env=clean_env(), capture_output=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and b"rank: expected 0 <= rank < world_size" in proc.stderr
    assert not (tmp_path / "cli").exists() or not any((tmp_path / "cli").iterdir())


@pytest.mark.parametrize(
    ("other", "difference"),
    [
        (("--seed", "8"), "seed: 8 here, 7 there"),
        (("--world-size", "3"), "world_size: 3 here, 2 there"),
        (("--exclude-token-ids", "3"), "exclude_token_ids: [3] here, [] there"),
    ],
    ids=["seed", "world size", "token mask"],
)
def test_ranks_started_with_other_arguments_are_refused_at_once(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], other: tuple[str, ...], difference: str
) -> None:
    """Before the fix other seeds made each rank wait forever in its own folder, and another world
    size made both wait forever in one. Rank 0 runs; rank 1 started with another argument is
    refused at once, naming it; rank 0, its partner never coming, gives up after its wait and
    says what rank 1 was last started with."""
    out = tmp_path / "out"
    ids_source = source
    if "--exclude-token-ids" in other:  # a source with a token_ids column
        md = small_metadata(n_examples=40, d_model=16)
        with ss.ShardWriter(tmp_path / "ids", md, durable=False, columns={"token_ids": ("int32", (5,))}) as w:
            w.write(np.ones(md.shape, np.float16), columns={"token_ids": np.zeros((40, 5), np.int32)})
        ids_source = tmp_path / "ids" / md.hash
    rank0 = start_rank([*args(ids_source, out), "--wait", WAIT], 0, 2)
    plan = plan_shuffle(ids_source, out, layers=[6, 11], seed=7, memory_bytes=64 << 10)
    wait_for((rendezvous_folder(plan) / "rank-0.json").exists, "rank 0 to join")
    argv = [*args(ids_source, out), *other, "--rank", "1"]
    if "--world-size" not in other:
        argv += ["--world-size", "2"]
    started = time.monotonic()
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert time.monotonic() - started < 60  # at once: it never waits for anyone
    assert re.search(r"rank 1 of \d: refused, running ranks of this shuffle .* were started with other arguments", err)
    assert f"rank 0 ({socket.gethostname()}, pid {rank0.pid}): {difference}" in err
    _, rank0_err = rank0.communicate(timeout=300)
    assert rank0.returncode == 1
    text = rank0_err.decode()
    assert "rank 0: waiting for" in text and f"gave up after {WAIT} s without progress" in text
    assert "rank 1 (not running; last started with other arguments:" in text
    assert not rendezvous_folder(plan).exists()  # the last rank out removed it


def test_a_rank_whose_partners_never_come_gives_up_naming_them(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    started = time.monotonic()
    assert main([*args(source, out), "--rank", "0", "--world-size", "3", "--wait", "2"]) == 1
    err = capsys.readouterr().err
    assert time.monotonic() - started < 120
    assert re.search(r"rank 0: waiting for \d+ runs of rank 1 \(not running\), rank 2 \(not running\)", err)
    assert re.search(r"rank 0 of 3: gave up after 2 s without progress, waiting for \d+ runs of rank 1 "
                     r"\(not running\), rank 2 \(not running\)", err)  # fmt: skip
    plan = plan_shuffle(source, out, layers=[6, 11], seed=7, memory_bytes=64 << 10)
    assert plan.work.is_dir() and any(plan.work.glob("run*.json"))  # its sealed runs stay for the rerun
    assert not rendezvous_folder(plan).exists()
    with pytest.raises(ss.ShuffleError, match="wait: expected a number of seconds above 0"):
        run_rank(plan, 0, 2, wait=0)
    with pytest.raises(SystemExit) as usage:
        main([*args(source, out), "--wait", "soon"])
    assert usage.value.code == 2 and "--wait: expected a number of seconds above 0" in capsys.readouterr().err


# -- another process publishing first --------------------------------------------------------


def test_another_process_publishing_first_is_publication(source: Path, tmp_path: Path) -> None:
    """Rank 0 paused just before it finalizes; meanwhile another process finalizes the same
    output. Before the fix rank 0 then raised AlreadyPublishedError and kept its scratch."""
    expected = one_process(source, tmp_path / "one")
    out = tmp_path / "two"
    pause = tmp_path / "paused"
    rank0 = start_rank(args(source, out), 0, 2, PAUSE_AT="rank-finalize", PAUSE_FILE=str(pause))
    rank1 = start_rank(args(source, out), 1, 2)
    _, err1 = rank1.communicate(timeout=300)
    assert rank1.returncode == 0, err1
    wait_for(pause.exists, "rank 0 to reach its finalize")
    md = ss.open(expected).metadata
    ss.finalize(out, md, durable=False)  # someone else publishes the same bytes first
    Path(f"{pause}.go").write_text("go")
    stdout, err0 = rank0.communicate(timeout=300)
    assert rank0.returncode == 0, err0
    assert stdout.decode().strip() == str(out / expected.name)
    assert tree_bytes(out / expected.name) == tree_bytes(expected)
    only_the_output(out, expected.name)


# -- through torch.distributed (gloo on the CPU) ---------------------------------------------

_TORCH_RANKS = """
import datetime, json, os, sys, time
import torch.distributed as dist
from saev_shards import fileio
from saev_shards.shuffle import plan_shuffle, run_rank
rank, store, source, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
failing = []
def hook(name, index):
    if name == "rank-run" and failing:
        raise RuntimeError("disk on fire")
fileio.fault_hook = hook
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
# Scenarios, in one process group: name, this rank's seed, whether it fails scattering, its wait.
for name, seeds, fails, wait in [("same", (7, 7), (), 20), ("other seeds", (7, 8), (), 20),
                                 ("rank 1 fails", (7, 7), (1,), 20), ("rank 1 absent", (7, 7), (), 3)]:
    failing[:] = [True] if rank in fails else []
    if name == "rank 1 absent" and rank == 1:  # in the group, never in the shuffle
        time.sleep(wait + 8)
        break
    plan = plan_shuffle(source, f"{out}/{name}", layers=[6, 11], seed=seeds[rank], memory_bytes=64 << 10)
    try:
        done = run_rank(plan, rank, 2, durable=False, wait=wait)
        print(json.dumps({name: {"ok": None if done is None else str(done.path)}}), flush=True)
    except Exception as err:
        print(json.dumps({name: {"error": type(err).__name__, "message": str(err)}}), flush=True)
"""


def test_through_torch_distributed_the_ranks_agree_and_wait_in_the_process_group(source: Path, tmp_path: Path) -> None:
    """Two processes in one gloo process group on the CPU, several shuffles in turn: the same
    arguments give the one-process bytes, every rank returning the output and nothing left
    beside it; other seeds are refused on both ranks at once; a rank that fails stops the
    other at the same step; a rank that never comes to the shuffle is named after the wait."""
    import json

    pytest.importorskip("torch.distributed")
    expected = one_process(source, tmp_path / "one")
    out = tmp_path / "torch"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                textwrap.dedent(_TORCH_RANKS),
                str(r),
                str(tmp_path / "store"),
                str(source),
                str(out),
            ],
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    found = [{k: v for line in o.decode().splitlines() for k, v in json.loads(line).items()} for o, _ in outputs]
    assert set(found[0]) == {"same", "other seeds", "rank 1 fails", "rank 1 absent"}, outputs[0][1].decode()[-2000:]
    same = out / "same"
    assert found[0]["same"] == found[1]["same"] == {"ok": str(same / expected.name)}
    assert tree_bytes(same / expected.name) == tree_bytes(expected)
    only_the_output(same, expected.name)

    other = [f["other seeds"] for f in found]
    assert [r.get("error") for r in other] == ["ShuffleError"] * 2, other
    assert "rank 1: seed: 7 here, 8 there" in other[0]["message"]
    assert "rank 0: seed: 8 here, 7 there" in other[1]["message"]
    assert not (out / "other seeds").exists() or not any((out / "other seeds").iterdir())

    failed = [f["rank 1 fails"] for f in found]
    assert failed[1] == {"error": "RuntimeError", "message": "disk on fire"}
    assert failed[0]["error"] == "ShuffleError"
    assert "stopping at scatter, another rank failed: rank 1: RuntimeError: disk on fire" in failed[0]["message"]

    absent = found[0]["rank 1 absent"]
    assert absent["error"] == "ShuffleError" and "did not all start the shuffle within 3 s" in absent["message"]


@pytest.mark.slow
def test_the_command_line_under_torchrun_meets_through_a_gloo_group(source: Path, tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed")
    expected = one_process(source, tmp_path / "one")
    out = tmp_path / "torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "saev_shards", *args(source, out)]  # fmt: skip
    proc = subprocess.run(cmd, check=False, env=clean_env(), capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert proc.stdout.decode().split() == [str(out / expected.name)] * 2  # every rank returns the output
    err = proc.stderr.decode()
    assert "rank 0: scatter done: waiting for the other ranks" in err and "rank 1: scatter done" in err
    assert tree_bytes(out / expected.name) == tree_bytes(expected)
    only_the_output(out, expected.name)
