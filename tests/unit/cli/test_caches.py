"""cli.caches: ``verify``, ``stats`` and ``resolve`` on one cache, in process."""

from __future__ import annotations

from pathlib import Path

import pytest

import saev_shards as ss
from saev_shards.cli import entry

from ...support.caches import small_metadata, write_cache


def test_resolve_stats_and_verify(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    md = small_metadata(n_examples=3)
    write_cache(root, md)
    assert entry.main(["resolve", md.hash[:6], "--root", str(root)]) == 0
    assert capsys.readouterr().out == f"{root / md.hash}\n"
    assert entry.main(["stats", md.hash[:6], "--root", str(root)]) == 0
    said = capsys.readouterr()
    assert said.out == f"{root / '.stats' / f'{md.hash}.json'}\n"  # the path alone on stdout
    assert f"{md.hash[:12]}: statistics of 30 tokens over 2 layers written beside the cache" in said.err
    assert ss.open(root / md.hash).stats is not None
    assert entry.main(["verify", md.hash[:6], "--root", str(root)]) == 0
    assert capsys.readouterr().out.startswith(f"ok {root / md.hash}\n")
    shard = root / md.hash / "acts000000.bin"
    shard.chmod(0o644)
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    assert entry.main(["verify", md.hash[:6], "--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"saev-shards: error: {shard}: xxh3_128 expected ") and "block 0 (bytes 0-479) differs" in err
