"""Finalizers (``__del__``) raise nothing at interpreter shutdown.

When the interpreter exits, module globals are set to None in some order, and an object
still alive (a loader mid-epoch kept in a list, an unclosed writer) is finalized after
that: a ``with contextlib.suppress(...)`` in its ``__del__`` then fails on ``contextlib``
itself and Python prints "Exception ignored in ... __del__" on the user's terminal. The
test sets those globals to None, as teardown does, and calls each finalizer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import saev_shards as ss
from saev_shards.loaders import host_run, token_loader
from saev_shards.reader import handles
from saev_shards.storage import local
from saev_shards.writer import shard_writer

from ..support.caches import small_metadata

TORN_DOWN = (handles, local, host_run, token_loader, shard_writer)


def test_finalizers_raise_nothing_once_module_globals_are_gone(
    make_cache: Callable[..., tuple[ss.Shards, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards, _ = make_cache()
    loader = ss.loaders.ShuffledLoader(shards, 8, seed=0, mix_layers=True)
    batches: Any = iter(loader)  # a generator: closed at the end
    next(batches)  # mid-epoch: its run's threads are alive
    (run,) = loader._runs
    lock = shards._folder_lock
    writer = ss.ShardWriter(tmp_path / "out", small_metadata(), durable=False)
    objects: list[Any] = [run, loader, lock, shards, writer]
    assert all(o is not None for o in objects)
    for module in TORN_DOWN:
        for name in ("contextlib", "os"):
            monkeypatch.setattr(module, name, None, raising=False)
    try:
        for obj in objects:
            type(obj).__del__(obj)  # raises before the fix: 'NoneType' object has no attribute 'suppress'
    finally:
        monkeypatch.undo()
        batches.close()
        loader.close()
        writer.abort()
        shards.close()
    assert run.closed
