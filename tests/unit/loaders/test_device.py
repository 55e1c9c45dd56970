"""The device-side shuffle, run on the CPU: the same batches as the host path, resumable, bounded."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import saev_shards as ss
from saev_shards import loaders
from saev_shards.errors import LoaderError
from saev_shards.loaders import device

from ...support import strategies
from ...support.caches import small_metadata
from ...support.loaders import cache, keys, live_loader_threads

# These tests check every token of every layer once: on their caches of two layers a batch
# mixes layers on purpose (the loaders refuse that unless told: test_mixed_layers_are_refused).


def ShuffledLoader(*args: Any, **kwargs: Any) -> loaders.ShuffledLoader:
    return loaders.ShuffledLoader(*args, mix_layers=True, **kwargs)


def OrderedLoader(*args: Any, **kwargs: Any) -> loaders.OrderedLoader:
    return loaders.OrderedLoader(*args, mix_layers=True, **kwargs)


def assert_same_batches(host: list[Any], dev: list[Any]) -> None:
    assert len(host) == len(dev)
    for a, b in zip(host, dev, strict=True):
        assert b.acts.device.type == "cpu" and b.acts.dtype == a.acts.dtype and b.acts.shape == a.acts.shape
        if a.acts.dtype == torch.bfloat16:  # bit for bit (NaN payloads included)
            assert torch.equal(a.acts.view(torch.int16), b.acts.view(torch.int16))
        else:
            assert torch.equal(a.acts, b.acts)
        for name in ("examples", "tokens", "layers"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
            assert getattr(b, name).dtype == torch.int64
        assert (a.labels is None) == (b.labels is None)
        if a.labels is not None:
            assert torch.equal(a.labels, b.labels) and b.labels.dtype == torch.uint8


@given(strategies.metadata(max_examples=25, min_examples=1), st.data())
def test_device_path_yields_the_host_batches(md: ss.Metadata, data: st.DataObject) -> None:
    """device="cpu" runs the device code path with torch ops on the CPU: same batches, same order."""
    kwargs: dict[str, Any] = dict(
        batch_size=data.draw(st.integers(1, 30)),
        seed=data.draw(st.integers(0, 3)),
        buffer_bytes=data.draw(st.sampled_from([1, 300, 4000, 1 << 30])),
        block_bytes=data.draw(st.sampled_from([1, 64, 1 << 22])),
        drop_last=data.draw(st.booleans()),
        stack_layers=data.draw(st.booleans()),
        out_dtype=data.draw(st.sampled_from([None, "float32", "bfloat16", "float16"])),
        ignore_labels=data.draw(st.sampled_from([(), (1, 2, 3), tuple(range(0, 256, 3))])),
    )
    if data.draw(st.booleans()):
        kwargs.update(rank=1, world_size=2)
    lengths = np.arange(md.n_examples) % (md.tokens_per_ex + 1)
    with cache(md, labels=True, lengths=lengths) as (shards, _):
        cls = data.draw(st.sampled_from([ShuffledLoader, OrderedLoader]))
        if cls is OrderedLoader:
            kwargs.pop("seed")
        host = list(cls(shards, **kwargs))
        dev = list(cls(shards, device="cpu", **kwargs))
        assert_same_batches(host, dev)


def test_device_path_resumes_and_reuses_its_slots(make_cache: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    md = small_metadata(n_examples=23)
    shards, _ = make_cache(md, labels=True)
    made: list[device.Slots] = []
    real = device.Slots

    def counting(*args: Any) -> device.Slots:
        slots = real(*args)
        made.append(slots)
        return slots

    monkeypatch.setattr(device, "Slots", counting)
    from saev_shards.loaders import spares

    monkeypatch.setattr(spares, "Slots", counting)
    kwargs: dict[str, Any] = dict(batch_size=7, seed=4, buffer_bytes=300, block_bytes=100, device="cpu")
    loader = ShuffledLoader(shards, **kwargs)
    epochs = [keys(list(loader)) for _ in range(3)]
    assert len(made) == 1  # one set of window buffers for every epoch
    assert epochs[0] != epochs[1]
    loader.set_epoch(1)
    it = iter(loader)
    first = [next(it) for _ in range(4)]
    state = loader.state_dict()
    del it
    resumed = ShuffledLoader(shards, **kwargs)
    resumed.load_state_dict(state)
    assert keys(first) + keys(list(resumed)) == epochs[1]


def test_device_path_stops_its_threads(make_cache: Any) -> None:
    shards, _ = make_cache(small_metadata(n_examples=23))
    loader = ShuffledLoader(shards, batch_size=2, buffer_bytes=200, block_bytes=64, device="cpu")
    it = iter(loader)
    next(it)
    assert live_loader_threads()
    del it
    gc.collect()
    assert live_loader_threads() == []
    it = iter(loader)
    next(it)
    loader.close()
    assert live_loader_threads() == []
    with pytest.raises(StopIteration):
        next(it)


def test_device_errors(make_cache: Any) -> None:
    shards, _ = make_cache(small_metadata())
    if not torch.cuda.is_available():
        with pytest.raises(LoaderError, match=r"device='cuda': expected a CUDA GPU"):
            ShuffledLoader(shards, device="cuda")
    with pytest.raises(LoaderError, match="device: expected"):
        ShuffledLoader(shards, device="meta")
    with pytest.raises(LoaderError, match="device: expected"):
        ShuffledLoader(shards, device="no such device")
