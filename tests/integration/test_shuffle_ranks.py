"""The shuffle across processes: ``--rank R --world-size W`` over one work folder, started as
real separate processes (``python -m saev_shards shuffle``), gives the bytes of a one-process
shuffle, and a rank killed mid-scatter resumes when started again."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import saev_shards as ss
from saev_shards.cli import main

from ..support.caches import small_metadata, tree_bytes, write_cache

#: A budget that cuts the small source into several chunks, buckets and output shards.
MEMORY = "64K"


@pytest.fixture
def source(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    root.mkdir()
    md = small_metadata(n_examples=200, d_model=16)
    write_cache(root, md, labels=True, lengths=np.arange(200) % 5 + 1)
    return root / md.hash


def args(source: Path, out: Path, *extra: str) -> list[str]:
    return ["shuffle", str(source), "--layers", "6,11", "--seed", "7", "--memory", MEMORY, "--to", str(out), *extra]


_RANK = """
import os, signal, sys
from saev_shards import fileio
from saev_shards.cli import main
kill_after = int(os.environ.get("KILL_AFTER_RUNS", "0"))
sealed = []
def hook(name, index):
    if name == "rank-run" and kill_after:
        sealed.append(index)
        if len(sealed) == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
fileio.fault_hook = hook
sys.exit(main(sys.argv[1:]))
"""


def start_rank(argv: list[str], rank: int, world: int, kill_after: int = 0) -> subprocess.Popen[bytes]:
    env = {**os.environ, "KILL_AFTER_RUNS": str(kill_after)}
    for name in ("RANK", "WORLD_SIZE", "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT"):
        env.pop(name, None)
    cmd = [sys.executable, "-c", textwrap.dedent(_RANK), *argv, "--rank", str(rank), "--world-size", str(world)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


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
    assert sorted(p.name for p in out.iterdir()) == [expected.name]  # the scratch folder is gone
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


def test_ranks_must_share_one_plan(source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mixed"
    first = start_rank(args(source, out), 1, 2, kill_after=1)  # seals one run, then dies
    first.communicate(timeout=300)
    other = ["shuffle", str(source), "--layers", "6,11", "--seed", "7", "--memory", "1M", "--to", str(out)]
    assert main([*other, "--rank", "0", "--world-size", "2"]) == 1
    assert "need one plan" in capsys.readouterr().err
