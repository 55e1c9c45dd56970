"""cli.convert: ``saev-shards convert`` turns a source into a cache in the shards root."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import saev_shards as ss
from saev_shards.cli import entry


def test_a_npy_source_becomes_a_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    acts = np.random.default_rng(0).standard_normal((4, 2, 3, 8)).astype(np.float32)
    np.save(tmp_path / "a.npy", acts)
    root = tmp_path / "shards"
    code = entry.main(
        ["convert", str(tmp_path / "a.npy"), "--root", str(root), "--dtype", "float32", "--layers", "3,5"]
    )
    assert code == 0
    path = Path(capsys.readouterr().out.splitlines()[-1])
    shards = ss.open(path)
    assert path.parent == root and shards.metadata.layers == (3, 5)
    np.testing.assert_array_equal(shards[:], acts)
    assert entry.main(["convert", str(tmp_path / "missing.npy"), "--root", str(root)]) != 0
    assert "missing.npy" in capsys.readouterr().err
