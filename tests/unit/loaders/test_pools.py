"""The host pipeline: the pinned-memory path, the gather pool doing the gathers, the casts."""

from __future__ import annotations

import gc
import os
import threading
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from saev_shards import loaders
from saev_shards.loaders import host_run, outputs, pools, schedule
from saev_shards.loaders.tensors import torch_dtype

from ...support.caches import expected_vectors, small_metadata
from ...support.loaders import check_batch

# These tests check every token of every layer once: on their caches of two layers a batch
# mixes layers on purpose (the loaders refuse that unless told: test_mixed_layers_are_refused).


def ShuffledLoader(*args: Any, **kwargs: Any) -> loaders.ShuffledLoader:
    return loaders.ShuffledLoader(*args, mix_layers=True, **kwargs)


@pytest.mark.parametrize("out_dtype", [None, "float32"])
def test_pinned_path_allocates_every_batch_pinned(
    make_cache: Any, monkeypatch: pytest.MonkeyPatch, out_dtype: str | None
) -> None:
    """With pin_memory (and CUDA) every batch's acts live in memory from the one pinned allocator.

    Without a GPU, CUDA is declared present and the pinned allocator recorded: the plumbing
    (allocation, numpy views, casts into pinned memory, batch views) is what runs on a GPU node.
    """
    md = small_metadata(n_examples=200, patches_per_shard=400)
    shards, logical = make_cache(md, batches=(50,))
    pinned: list[torch.Tensor] = []

    def fake_pinned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype)
        pinned.append(tensor)
        return tensor

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(host_run, "pinned_empty", fake_pinned)
    loader = ShuffledLoader(shards, batch_size=300, pin_memory=True, out_dtype=out_dtype, buffer_bytes=20_000)
    assert loader.pin_memory
    seen = []
    for b in loader:
        owners = [t for t in pinned if t.untyped_storage().data_ptr() == b.acts.untyped_storage().data_ptr()]
        assert owners, "a batch outside pinned memory"
        assert b.acts.dtype == torch_dtype(out_dtype or md.dtype)
        if out_dtype is None:
            seen += check_batch(b, md, logical)
        else:
            ex, tok, lay = b.examples.numpy(), b.tokens.numpy(), b.layers.numpy()
            pos = [md.layers.index(int(v)) for v in lay]
            np.testing.assert_array_equal(b.acts.numpy(), logical[ex, pos, tok].astype(np.float32))
            seen += list(zip(ex.tolist(), lay.tolist(), tok.tolist(), strict=True))
    assert sorted(seen) == sorted(expected_vectors(md))
    assert len(pinned) == -(-len(loader) // loader._config.chunk_batches)  # one pinned output per chunk


def test_gathers_run_on_the_gather_pool_not_the_consumer(make_cache: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every gather runs on a ``saev-loader-gather`` thread, several of them, never the training loop's."""
    md = small_metadata(n_examples=400, patches_per_shard=400)
    shards, logical = make_cache(md, batches=(100,))
    threads: list[str] = []
    real_take: Any = np.take
    barrier = threading.Barrier(2, timeout=5)

    def take(a: Any, indices: Any, axis: Any = None, out: Any = None, mode: str = "raise") -> Any:
        if out is not None:  # a batch gather (planning never gathers into an out array)
            threads.append(threading.current_thread().name)
            if len(threads) <= 2:
                barrier.wait()  # the first two gathers run at the same time, on two threads
        return real_take(a, indices, axis=axis, out=out, mode=mode)

    monkeypatch.setattr(np, "take", take)  # the module object the pipeline calls through
    monkeypatch.setattr(schedule, "CHUNK_BYTES", 1)  # one batch per task, as with real-sized rows
    loader = ShuffledLoader(shards, batch_size=1000, gather_threads=3, buffer_bytes=100_000, block_bytes=4000)
    seen = []
    for b in loader:
        seen += check_batch(b, md, logical)
    assert sorted(seen) == sorted(expected_vectors(md))
    assert len(threads) >= len(loader)
    assert all(name.startswith("saev-loader-gather") for name in threads), set(threads)
    assert len(set(threads)) >= 2


def test_small_batches_are_gathered_by_chunk(make_cache: Any) -> None:
    md = small_metadata(n_examples=23)
    shards, _ = make_cache(md)
    loader = ShuffledLoader(shards, batch_size=3, buffer_bytes=1 << 20)
    assert loader._config.chunk_batches > 1
    batches = list(loader)
    assert [len(b) for b in batches[:-1]] == [3] * (len(batches) - 1)
    # Batches of one chunk share one output array, yet a kept batch never changes (recycled only when free).
    kept = [b.acts.clone() for b in batches]
    list(loader)
    for b, k in zip(batches, kept, strict=True):
        assert torch.equal(b.acts, k)


def test_threads_and_outputs_are_kept_from_one_epoch_to_the_next(
    make_cache: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An epoch's threads and output arrays serve the next (`pools.Pools`), in this process only."""
    md = small_metadata(n_examples=200, patches_per_shard=400)
    shards, logical = make_cache(md, batches=(50,))
    loader = ShuffledLoader(shards, batch_size=64, buffer_bytes=100_000, block_bytes=4000)
    epochs = []
    for _ in range(2):
        seen = []
        for b in loader:
            seen += check_batch(b, md, logical)
        assert sorted(seen) == sorted(expected_vectors(md))
        pools = loader._spares.pools
        assert pools is not None
        epochs.append((pools, set(pools.read._threads | pools.gather._threads), {id(a) for a in pools.outputs.arrays}))
    (first, threads, outputs), (second, threads2, outputs2) = epochs
    # The first epoch's threads serve the second (a pool starts its threads lazily, so a busy
    # second epoch may add some, up to the pools' sizes), and so do its output arrays.
    cfg = loader._config
    assert second is first and threads <= threads2 and outputs & outputs2
    assert len(threads2) <= cfg.read_threads + cfg.gather_threads
    # A forked child has none of its parent's threads: it makes its own.
    monkeypatch.setattr(os, "getpid", lambda: -1)
    assert len(list(loader)) == len(loader)
    assert loader._spares.pools is not first and first.closed
    monkeypatch.undo()
    loader.close()
    assert first.read._shutdown and first.gather._shutdown


finite_or_not = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e-40, -1e-45, 65504.0, 7e4])
)


