"""Memmap lazily, per process: pickles carry no data or handles; fork and spawn reopen."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

import saev_shards as ss

from ..support.caches import small_metadata, write_cache

REPO = str(Path(__file__).resolve().parents[2])


def test_pickle_is_small_and_handle_free(root: Path) -> None:
    md = small_metadata(n_examples=2000, d_model=64)
    logical = write_cache(root, md, batches=[500])
    shards = ss.open(root / md.hash)
    _ = shards[:]  # open every memmap and some descriptors
    shards.read_example(3, 0)
    blob = pickle.dumps(shards)
    assert len(blob) < 64 * 1024 < md.nbytes
    assert b"memmap" not in blob
    clone = pickle.loads(blob)
    assert clone._maps == {}
    assert clone._fds == {}
    np.testing.assert_array_equal(clone[1234], logical[1234])


def _open_files(folder: Path) -> dict[int, str]:
    """This process's descriptors on files in ``folder`` (memory maps hold one each)."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        if os.path.dirname(target) == str(folder):
            out[int(fd)] = os.path.basename(target)
    return out


def _child_reads(shards: ss.Shards, queue: Any) -> None:
    before = _open_files(shards.path)
    row = shards.shard(0)[3].tolist()  # through a memory map of shard 0
    total = shards.read_example(1999, 1).sum().item()  # through a pread descriptor of the last shard
    queue.put((os.getpid(), before, _open_files(shards.path), row, total))


def _run(context: str, shards: ss.Shards) -> tuple[int, dict[int, str], dict[int, str], Any, float]:
    ctx = mp.get_context(context)
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_reads, args=(shards, queue))  # type: ignore[attr-defined]
    proc.start()
    result = queue.get(timeout=60)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    return result  # type: ignore[no-any-return]


def test_fork_and_spawn_open_their_own(root: Path) -> None:
    """A forked child inherits the parent's descriptors and maps, yet reads through its own:
    it notices the new pid and opens fresh ones before touching a handle. Spawn starts bare."""
    md = small_metadata(n_examples=2000, d_model=64)
    logical = write_cache(root, md, batches=[500])
    shards = ss.open(root / md.hash)
    names = [s.name for s in shards.manifest.shards]
    # The parent maps every shard and holds the arrays (a forked child keeps this frame, so
    # the inherited maps and their descriptors stay open there: no descriptor number is reused).
    held = [shards.shard(k) for k in range(md.n_shards)]
    shards.read_example(1999, 1)  # and a pread descriptor of the last shard
    parents = _open_files(shards.path)
    assert sorted(set(parents.values())) == names
    for context in ("fork", "spawn"):
        pid, before, after, row, total = _run(context, shards)
        assert pid != os.getpid()
        assert row == logical[3].tolist()
        assert total == float(logical[1999, 1].sum())
        if context == "fork":
            assert before == parents  # the parent's handles came along with the fork ...
            assert after.items() >= before.items()  # ... and are still open there
        else:
            assert before == {}
        # Either way the child read through descriptors it opened itself: a map of shard 0
        # and a pread descriptor of the last shard (reusing the parent's would open none).
        opened = {fd: name for fd, name in after.items() if fd not in before}
        assert {names[0], names[-1]} <= set(opened.values()), (context, opened)
        assert set(opened.values()) <= set(names)
    assert len(held) == md.n_shards


def test_core_imports_without_torch() -> None:
    """Opening and reading a cache needs numpy, orjson and xxhash only."""
    code = textwrap.dedent(
        f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked in this test")
        sys.meta_path.insert(0, Block())
        sys.path.insert(0, {REPO!r})
        import tempfile, pathlib
        import saev_shards as ss
        from tests.support.caches import small_metadata, write_cache
        root = pathlib.Path(tempfile.mkdtemp())
        md = small_metadata()
        logical = write_cache(root, md, stats=True, labels=True)
        shards = ss.open(root / md.hash)
        assert (shards[:] == logical).all()
        shards.verify()
        assert "torch" not in sys.modules
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_threads_open_each_shard_once(root: Path) -> None:
    """Many threads reading at once: one descriptor per shard, no leak."""
    import threading

    md = small_metadata(n_examples=200)
    logical = write_cache(root, md, batches=[50])
    shards = ss.open(root / md.hash)
    before = len(os.listdir("/proc/self/fd"))
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            barrier.wait()
            for ex in range(md.n_examples):
                np.testing.assert_array_equal(shards.read_example(ex, 1), logical[ex, 1])
                shards.shard(ex // md.examples_per_shard)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(shards._fds) == md.n_shards
    raced = len(os.listdir("/proc/self/fd")) - before
    # The same reads from one thread open exactly as many descriptors (a pread one and the
    # one Python's mmap duplicates, per shard).
    alone = ss.open(root / md.hash)
    before = len(os.listdir("/proc/self/fd"))
    for ex in range(md.n_examples):
        alone.read_example(ex, 1)
        alone.shard(ex // md.examples_per_shard)
    assert raced == len(os.listdir("/proc/self/fd")) - before == 2 * md.n_shards
    shards.close()
    alone.close()
