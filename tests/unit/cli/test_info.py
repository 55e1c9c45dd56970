"""cli.info: ``saev-shards info`` shows one cache, as lines for people or as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import saev_shards as ss
from saev_shards import store
from saev_shards.cli import entry

from ...support.caches import small_metadata, write_cache


def test_info_shows_the_cache_as_text_and_as_json(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    md = small_metadata(n_examples=3)
    write_cache(root, md)
    assert entry.main(["info", md.hash[:6], "--root", str(root)]) == 0
    rows = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert rows["cache"] == md.hash and rows["protocol"] == "3.1" and rows["model"] == "clip test/ckpt"
    assert rows["shards"] == "1 x 5 examples (last: 3)" and rows["stats"] == "-"
    assert entry.main(["info", md.hash, "--root", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == store.summary(ss.open(root / md.hash))
