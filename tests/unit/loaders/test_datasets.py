"""Map-style datasets: values, filters, what they read, and DataLoader workers (fork and spawn)."""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import saev_shards as ss
from saev_shards.errors import LoaderError
from saev_shards.loaders import CLS_LABEL, ExampleDataset, LayerPairDataset, TokenDataset

from ...support import strategies
from ...support.caches import expected_vectors, labels_for, small_metadata, write_cache


@contextmanager
def cache(md: ss.Metadata, **kwargs: Any) -> Iterator[tuple[ss.Shards, np.ndarray[Any, Any]]]:
    with tempfile.TemporaryDirectory() as tmp:
        logical = write_cache(Path(tmp), md, **kwargs)
        yield ss.open(Path(tmp) / md.hash), logical


def as_stored(acts: torch.Tensor, dtype: str) -> np.ndarray[Any, Any]:
    return acts.view(torch.int16).numpy().view(np.uint16) if dtype == "bfloat16" else acts.numpy()


@given(strategies.metadata(max_examples=15, min_examples=1), st.data())
def test_token_dataset(md: ss.Metadata, data: st.DataObject) -> None:
    tokens = data.draw(st.sampled_from(["content", "all", "cls"] if md.cls_token else ["content", "all"]))
    ignore = tuple(data.draw(st.sets(st.integers(0, 255), max_size=120)))
    layer = data.draw(st.sampled_from(md.layers))
    lengths = np.array(
        data.draw(st.lists(st.integers(0, md.tokens_per_ex), min_size=md.n_examples, max_size=md.n_examples))
    )
    with cache(md, labels=True, lengths=lengths) as (shards, logical):
        ds = TokenDataset(shards, layer=layer, tokens=tokens, ignore_labels=ignore)
        labels = labels_for(md)
        want = expected_vectors(md, (layer,), tokens, ignore, labels, lengths)
        assert len(ds) == len(want)
        position = md.layers.index(layer)
        for i, (e, _, t) in enumerate(want):
            item = ds[i]
            assert (item["example"], item["token"]) == (e, t)
            np.testing.assert_array_equal(as_stored(item["acts"], md.dtype), logical[e, position, t])
            cls = int(md.cls_token)
            assert item["label"] == (CLS_LABEL if t < cls else labels[e, t - cls])
        if len(ds):
            assert ds[-1]["example"] == want[-1][0]
        with pytest.raises(IndexError, match="out of range"):
            ds[len(ds)]


def test_token_dataset_needs_a_layer_when_several(make_cache: Any) -> None:
    shards, _ = make_cache(small_metadata())
    with pytest.raises(LoaderError, match="several"):
        TokenDataset(shards)
    shards1, logical = make_cache(small_metadata(layers=(3,)))
    item = TokenDataset(shards1, out_dtype="float32")[0]
    assert item["acts"].dtype == torch.float32 and "label" not in item
    np.testing.assert_array_equal(item["acts"].numpy(), logical[0, 0, 1].astype(np.float32))


