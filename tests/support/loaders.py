"""Checks shared by the loader tests: a cache in a temporary folder, batches against the logical tensor."""

from __future__ import annotations

import gc
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

import saev_shards as ss
from saev_shards.loaders import Batch

from .caches import write_cache


@contextmanager
def cache(md: ss.Metadata, **kwargs: Any) -> Iterator[tuple[ss.Shards, np.ndarray[Any, Any]]]:
    """A cache in a temporary folder (hypothesis cannot use function-scoped fixtures)."""
    with tempfile.TemporaryDirectory() as tmp:
        logical = write_cache(Path(tmp), md, **kwargs)
        shards = ss.open(Path(tmp) / md.hash)
        try:
            yield shards, logical
        finally:
            shards.close()


def check_batch(batch: Batch, md: ss.Metadata, logical: np.ndarray[Any, Any]) -> list[tuple[int, int, int]]:
    """Values and labels of ``batch`` equal the logical tensor's; returns its (example, layer, token)."""
    ex, tok, lay = batch.examples.numpy(), batch.tokens.numpy(), batch.layers.numpy()
    assert batch.examples.dtype == batch.tokens.dtype == batch.layers.dtype == torch.int64
    positions = np.array([md.layers.index(int(v)) for v in lay], dtype=np.int64)
    acts = batch.acts
    if md.dtype == "bfloat16":
        assert acts.dtype == torch.bfloat16
        got = acts.view(torch.int16).numpy().view(np.uint16)
    else:
        got = acts.numpy()
    np.testing.assert_array_equal(got, logical[ex, positions, tok].reshape(len(ex), md.d_model))
    return list(zip(ex.tolist(), lay.tolist(), tok.tolist(), strict=True))


def live_loader_threads() -> list[threading.Thread]:
    """Threads of loaders (``saev-loader-*``); the writer's long-lived I/O pool is not one of them."""
    return [t for t in threading.enumerate() if t.name.startswith("saev-loader-")]


def collected_until(done: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Collect garbage, then wait (at most ``timeout`` seconds) until ``done()``: a loader
    collected by the garbage collector shuts its idle threads down without joining them
    (`pipeline.joinable`), so they end a moment after the collection, not during it."""
    gc.collect()
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def keys(batches: list[Batch]) -> list[tuple[int, ...]]:
    return [tuple(b.examples.tolist()) + tuple(b.tokens.tolist()) + tuple(b.layers.tolist()) for b in batches]