@given(
    hnp.arrays(np.float32, st.integers(0, 64), elements=finite_or_not),
    st.sampled_from(["float16", "bfloat16", "float32"]),
    st.sampled_from(["float16", "bfloat16", "float32"]),
)
def test_cast_into_matches_torch(values: np.ndarray[Any, Any], stored: str, out: str) -> None:
    """The gather threads cast with numpy; the result is torch's cast, bit for bit (NaN as NaN)."""
    source = torch.from_numpy(values).to(torch_dtype(stored))
    raw = source.view(torch.int16).numpy().view(np.uint16) if stored == "bfloat16" else source.numpy()
    want = source.to(torch_dtype(out))
    dest = torch.empty(len(values), dtype=torch_dtype(out))
    view = dest.view(torch.int16).numpy().view(np.uint16) if out == "bfloat16" else dest.numpy()
    outputs.cast_into(raw, stored, out, view)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(dest), nan)
    assert torch.equal(dest[~nan], want[~nan])


def test_no_join_inside_the_garbage_collector() -> None:
    """A loader collected by the cycle collector (which may run inside threading's own
    bookkeeping, holding the lock a join needs) never joins threads there: it only asks."""
    seen: list[bool] = []

    class Cycle:
        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            seen.append(pools.joinable(set()))

    Cycle()
    gc.collect()
    assert seen == [False]
    assert pools.joinable(set())  # outside the collector a join is fine
    assert not pools.joinable({threading.current_thread()})  # never this thread itself
