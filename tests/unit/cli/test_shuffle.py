"""cli.shuffle: ``saev-shards shuffle`` prints its plan, then publishes the shuffled cache and
prints its path last."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import saev_shards as ss
from saev_shards.cli import entry

from ...support.caches import small_metadata, write_cache


def test_dry_run_prints_the_plan_and_the_run_publishes(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    md = small_metadata(n_examples=3)
    logical = write_cache(root, md)
    args = ["shuffle", md.hash[:6], "--root", str(root), "--layers", "11"]
    assert entry.main([*args, "--dry-run"]) == 0
    plan = capsys.readouterr().out.splitlines()
    assert plan[0] == f"source    {root / md.hash} (3 examples)"
    assert plan[1] == "select    layers [11], content tokens"
    assert [p.name for p in root.iterdir()] == [md.hash]  # nothing written
    assert entry.main(args) == 0
    out = Path(capsys.readouterr().out.splitlines()[-1])
    shuffled = ss.open(out)
    assert shuffled.metadata.layers == (11,) and shuffled.n_examples == 12  # 3 examples x 4 content tokens
    got = np.sort(shuffled.read_range(0, 12, dtype="float32").reshape(12, -1), axis=0)
    want = np.sort(logical[:, 1, 1:].reshape(12, -1).astype(np.float32), axis=0)
    np.testing.assert_array_equal(got, want)
