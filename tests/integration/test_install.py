"""A newcomer's way in: `make dist` builds the sdist and the wheel; the wheel, installed into a
fresh virtual environment that has never seen this checkout, reads and writes caches without
torch, its console script works, and with the ``[torch]`` extra a loader runs.

pip finds torch where it finds it for every install on this machine (its configured wheel
folder holds the CPU wheel), so the ``[torch]`` journey costs an unzip, not a download.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

WRITE_AND_READ = """
import sys
import numpy as np
import saev_shards as ss

assert "site-packages" in ss.__file__, ss.__file__  # the wheel, not the checkout
md = ss.Metadata(family="clip", ckpt="ViT-S-16/synthetic", layers=(6, 11), patches_per_ex=4, cls_token=True,
                 d_model=8, n_examples=10, patches_per_shard=40, data={"name": "journey"}, dataset="journey")
acts = np.arange(10 * 2 * 5 * 8, dtype=np.float32).reshape(10, 2, 5, 8) / 100
with ss.ShardWriter("shards", md, stats=True) as w:
    w.write(acts)
shards = ss.open(f"shards/{md.hash}")
np.testing.assert_array_equal(shards[:], acts.astype(np.float16))
assert shards.verify() > 0 and shards.stats is not None
assert "torch" not in sys.modules
print(shards.path)
"""

LOADER_WITHOUT_TORCH = """
import sys
import saev_shards as ss
from saev_shards.loaders import ShuffledLoader
try:
    ShuffledLoader(sys.argv[1], batch_size=4, layers=11)
except ss.MissingDependencyError as err:
    print(err)
"""

LOADER = """
import sys
import numpy as np
import saev_shards as ss
from saev_shards.loaders import ShuffledLoader

shards = ss.open(sys.argv[1])
seen = 0
for batch in ShuffledLoader(shards, batch_size=4, layers=11, seed=0):
    expected = shards[batch.examples.numpy(), 1, batch.tokens.numpy()]
    np.testing.assert_array_equal(batch.acts.numpy(), expected)
    seen += len(batch)
assert seen == 10 * 4, seen  # every content token of layer 11, once
print("loader ok", seen)
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel `make dist` builds (the sdist beside it)."""
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        ["make", "-s", "dist", f"DIST={out}"], cwd=REPO, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in out.iterdir())
    return wheels[0]


def fresh_venv(where: Path, requirement: str) -> Path:
    """A new virtual environment (no site packages of ours) with ``requirement`` installed by pip."""
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", requirement],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return python


def run(python: Path, code: str, *args: str, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SAEV_", "PYTHON"))}
    proc = subprocess.run(
        [str(python), "-c", textwrap.dedent(code), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_the_wheel_without_torch_writes_reads_and_says_how_to_get_the_loaders(wheel: Path, tmp_path: Path) -> None:
    python = fresh_venv(tmp_path, str(wheel))
    work = tmp_path / "work"
    work.mkdir()
    path = run(python, WRITE_AND_READ, cwd=work).strip()
    info = subprocess.run(
        [str(python.parent / "saev-shards"), "info", path], capture_output=True, text=True, timeout=120, check=False
    )
    assert info.returncode == 0 and "(10, 2, 5, 8)" in info.stdout, info.stdout + info.stderr
    message = run(python, LOADER_WITHOUT_TORCH, path, cwd=work).strip()
    # Installed from a wheel, not an index: the hint lists the extra's exact requirements.
    assert message.endswith("install it with: pip install torch==2.13.0 (the [torch] extra of saev-shards)"), message


@pytest.mark.slow
def test_the_wheel_with_the_torch_extra_runs_a_loader(wheel: Path, tmp_path: Path) -> None:
    python = fresh_venv(tmp_path, f"{wheel}[torch]")
    work = tmp_path / "work"
    work.mkdir()
    path = run(python, WRITE_AND_READ, cwd=work).strip()
    assert run(python, LOADER, path, cwd=work).strip() == "loader ok 40"
