"""writer.finalize: every shard's part record checked before anything is published, and what
is renamed checked again at the rename."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import saev_shards as ss
from saev_shards import fileio
from saev_shards.protocol.staging import staging_dir

from ...support.caches import small_metadata, write_cache


def test_finalize_reports_missing_shards(root: Path) -> None:
    md = small_metadata()
    w = ss.ShardWriter(root, md, rank=0, world_size=2, durable=False)
    w.write(np.zeros((w.stop - w.start, 2, 5, 8), np.float16))
    w.close()
    with pytest.raises(ss.WriterError, match=r"3 shards incomplete:\n  shard 2: not written \(no part000002.json\)"):
        ss.finalize(root, md)


def test_publish_rechecks_what_it_renames(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stray file, or a missing shard, in staging at the last moment: nothing is published,
    and every difference is named."""
    md = small_metadata()
    staging = staging_dir(root, md)

    def tamper() -> None:
        (staging / "notes.txt").write_text("stray")
        (staging / "acts000002.bin").unlink()

    hooked = False

    def hook(name: str, index: int) -> None:
        nonlocal hooked
        if name == "staging-cleaned" and not hooked:
            hooked = True
            tamper()

    monkeypatch.setattr(fileio, "fault_hook", hook)
    with pytest.raises(ss.WriterError, match="refusing to publish") as info:
        write_cache(root, md)
    assert f"{staging / 'acts000002.bin'}: missing" in str(info.value)
    assert f"{staging / 'notes.txt'}: not expected here" in str(info.value)
    assert not (root / md.hash).exists()
    monkeypatch.setattr(fileio, "fault_hook", None)
    (staging / "notes.txt").unlink()
    with pytest.raises(ss.WriterError, match=r"acts000002\.bin: missing"):
        ss.finalize(root, md)  # the manifest lists it: refused again, never published without it
    assert not (root / md.hash).exists()
