"""cli.ls: ``saev-shards ls`` lists each root's caches, as a table or as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from saev_shards.cli import entry

from ...support.caches import small_metadata, write_cache


def test_ls_lists_each_cache_of_the_root(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    md = small_metadata(n_examples=3)
    write_cache(root, md)
    assert entry.main(["ls", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{root} (argument): 1 cache, ")
    assert lines[1].split() == ["HASH", "MODEL", "FORMAT", "DTYPE", "SHAPE", "SHARDS", "SIZE", "STATUS"]
    assert lines[2].split()[:4] == [md.hash[:12], "clip:test/ckpt", "3.1", "float16"] and lines[2].endswith("ok")
    assert entry.main(["ls", str(root), "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["root"] == str(root) and listed["exists"] and listed["unpublished"] == []
    (cache,) = listed["caches"]
    assert (cache["hash"], cache["ok"], cache["n_shards"], cache["shape"]) == (md.hash, True, 1, [3, 2, 5, 8])
