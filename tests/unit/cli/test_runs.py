"""cli.runs: ``saev-shards run init`` lays out a run folder and ``doctor`` checks it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from saev_shards.cli import entry

from ...support.caches import small_metadata, write_cache


def test_run_init_then_doctor(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    md = small_metadata(n_examples=3)
    write_cache(root, md)
    runs = str(tmp_path / "runs")
    assert (
        entry.main(["run", "init", "--train", md.hash[:6], "--id", "r1", "--runs-root", runs, "--root", str(root)]) == 0
    )
    out = capsys.readouterr().out
    assert (
        out.startswith(f"created run {tmp_path / 'runs' / 'r1'}\n")
        and f"links/train-shards   -> {root / md.hash}" in out
    )
    assert entry.main(["doctor", "--run", "r1", "--runs-root", runs, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["errors"], report["warnings"]) == (0, 0)
    assert report["findings"][0] == {
        "level": "ok",
        "subject": "links/train-shards",
        "message": f"-> {root / md.hash} (3 examples, float16, layers [6, 11])",
    }
    assert entry.main(["run", "init", "--train", md.hash, "--id", "r1", "--runs-root", runs, "--root", str(root)]) != 0
    assert "r1" in capsys.readouterr().err
