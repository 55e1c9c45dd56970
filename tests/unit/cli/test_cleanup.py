"""cli.cleanup: ``saev-shards rm`` refuses a cache a run links to unless forced, and ``clean``
lists what it would remove."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import saev_shards as ss
from saev_shards import store
from saev_shards.cli import entry

from ...support.caches import small_metadata, write_cache


def test_rm_refuses_a_linked_cache_unless_forced(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    md = small_metadata(n_examples=3)
    write_cache(root, md)
    runs = tmp_path / "runs"
    store.create_run(md.hash, run_id="r1", runs_root=runs, roots=root)
    args = ["rm", md.hash[:6], "--root", str(root), "--yes", "--runs-root", str(runs)]
    assert entry.main(args) == 1
    assert "refusing to remove 1 cache that runs link to" in capsys.readouterr().err
    assert (root / md.hash).is_dir()
    assert entry.main([*args, "--force"]) == 0
    assert not (root / md.hash).exists()


def test_clean_lists_a_stale_staging_folder_and_removes_it(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert entry.main(["clean", str(root), "--dry-run"]) == 0
    assert "nothing to clean" in capsys.readouterr().out
    md = small_metadata()
    w = ss.ShardWriter(root, md, durable=False)
    w.write(np.zeros((2, *md.shape[1:]), np.float16))  # nothing sealed: stale once aborted
    w.abort()
    (staging,) = store.list_unpublished(root)
    assert entry.main(["clean", str(root), "--dry-run"]) == 0
    assert staging.name[:20] in capsys.readouterr().out and staging.exists()
    assert entry.main(["clean", str(root), "--yes"]) == 0
    capsys.readouterr()
    assert not staging.exists()
