"""`saev-shards shuffle` end to end: SIGKILL and resume, peak memory against the budget, the command line."""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import saev_shards as ss
from saev_shards.protocol.staging import staging_dir
from saev_shards.shuffle import plan_shuffle, run_plan, shuffle_order

from ..support.caches import small_metadata, tree_bytes, write_cache

REPO = str(Path(__file__).resolve().parents[2])


def kill_source(root: Path) -> ss.Shards:
    """40 examples of CLS + 4 tokens: 160 content tokens in 7 output shards of 25."""
    md = small_metadata(n_examples=40, d_model=16)
    write_cache(root, md, labels=True)
    return ss.open(root / md.hash)


# 64 KiB of budget: write batches of 32 rows, so the writer runs at most a few batches behind
# the bucket being gathered and a kill after bucket 1 leaves buckets to write.
PLAN = dict(seed=1, n_buckets=8, examples_per_chunk=7, memory_bytes=64 << 10)

KILL_CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    sys.path.insert(0, {repo!r})
    from saev_shards.shuffle import plan_shuffle, run_plan
    plan = plan_shuffle({source!r}, {out!r}, **{plan!r})
    def hook(kind, index):
        if {pause}:
            time.sleep(0.05)
        if (kind, index) == {at!r}:
            os.kill(os.getpid(), signal.SIGKILL)
    run_plan(plan, durable=False, after_step=hook)
    print("done", flush=True)
    """
)


def run_child(source: ss.Shards, out: Path, at: tuple[str, int] | None, pause: bool = False) -> subprocess.Popen[str]:
    code = KILL_CHILD.format(repo=REPO, source=str(source.path), out=str(out), plan=PLAN, at=at, pause=pause)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


@pytest.mark.parametrize(
    "at",
    [("run", 2), ("scattered", 0), ("bucket", 1), ("bucket", 7)],
    ids=["in-scatter", "between-passes", "in-write", "after-last-bucket"],
)
def test_sigkill_then_rerun_is_byte_identical(tmp_path: Path, at: tuple[str, int]) -> None:
    source = kill_source(tmp_path / "src")
    out = tmp_path / "out"
    proc = run_child(source, out, at)
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    plan = plan_shuffle(source, out, **PLAN)  # type: ignore[arg-type]
    assert not plan.path.exists()  # nothing is published before the end
    resumed: list[tuple[str, int]] = []
    shuffled = run_plan(plan, durable=False, after_step=lambda kind, i: resumed.append((kind, i)))
    # The rerun resumed: sealed runs were not redone, sealed output shards were not rewritten.
    if at[0] == "run":
        assert [i for kind, i in resumed if kind == "run"] == list(range(at[1] + 1, plan.n_chunks))
    else:
        assert not any(kind == "run" for kind, _ in resumed)
    buckets = [i for kind, i in resumed if kind == "bucket"]
    if at == ("bucket", 1):
        assert buckets and min(buckets) >= 1  # bucket 0 lies in shards sealed before the kill
        assert max(buckets) == plan.n_buckets - 1
    if at == ("bucket", plan.n_buckets - 1):
        assert buckets == []  # every shard was sealed: the rerun only finalizes
    clean = run_plan(plan_shuffle(source, tmp_path / "clean", **PLAN), durable=False)  # type: ignore[arg-type]
    assert tree_bytes(shuffled.path) == tree_bytes(clean.path)
    assert not plan.work.exists() and not staging_dir(out, plan.output).exists()


@pytest.mark.slow
def test_sigkill_at_random_moments_then_rerun_is_byte_identical(tmp_path: Path) -> None:
    """Killed at arbitrary moments (mid-run file, mid-shard) over and over until it finishes."""
    source = kill_source(tmp_path / "src")
    clean = run_plan(plan_shuffle(source, tmp_path / "clean", **PLAN), durable=False)  # type: ignore[arg-type]
    rng = random.Random(0)
    for trial in range(3):
        out = tmp_path / f"out{trial}"
        kills = 0
        while True:
            proc = run_child(source, out, None, pause=True)
            time.sleep(rng.uniform(0.3, 1.5))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
            stdout, _ = proc.communicate(timeout=120)
            if "done" in stdout:
                break
            assert kills < 50
        assert tree_bytes(out / clean.path.name) == tree_bytes(clean.path)


# -- peak memory ----------------------------------------------------------------------------

# Peak RSS of the child's own address space (VmHWM). Its ru_maxrss would do only in a child of a
# small process: Linux keeps the peak of the address space a process had before execve (here the
# test runner's, hundreds of MB) in ru_maxrss.
RSS_CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {repo!r})
    from saev_shards.shuffle import plan_shuffle, run_plan
    plan = plan_shuffle({source!r}, {out!r}, memory_bytes={budget}, layers={layers!r}, dtype={dtype!r})
    if {run}:
        run_plan(plan, durable=False)
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    print(peak, plan.n_buckets, plan.n_chunks, plan.output.nbytes)
    """
)


