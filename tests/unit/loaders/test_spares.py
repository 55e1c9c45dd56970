"""loaders.spares: what a loader lends each epoch in turn. Window buffers are reused where they
fit (a float8_e4m3 cache's scales beside them); the host threads are kept for the next epoch
in this process only, a second set let go of; `clear` lets go of everything."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import saev_shards as ss
from saev_shards import loaders
from saev_shards.loaders import mapped
from saev_shards.loaders.pools import Pools
from saev_shards.loaders.spares import Spares

from ...support.caches import small_metadata, write_cache


def spares_of(root: Path, dtype: str = "float16") -> Spares:
    md = small_metadata(dtype=dtype)
    write_cache(root, md)
    loader = loaders.TokenLoader(
        ss.open(root / md.hash), batch_size=4, mix_layers=True, read_threads=2, gather_threads=2
    )
    return Spares(loader._config)


def kept(spares: Spares) -> Pools | None:
    return spares.pools


def closed(pools: Pools) -> bool:
    return pools.closed


@pytest.mark.parametrize("dtype", ["float16", "float8_e4m3"])
def test_window_buffers_are_reused_where_they_fit(tmp_path: Path, dtype: str) -> None:
    spares = spares_of(tmp_path, dtype)
    cfg = spares.cfg
    buffers = spares.take_buffers(2, rows=3)
    assert len(buffers) == 2
    for values, scales in buffers:
        assert values.shape == (3 * cfg.tokens, cfg.d_model) and values.dtype == cfg.numpy_dtype
        if dtype == "float8_e4m3":
            assert scales is not None and scales.shape == (3 * cfg.tokens,) and scales.dtype == np.float32
        else:
            assert scales is None
    spares.give_buffers(buffers)
    again = spares.take_buffers(3, rows=3)
    assert all(a[0] is b[0] for a, b in zip(again[:2], buffers, strict=True)) and again[2][0] is not buffers[0][0]
    spares.give_buffers(again)
    other = spares.take_buffers(1, rows=4)  # another size: made anew, the others let go of
    assert other[0][0].shape[0] == 4 * cfg.tokens and spares.buffers == []


def test_threads_are_kept_for_the_next_epoch_in_this_process_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spares = spares_of(tmp_path)
    first = spares.take_pools()
    assert kept(spares) is None and first.fits(spares.cfg)
    spares.give_pools(first)
    assert spares.take_pools() is first
    second = spares.take_pools()  # none kept now: new ones
    assert second is not first
    spares.give_pools(first)
    spares.give_pools(second)  # one set is kept: the second is let go of
    assert kept(spares) is first and second.closed and not closed(first)
    monkeypatch.setattr(os, "getpid", lambda: -1)  # a forked child: its parent's threads are not its own
    child = spares.take_pools()
    assert child is not first and closed(first)
    monkeypatch.undo()
    spares.give_pools(child)
    assert kept(spares) is None and child.closed  # made in another process: not kept here


def test_clear_lets_go_of_everything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mapped, "MIN_SHARD_BYTES", 0)  # the small cache is mapped in place
    spares = spares_of(tmp_path)
    spares.give_buffers(spares.take_buffers(2, rows=3))
    pools = spares.take_pools()
    spares.give_pools(pools)
    cache_map = spares.cache_map()
    assert cache_map is not None and spares.cache_map() is cache_map  # made once
    spares.clear()
    assert spares.buffers == [] and spares.pools is None and spares.slots is None
    assert spares.map is None and spares.cfg.mapped is None
    assert pools.closed and pools.read._shutdown and pools.gather._shutdown


def test_no_map_where_the_cache_is_not_read_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mapped, "MIN_SHARD_BYTES", 1 << 40)  # shards too small to map
    spares = spares_of(tmp_path)
    assert not spares.map_possible and spares.cache_map() is None