def test_example_dataset_reads_one_slice_and_nothing_else(make_cache: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    md = small_metadata(n_examples=12)
    lengths = np.arange(12) % md.tokens_per_ex
    shards, logical = make_cache(md, labels=True, lengths=lengths)
    ds = ExampleDataset(shards, with_labels=True, mix_layers=True)
    assert len(ds) == 12 * 2
    reads: list[int] = []
    real = shards._preadv  # every read of the cache's files goes through its storage (os.preadv here)
    assert real is os.preadv

    def counting(fd: int, buffers: list[Any], offset: int) -> int:
        reads.append(sum(memoryview(b).nbytes for b in buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(shards, "_preadv", counting)
    for i in (0, 5, 23, -1):
        item = ds[i]
        e, which = divmod(i % len(ds), 2)
        assert (item["example"], item["layer"], item["length"]) == (e, md.layers[which], lengths[e])
        np.testing.assert_array_equal(item["acts"].numpy(), logical[e, which])
        np.testing.assert_array_equal(item["labels"], labels_for(md)[e])
    slice_bytes = md.tokens_per_ex * md.d_model * md.itemsize
    assert reads == [slice_bytes] * 4  # one pread of exactly the (T, D) slice per item
    one_layer = ExampleDataset(shards, layers=11)
    assert len(one_layer) == 12 and one_layer[3]["layer"] == 11
    with pytest.raises(IndexError):
        one_layer[12]
    stacked = ExampleDataset(shards, stack_layers=True)
    assert len(stacked) == 12 and stacked[5]["layers"].tolist() == list(md.layers)
    np.testing.assert_array_equal(stacked[5]["acts"].numpy(), logical[5])
    with pytest.raises(IndexError):
        stacked[12]


def test_example_dataset_refuses_to_mix_layers_by_accident(make_cache: Any) -> None:
    md = small_metadata(layers=(2, 5, 9), n_examples=4)
    shards, _ = make_cache(md)
    for layers in (None, [2, 9]):
        with pytest.raises(LoaderError) as info:
            ExampleDataset(shards, layers=layers)
        message = str(info.value)
        assert "layers=" in message and "stack_layers=True" in message and "mix_layers=True" in message
    assert "records layers [2, 5, 9]; you chose [2, 9]" in message
    assert len(ExampleDataset(shards, layers=[2, 9], mix_layers=True)) == 8


def test_layer_pair_dataset(make_cache: Any) -> None:
    md = small_metadata(layers=(2, 5, 9), n_examples=30)
    shards, logical = make_cache(md)
    ds = LayerPairDataset(shards, seed=4)
    pairs = []
    for i in range(len(ds)):
        item = ds[i]
        layers = item["layers"].tolist()
        assert len(set(layers)) == 2 and set(layers) <= {2, 5, 9}
        positions = [md.layers.index(v) for v in layers]
        np.testing.assert_array_equal(item["acts"].numpy(), logical[i, positions])
        pairs.append(tuple(layers))
    assert len(set(pairs)) > 1
    assert [tuple(LayerPairDataset(shards, seed=4)[i]["layers"].tolist()) for i in range(30)] == pairs
    ds.set_epoch(1)
    assert [tuple(ds[i]["layers"].tolist()) for i in range(30)] != pairs
    batch = next(iter(DataLoader(ds, batch_size=8, shuffle=True)))
    assert batch["acts"].shape == (8, 2, md.tokens_per_ex, md.d_model)
    assert batch["layers"].shape == (8, 2)
    with pytest.raises(LoaderError, match="at least 2 layers"):
        LayerPairDataset(shards, layers=[5])


def test_datasets_pickle_without_handles(make_cache: Any) -> None:
    shards, logical = make_cache(small_metadata(), labels=True)
    ds = ExampleDataset(shards, mix_layers=True)
    ds[0]  # opens a descriptor in this process
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.shards._fds == {} and clone.shards._maps == {}
    np.testing.assert_array_equal(clone[3]["acts"].numpy(), logical[1, 1])
    token_ds = TokenDataset(shards, layer=6, ignore_labels=[1, 2])
    token_ds[5]
    assert len(pickle.dumps(token_ds)) < 20_000


def collect(loader: DataLoader[Any]) -> list[tuple[int, int]]:
    return [(int(e), int(t)) for batch in loader for e, t in zip(batch["example"], batch["token"], strict=True)]


@pytest.mark.parametrize(
    ("workers", "start"), [(0, None), (2, "fork"), pytest.param(2, "spawn", marks=pytest.mark.slow)]
)
def test_dataloader_workers(make_cache: Any, workers: int, start: str | None) -> None:
    md = small_metadata(n_examples=9)
    shards, logical = make_cache(md, labels=True)
    ds = TokenDataset(shards, layer=11, ignore_labels=[7])
    context = multiprocessing.get_context(start) if start else None
    loader = DataLoader(ds, batch_size=7, shuffle=True, num_workers=workers, multiprocessing_context=context)
    seen = []
    for batch in loader:
        for j, (e, t) in enumerate(zip(batch["example"].tolist(), batch["token"].tolist(), strict=True)):
            np.testing.assert_array_equal(batch["acts"][j].numpy(), logical[e, 1, t])
            seen.append((e, t))
    want = [(e, t) for e, _, t in expected_vectors(md, (11,), "content", (7,), labels_for(md))]
    assert sorted(seen) == sorted(want)
    # Breaking early leaves no worker process behind.
    it = iter(loader)
    next(it)
    del it
    gc.collect()
    assert multiprocessing.active_children() == []


def test_dataloader_spawn_example_dataset(make_cache: Any) -> None:
    """Spawned workers unpickle the dataset and open their own memmaps."""
    md = small_metadata(n_examples=6)
    shards, logical = make_cache(md)
    ds = ExampleDataset(shards, layers=6)
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=multiprocessing.get_context("spawn"))
    got = torch.cat([b["acts"] for b in loader]).numpy()
    np.testing.assert_array_equal(got, logical[:, 0])
    assert multiprocessing.active_children() == []
