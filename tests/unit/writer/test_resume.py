"""writer.resume: a writer resumes what an earlier run sealed in staging (byte-identical),
rewrites what is damaged, and starts over where staging does not fit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import saev_shards as ss
from saev_shards import fileio
from saev_shards.protocol.staging import staging_dir

from ...support.caches import float_input, labels_for, logical_tensor, small_metadata, tree_bytes, write_cache


def test_resume_after_abort_is_byte_identical(tmp_path: Path) -> None:
    md = small_metadata()
    expected_root = tmp_path / "clean"
    logical = write_cache(expected_root, md, labels=True, stats=True)
    source, labels = float_input(md, logical), labels_for(md)
    root = tmp_path / "resumed"
    w = ss.ShardWriter(root, md, labels=True, stats=True, durable=False)
    w.write(source[:13], labels=labels[:13])  # shards 0 and 1 complete, shard 2 partial
    w.abort()
    w = ss.ShardWriter(root, md, labels=True, stats=True, resume=True, durable=False)
    assert w.next_example == 10
    w.write(source[10:], labels=labels[10:])
    w.close()
    assert tree_bytes(root / md.hash) == tree_bytes(expected_root / md.hash)


def test_resume_rewrites_a_corrupted_shard(tmp_path: Path) -> None:
    """Resuming keeps the shards whose bytes match their records, rewrites the first one that
    does not and everything after it, and publishes exactly the cache of an uninterrupted run."""
    md = small_metadata()
    logical = logical_tensor(md)
    clean = tmp_path / "clean"
    write_cache(clean, md)
    root = tmp_path / "resumed"
    w = ss.ShardWriter(root, md, durable=False)
    w.write(logical[:15])  # shards 0, 1 and 2 complete
    w.abort()
    staging = staging_dir(root, md)
    kept = (staging / "acts000000.bin").stat().st_ino
    shard1 = staging / "acts000001.bin"
    data = bytearray(shard1.read_bytes())
    data[7] ^= 0xFF
    shard1.write_bytes(bytes(data))
    w = ss.ShardWriter(root, md, resume=True, durable=False)
    assert w.next_example == 5  # shard 1's checksum no longer matches its record: resume from it
    w.write(logical[5:])
    w.close()
    published = root / md.hash
    assert (published / "acts000000.bin").stat().st_ino == kept  # the intact shard was not rewritten
    assert tree_bytes(published) == tree_bytes(clean / md.hash)  # the corrupted byte is gone
    shards = ss.open(published)
    shards.verify()
    np.testing.assert_array_equal(shards[:], logical)


def test_fresh_start_discards_stale_staging(root: Path) -> None:
    md = small_metadata()
    logical = logical_tensor(md)
    w = ss.ShardWriter(root, md, durable=False)
    w.write(logical[:15])
    w.abort()
    w = ss.ShardWriter(root, md, durable=False)
    assert w.next_example == 0
    w.write(logical)
    w.close()
    np.testing.assert_array_equal(ss.open(root / md.hash)[:], logical)


KILL_SCRIPT = textwrap.dedent(
    """
    import sys, numpy as np
    sys.path.insert(0, {repo!r})
    import saev_shards as ss
    from tests.support.caches import small_metadata, logical_tensor
    md = small_metadata(n_examples=4000, d_model=64, patches_per_shard=1000)
    logical = logical_tensor(md)
    w = ss.ShardWriter({root!r}, md, resume={resume})
    print(w.next_example, flush=True)
    for a in range(w.next_example, md.n_examples, 50):
        w.write(logical[a:a + 50])
        if {pause}:
            import time; time.sleep(0.01)
    w.close()
    print("done", flush=True)
    """
)


def run_writer(root: Path, resume: bool, pause: bool) -> subprocess.Popen[str]:
    repo = str(Path(__file__).resolve().parents[3])
    code = KILL_SCRIPT.format(repo=repo, root=str(root), resume=resume, pause=pause)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_sigkill_publishes_nothing_and_resume_is_byte_identical(tmp_path: Path) -> None:
    md = small_metadata(n_examples=4000, d_model=64, patches_per_shard=1000)
    root = tmp_path / "killed"
    proc = run_writer(root, resume=False, pause=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "0"
    staging = staging_dir(root, md)
    deadline = time.monotonic() + 60
    while not any(staging.glob("part*.json")) and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (root / md.hash).exists()
    with pytest.raises(ss.CacheNotFoundError):
        ss.open(root / md.hash)
    sealed = len(list(staging.glob("part*.json")))
    assert sealed >= 1
    proc = run_writer(root, resume=True, pause=False)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    first, last = out.split()
    assert int(first) >= sealed * md.examples_per_shard > 0
    assert last == "done"
    clean = tmp_path / "clean"
    write_cache(clean, md, batches=[50], durable=True)
    assert tree_bytes(root / md.hash) == tree_bytes(clean / md.hash)


class _Stop(Exception):
    """Raised by a test hook to stop a writer at a named point (a crash without the kill)."""


def _stop_at(monkeypatch: pytest.MonkeyPatch, point: str, then: Any = None) -> None:
    def hook(name: str, index: int) -> None:
        if name == point:
            if then is not None:
                then()
            raise _Stop(point)

    monkeypatch.setattr(fileio, "fault_hook", hook)


def test_resume_of_a_finalized_staging_with_other_streams_starts_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finalize stopped after freezing the files (shards.json written, part records gone);
    a resumed writer that declares other streams (no labels) restarts cleanly."""
    md = small_metadata()
    root = tmp_path / "root"
    _stop_at(monkeypatch, "publish-frozen")
    with pytest.raises(_Stop):
        write_cache(root, md, labels=True)
    monkeypatch.setattr(fileio, "fault_hook", None)
    staging = staging_dir(root, md)
    assert (staging / "shards.json").exists() and not list(staging.glob("part*"))
    w = ss.ShardWriter(root, md, resume=True, durable=False)
    assert w.next_example == 0  # the finalized cache had labels: nothing reusable
    w.write(logical_tensor(md))
    w.close()
    write_cache(tmp_path / "clean", md)
    assert tree_bytes(root / md.hash) == tree_bytes(tmp_path / "clean" / md.hash)
    assert sorted(os.listdir(root)) == [md.hash]


@pytest.mark.parametrize("protocol", ["3.0", "2.1"])
def test_resume_of_a_finalized_staging_publishes_it_without_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, protocol: str
) -> None:
    """Also for 2.1, whose shards.json has no sizes (checksums.json, written before it, has)."""
    legacy = protocol == "2.1"
    md = small_metadata(protocol=protocol, dtype="float32", data="x") if legacy else small_metadata()
    root = tmp_path / "root"
    _stop_at(monkeypatch, "staging-cleaned")
    with pytest.raises(_Stop):
        write_cache(root, md, labels=True, stats=not legacy)
    monkeypatch.setattr(fileio, "fault_hook", None)
    w = ss.ShardWriter(root, md, resume=True, labels=True, stats=not legacy, durable=False)
    assert w.next_example == md.n_examples
    assert w.close() == root / md.hash
    write_cache(tmp_path / "clean", md, labels=True, stats=not legacy)
    assert tree_bytes(root / md.hash) == tree_bytes(tmp_path / "clean" / md.hash)
