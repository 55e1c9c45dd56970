"""Real distributed runs: torchrun (gloo, CPU) for a split dump and a DDP training loop; a SLURM array.

Every process here is a real one started the way users start them; nothing is monkeypatched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from saev_shards import dump as dump_mod

from ..support.caches import expected_vectors, small_metadata, tree_bytes, write_cache

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"
WORLD_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_ARRAY_TASK_ID",
              "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN")  # fmt: skip

pytestmark = pytest.mark.skipif(not TORCHRUN.exists(), reason=f"torchrun not found beside {sys.executable}")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in WORLD_VARS}
    env["PYTHONPATH"] = str(REPO)
    env["OMP_NUM_THREADS"] = "1"  # two ranks on a small machine: no oversubscription
    env.update(extra)
    return env


def torchrun(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", *args]
    env = clean_env()
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def tiny_dump_config(tmp_path: Path, n: int) -> dict[str, Any]:
    """A dump of ``n`` short texts through the tiny text model of tests/support/models.py (no download)."""
    data = tmp_path / "data.jsonl"
    rng = np.random.default_rng(1)
    lines = []
    for i in range(n):
        text = "".join(chr(ord("a") + int(c)) for c in rng.integers(0, 26, int(rng.integers(1, 20))))
        lines.append(json.dumps({"text": text, "uid": f"ex-{i:03d}"}) + "\n")
    data.write_text("".join(lines))
    return {
        "root": str(tmp_path / "shards"),
        "layers": [1, 3],
        "T": 10,
        "dtype": "float16",
        "batch_size": 4,
        "patches_per_shard": 5 * 10 * 2,  # 5 examples per shard
        "device": "cpu",
        "model": {
            "factory": "tests.support.models:tiny_text_model",
            "kwargs": {"d_model": 16, "n_blocks": 4, "max_len": 10},
            "cls_token": True,
        },
        "dataset": {"kind": "jsonl", "path": str(data), "id_field": "uid"},
    }


def single_process_dump(cfg_file: Path, cfg: dict[str, Any], tmp_path: Path) -> Path:
    """The same dump by one process, started with the same environment (thread counts change float bits)."""
    single = tmp_path / "single"
    cmd = [sys.executable, "-m", "saev_shards.dump", str(cfg_file), "--no-progress", "--root", str(single)]
    result = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, check=False, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return single / dump_mod.plan(cfg, weights=False).metadata.hash


@pytest.mark.slow
def test_torchrun_dump_is_one_cache(tmp_path: Path) -> None:
    """A dump under torchrun splits by RANK/WORLD_SIZE; the last rank to finish publishes one cache."""
    cfg = tiny_dump_config(tmp_path, n=23)
    cfg_file = tmp_path / "dump.json"
    cfg_file.write_text(json.dumps(cfg))
    result = torchrun("-m", "saev_shards.dump", str(cfg_file), "--no-progress")
    out = result.stdout + result.stderr
    assert "rank 0 of 2: dumping" in out and "rank 1 of 2: dumping" in out, out
    md = dump_mod.plan(cfg, weights=False).metadata
    published = Path(cfg["root"]) / md.hash
    assert out.count(f"published {published}") == 1, out
    assert tree_bytes(published) == tree_bytes(single_process_dump(cfg_file, cfg, tmp_path))


@pytest.mark.slow
def test_slurm_array_dump_is_one_cache(tmp_path: Path) -> None:
    """Two array tasks (SLURM_ARRAY_TASK_ID 4 and 5 of an array starting at 4) write one cache."""
    cfg = tiny_dump_config(tmp_path, n=17)
    cfg_file = tmp_path / "dump.json"
    cfg_file.write_text(json.dumps(cfg))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "saev_shards.dump", str(cfg_file), "--no-progress"],
            cwd=REPO,
            env=clean_env(SLURM_ARRAY_TASK_ID=str(task), SLURM_ARRAY_TASK_COUNT="2", SLURM_ARRAY_TASK_MIN="4"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for task in (4, 5)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for rank, out in enumerate(outs):
        assert f"rank {rank} of 2: dumping" in out, out
    md = dump_mod.plan(cfg, weights=False).metadata
    assert tree_bytes(Path(cfg["root"]) / md.hash) == tree_bytes(single_process_dump(cfg_file, cfg, tmp_path))


def read_ranks(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def ddp_epoch(tmp_path: Path, *args: str) -> tuple[Any, str, str, list[dict[str, Any]]]:
    md = small_metadata(n_examples=40)
    write_cache(tmp_path / "shards", md)
    cache_path = str(tmp_path / "shards" / md.hash)
    script = str(REPO / "tests" / "support" / "ddp_train.py")
    full = tmp_path / "full"
    full.mkdir()
    torchrun(script, cache_path, str(full), *args)
    ranks = read_ranks(full)
    assert [r["rank"] for r in ranks] == [0, 1] and {r["source"] for r in ranks} == {"torch.distributed"}
    assert ranks[0]["len"] == ranks[1]["len"] == len(ranks[0]["batches"]) == len(ranks[1]["batches"]) > 0
    assert ranks[0]["weights"] == ranks[1]["weights"]  # DDP kept the replicas in step
    seen = [tuple(v) for r in ranks for b in r["batches"] for v in b]
    assert all(len(b) == 7 for r in ranks for b in r["batches"])
    assert len(set(seen)) == len(seen)  # disjoint
    want = expected_vectors(md)
    assert set(seen) <= set(want) and len(seen) == 2 * ((len(want) // 2) // 7 * 7)  # all but the dropped tail
    return md, cache_path, script, ranks


def test_ddp_training_loop_shares(tmp_path: Path) -> None:
    """Each rank's ShuffledLoader takes its rank from the gloo group: disjoint shares, complete union,
    equal batch counts with drop_last (DDP's all-reduce would hang otherwise); a state resumes exactly."""
    _, _, _, ranks = ddp_epoch(tmp_path, "--check-resume", "3")
    for r in ranks:
        assert r["resumed"] == r["batches"]


@pytest.mark.slow
def test_ddp_training_loop_resumes_after_a_restart(tmp_path: Path) -> None:
    """Stop both ranks after 3 batches, start new processes from the saved states: the same batches."""
    _, cache_path, script, ranks = ddp_epoch(tmp_path)
    part = tmp_path / "part"
    part.mkdir()
    torchrun(script, cache_path, str(part), "--stop-after", "3")
    first = read_ranks(part)
    torchrun(script, cache_path, str(part), "--resume")
    rest = read_ranks(part)
    for r in range(2):
        assert len(first[r]["batches"]) == 3
        assert first[r]["batches"] + rest[r]["batches"] == ranks[r]["batches"]


def test_loaders_ignore_slurm_arrays(tmp_path: Path) -> None:
    """An array task is a separate job (a sweep): its loader reads the whole cache unless told otherwise."""
    md = small_metadata(n_examples=10)
    write_cache(tmp_path, md)
    code = (
        "import sys; from saev_shards.loaders import ShuffledLoader; "
        f"l = ShuffledLoader({str(tmp_path / md.hash)!r}, batch_size=4, mix_layers=True); "
        "print(l.world.rank, l.world.world_size, l.world.source, l.n_tokens)"
    )
    env = clean_env(SLURM_ARRAY_TASK_ID="1", SLURM_ARRAY_TASK_COUNT="2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["0", "1", "single", "process", str(len(expected_vectors(md)))]