def peak_rss(source: Path, out: Path, budget: int, run: bool, layers: object, dtype: str | None) -> list[int]:
    """``[peak RSS, buckets, chunks, output bytes]`` of a fresh process that plans (and, with ``run``, shuffles)."""
    code = RSS_CHILD.format(
        repo=REPO, source=str(source), out=str(out), budget=budget, run=run, layers=layers, dtype=dtype
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    return [int(v) for v in proc.stdout.split()]


@pytest.mark.parametrize(
    ("layers", "dtype", "budget_mib", "n_examples", "patches_per_shard"),
    [
        (None, None, 64, 3000, 5_000),
        (11, "float32", 64, 3000, 5_000),
        # Shards of 15 MB and more: the writer's own O_DIRECT buffers (48 MiB) count too.
        pytest.param(None, None, 160, 8000, 1_000_000, marks=pytest.mark.slow),
    ],
    ids=["all-layers", "one-layer-cast", "big-shards"],
)
def test_peak_memory_stays_within_the_budget(
    tmp_path: Path, layers: object, dtype: str | None, budget_mib: int, n_examples: int, patches_per_shard: int
) -> None:
    """A shuffle of several times its budget: peak RSS in a fresh process, minus the imports' baseline."""
    budget = budget_mib << 20
    md = small_metadata(n_examples=n_examples, patches_per_ex=48, d_model=384, patches_per_shard=patches_per_shard)
    root = tmp_path / "src"
    rng = np.random.default_rng(0)
    block = rng.standard_normal((100, *md.shape[1:]), dtype=np.float32).astype(np.float16)
    with ss.ShardWriter(root, md, durable=False) as w:
        for _ in range(md.n_examples // 100):
            w.write(block)
    baseline = peak_rss(root / md.hash, tmp_path / "out", budget, False, layers, dtype)[0]
    peak, n_buckets, n_chunks, out_nbytes = peak_rss(root / md.hash, tmp_path / "out", budget, True, layers, dtype)
    assert out_nbytes > 3 * budget  # several times the budget, so neither pass can hold it
    assert n_buckets > 3 and n_chunks > 3
    assert peak - baseline <= budget, f"peak {(peak - baseline) / 2**20:.1f} MiB over a {budget_mib} MiB budget"
    plan = plan_shuffle(root / md.hash, tmp_path / "out", layers=layers, dtype=dtype)
    out = ss.open(plan.path)
    assert out.n_examples == md.n_examples * md.patches_per_ex
    order = shuffle_order(out.n_examples, 0)
    np.testing.assert_array_equal(out.columns["source_example"], order // md.patches_per_ex)


# -- the command line --------------------------------------------------------------------------


@dataclass
class Result:
    code: int
    out: str
    err: str


def cli(*args: str) -> Result:
    proc = subprocess.run(
        [sys.executable, "-m", "saev_shards", *args], capture_output=True, text=True, timeout=120, check=False
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


def test_cli_shuffle(tmp_path: Path) -> None:
    root = tmp_path / "shards"
    md = small_metadata()
    write_cache(root, md, labels=True)
    ref = md.hash[:6]
    dry = cli("shuffle", ref, "--root", str(root), "--layers", "11", "--dry-run")
    assert dry.code == 0, dry.err
    assert "select    layers [11], content tokens" in dry.out
    assert "92 tokens x 1 layers x 8 float16" in dry.out
    assert sorted(p.name for p in root.iterdir()) == [md.hash]  # a dry run writes nothing

    args = ["--layers", "11", "--seed", "3", "--memory", "64M", "--no-progress"]
    first = cli("shuffle", ref, "--root", str(root), *args)
    assert first.code == 0, first.err
    path = Path(first.out.strip())
    assert path.parent == root
    assert "shuffled 92 tokens" in first.err
    shuffled = ss.open(path)
    assert shuffled.metadata.data["shuffle"]["seed"] == 3
    again = cli("shuffle", ref, "--root", str(root), "--layers", "11", "--seed", "3")
    assert (again.code, again.out) == (0, first.out)
    assert "already shuffled, nothing to do" in again.err
    info = cli("info", str(path))
    assert info.code == 0 and "source_example int64 (92,)" in info.out

    other = tmp_path / "other"
    moved = cli("shuffle", str(root / md.hash), "--to", str(other), "--layers", "6,11", "--tokens", "all")
    assert moved.code == 0, moved.err
    assert Path(moved.out.strip()).parent == other
    assert ss.open(moved.out.strip()).shape == (23 * 5, 2, 1, 8)


def test_cli_shuffle_errors(tmp_path: Path) -> None:
    root = tmp_path / "shards"
    md = small_metadata()
    write_cache(root, md)
    for args, message in [
        (["--layers", "7"], r"layers: expected values among the recorded layers \[6, 11\], found 7"),
        (["--memory", "1K"], "memory: 1,024 bytes is too small"),
        (["--memory", "lots"], "expected a size like 2G, 512M or 1073741824, found 'lots'"),
        (["--layers", "6,x"], r"argument --layers: expected comma-separated integers such as 6,11, found '6,x'"),
        (["--exclude-token-ids", "1;2"], r"--exclude-token-ids: expected comma-separated integers such as 6,11"),
    ]:
        result = cli("shuffle", str(root / md.hash), *args)
        assert result.code == 2, result.err
        assert re.search(message, result.err), result.err
        assert "Traceback" not in result.err
    missing = cli("shuffle", "beef", "--root", str(root))
    assert missing.code == 3 and "no cache matches hash prefix 'beef'" in missing.err
    assert sorted(p.name for p in root.iterdir()) == [md.hash]  # nothing written, no scratch left


def test_cli_shuffle_to_float8(tmp_path: Path) -> None:
    root = tmp_path / "shards"
    md = small_metadata()
    write_cache(root, md)
    r = cli("shuffle", md.hash[:6], "--root", str(root), "--dtype", "float8_e4m3", "--no-progress")
    assert r.code == 0, r.err
    shuffled = ss.open(r.out.strip())
    assert shuffled.dtype == "float8_e4m3" and shuffled.scales is not None
    shuffled.verify()
