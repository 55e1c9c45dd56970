"""The iterable training loaders against a plain-Python model of the token selection."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import saev_shards as ss
from saev_shards import loaders
from saev_shards.errors import LoaderError
from saev_shards.loaders import CLS_LABEL, token_loader

from ...support import strategies
from ...support.caches import expected_vectors, labels_for, small_metadata, write_cache
from ...support.loaders import cache, check_batch, collected_until, keys, live_loader_threads

# These tests check every token of every layer once: on their caches of two layers a batch
# mixes layers on purpose (the loaders refuse that unless told: test_mixed_layers_are_refused).


def ShuffledLoader(*args: Any, **kwargs: Any) -> loaders.ShuffledLoader:
    return loaders.ShuffledLoader(*args, mix_layers=True, **kwargs)


def OrderedLoader(*args: Any, **kwargs: Any) -> loaders.OrderedLoader:
    return loaders.OrderedLoader(*args, mix_layers=True, **kwargs)


small_sizes = st.fixed_dictionaries(
    {
        "batch_size": st.integers(1, 40),
        "buffer_bytes": st.sampled_from([1, 100, 500, 4000, 1 << 30]),
        "block_bytes": st.sampled_from([1, 64, 300, 1 << 22]),
        "read_threads": st.integers(1, 3),
        "prefetch": st.integers(1, 3),
    }
)


# -- every token exactly once ---------------------------------------------------------


@given(strategies.metadata(max_examples=30), small_sizes, st.data())
def test_shuffled_every_token_once(md: ss.Metadata, sizes: dict[str, Any], data: st.DataObject) -> None:
    layers = tuple(data.draw(st.sets(st.sampled_from(md.layers), min_size=1))) if data.draw(st.booleans()) else None
    tokens = data.draw(st.sampled_from(["content", "all", "cls"] if md.cls_token else ["content", "all"]))
    drop_last = data.draw(st.booleans())
    with cache(md) as (shards, logical):
        loader = ShuffledLoader(shards, layers=layers, tokens=tokens, seed=3, drop_last=drop_last, **sizes)
        seen: list[tuple[int, int, int]] = []
        batches = list(loader)
        for batch in batches:
            seen += check_batch(batch, md, logical)
            assert batch.labels is None
        want = expected_vectors(md, layers, tokens)
        assert len(batches) == len(loader)
        size = sizes["batch_size"]
        assert all(len(b) == size for b in batches[:-1])
        if drop_last:
            assert len(seen) == len(want) // size * size
            assert set(seen) <= set(want)
        else:
            assert sorted(seen) == sorted(want)  # exactly once: no duplicates, nothing missing
        assert len(set(seen)) == len(seen)


@given(strategies.metadata(max_examples=30), small_sizes, st.data())
def test_ordered_is_strict_order(md: ss.Metadata, sizes: dict[str, Any], data: st.DataObject) -> None:
    layers = tuple(data.draw(st.sets(st.sampled_from(md.layers), min_size=1))) if data.draw(st.booleans()) else None
    tokens = data.draw(st.sampled_from(["content", "all"]))
    with cache(md, labels=True) as (shards, logical):
        loader = OrderedLoader(shards, layers=layers, tokens=tokens, **sizes)
        seen: list[tuple[int, int, int]] = []
        first_epoch = list(loader)
        for batch in first_epoch:
            seen += check_batch(batch, md, logical)
        assert seen == expected_vectors(md, layers, tokens)
        assert len(first_epoch) == len(loader)
        second = list(loader)
        assert len(second) == len(first_epoch)
        for a, b in zip(first_epoch, second, strict=True):
            assert torch.equal(a.examples, b.examples) and torch.equal(a.tokens, b.tokens)


def test_ordered_batches_cross_shard_boundaries(make_cache: Any) -> None:
    md = small_metadata(n_examples=23, patches_per_shard=50)  # 5 examples per shard, 5 shards
    shards, logical = make_cache(md, labels=True)
    loader = OrderedLoader(shards, batch_size=48, layers=11, block_bytes=1)
    batches = list(loader)
    crossing = [b for b in batches if len(set((b.examples // md.examples_per_shard).tolist())) > 1]
    assert crossing, "with 12 examples per batch and 5 per shard, batches must span shards"
    for b in batches:
        check_batch(b, md, logical)
    labels = labels_for(md)
    for b in batches:
        assert b.labels is not None
        np.testing.assert_array_equal(b.labels.numpy(), labels[b.examples.numpy(), b.tokens.numpy() - 1])


def test_ordered_windows_however_cut_give_the_same_batches(make_cache: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The OrderedLoader's windows (its ``buffer_bytes``, and its smaller first window) decide
    how much is read at once, never a batch: the same batches, and a state saved by one resumes
    in another. A ShuffledLoader's windows are permuted: it never cuts its first one smaller."""
    md = small_metadata(n_examples=23, patches_per_shard=50)
    shards, logical = make_cache(md, labels=True)
    slice_bytes = md.tokens_per_ex * md.d_model * md.itemsize

    def ordered(buffer_slices: int, first_slices: int) -> loaders.OrderedLoader:
        monkeypatch.setattr(token_loader, "FIRST_WINDOW_BYTES", first_slices * slice_bytes)
        loader = OrderedLoader(shards, batch_size=13, buffer_bytes=buffer_slices * slice_bytes, block_bytes=1)
        assert loader._first_window_rows == first_slices
        return loader

    reference = ordered(1 << 20, 1 << 20)
    want = [(b.acts.clone(), b.examples, b.tokens, b.layers) for b in reference]
    for b in reference:
        check_batch(b, md, logical)
    for buffer_slices, first_slices in [(7, 1), (7, 3), (40, 2), (5, 40), (1, 1)]:
        loader = ordered(buffer_slices, first_slices)
        windows = [len(w.spans) for w in loader.plan(0).windows]
        if first_slices < buffer_slices:  # the first window is the small one
            assert windows[0] <= first_slices < buffer_slices
        got = list(loader)
        assert len(got) == len(want)
        for g, (acts, examples, tokens, layers) in zip(got, want, strict=True):
            assert torch.equal(g.acts, acts) and torch.equal(g.examples, examples)
            assert torch.equal(g.tokens, tokens) and torch.equal(g.layers, layers)
        # A state saved part-way by one resumes in another with the batches still to come.
        saver = ordered(buffer_slices, first_slices)
        it = iter(saver)
        for _ in range(5):
            next(it)
        resumed = ordered(3, 1)
        resumed.load_state_dict(saver.state_dict())
        rest = list(resumed)
        assert [r.examples.tolist() for r in rest] == [w[1].tolist() for w in want[5:]]
    monkeypatch.setattr(token_loader, "FIRST_WINDOW_BYTES", slice_bytes)
    assert ShuffledLoader(shards, batch_size=13, buffer_bytes=7 * slice_bytes)._first_window_rows is None
    assert inspect.signature(loaders.OrderedLoader).parameters["buffer_bytes"].default == 256 << 20


# -- order, determinism, resume -------------------------------------------------------


def test_new_order_each_epoch_same_for_same_seed(make_cache: Any) -> None:
    shards, _ = make_cache(small_metadata(n_examples=40))
    loader = ShuffledLoader(shards, batch_size=16, seed=7, buffer_bytes=400, block_bytes=100)
    epoch0, epoch1 = keys(list(loader)), keys(list(loader))
    assert epoch0 != epoch1
    assert sorted(sum(epoch0, ())) == sorted(sum(epoch1, ()))
    # Thread count, prefetch depth and timing do not change the batches.
    other = ShuffledLoader(shards, batch_size=16, seed=7, buffer_bytes=400, block_bytes=100, read_threads=1, prefetch=1)
    assert keys(list(other)) == epoch0
    assert keys(list(other)) == epoch1
    different_seed = ShuffledLoader(shards, batch_size=16, seed=8, buffer_bytes=400, block_bytes=100)
    assert keys(list(different_seed)) != epoch0


def test_shuffle_mixes_shards_within_a_batch(make_cache: Any) -> None:
    md = small_metadata(n_examples=200, patches_per_shard=50)  # 40 shards of 5 examples
    shards, _ = make_cache(md)
    loader = ShuffledLoader(shards, batch_size=64, layers=6, buffer_bytes=4000, block_bytes=80)
    for batch in loader:
        if len(batch) == 64:
            assert len(set((batch.examples // 5).tolist())) >= 4


@given(
    st.integers(0, 30),
    st.sampled_from([1, 3]),
    st.booleans(),
    st.sampled_from([(0, 1), (1, 3)]),
    st.sampled_from([0, 1]),
)
def test_resume_mid_epoch_exactly(
    stop_after: int, read_threads: int, drop_last: bool, world: tuple[int, int], ignore: int
) -> None:
    md = small_metadata(n_examples=17)
    lengths = np.arange(17) % (md.tokens_per_ex + 1)
    rank, world_size = world
    with cache(md, labels=True, lengths=lengths) as (shards, _):
        kwargs: dict[str, Any] = dict(
            batch_size=5,
            seed=11,
            buffer_bytes=300,
            block_bytes=100,
            drop_last=drop_last,
            rank=rank,
            world_size=world_size,
            ignore_labels=range(ignore * 100),
        )
        reference = ShuffledLoader(shards, **kwargs)
        stream = keys(list(reference)) + keys(list(reference))  # two epochs
        loader = ShuffledLoader(shards, read_threads=read_threads, **kwargs)
        it = iter(loader)
        taken = [next(it) for _ in range(min(stop_after, len(loader)))]
        state = loader.state_dict()
        del it
        resumed = ShuffledLoader(shards, **kwargs)
        resumed.load_state_dict(state)
        rest = keys(list(resumed))
        if len(taken) == len(loader):  # stopped at the end of an epoch: the next one follows
            assert state["epoch"] == 1 and state["batch"] == 0
            assert rest == stream[len(loader) :]
        else:
            assert keys(taken) + rest == stream[: len(loader)]
            assert keys(list(resumed)) == stream[len(loader) :]


def test_state_dict_progresses_and_set_epoch(make_cache: Any) -> None:
    shards, _ = make_cache(small_metadata(n_examples=10))
    loader = ShuffledLoader(shards, batch_size=8, seed=1)
    assert loader.state_dict()["epoch"] == 0 and loader.state_dict()["batch"] == 0
    for i, _ in enumerate(loader, start=1):
        assert loader.state_dict()["batch"] == i % len(loader)
    assert loader.state_dict()["epoch"] == 1
    epoch1 = keys(list(loader))
    loader.set_epoch(1)
    assert keys(list(loader)) == epoch1


def test_load_state_dict_rejects_other_settings(make_cache: Any) -> None:
    shards, _ = make_cache(small_metadata())
    state = ShuffledLoader(shards, batch_size=8).state_dict()
    # The error names the setting that differs, with both values, and only that one.
    with pytest.raises(LoaderError, match="different cache or settings: batch_size 8 in the state, 9 here\\)") as err:
        ShuffledLoader(shards, batch_size=9).load_state_dict(state)
    assert "seed" not in str(err.value).split("settings:")[1]
    with pytest.raises(LoaderError, match=r"seed 0 in the state, 5 here; tokens 'content' in the state, 'all' here"):
        ShuffledLoader(shards, batch_size=8, seed=5, tokens="all").load_state_dict(state)
    # A state saved before states carried their settings still loads, and still fails on other settings.
    old = {k: v for k, v in state.items() if k != "settings"}
    ShuffledLoader(shards, batch_size=8).load_state_dict(old)
    with pytest.raises(LoaderError, match=r"different cache or settings\)"):
        ShuffledLoader(shards, batch_size=9).load_state_dict(old)
    with pytest.raises(LoaderError, match="expected keys"):
        ShuffledLoader(shards, batch_size=8).load_state_dict({"epoch": 0})
    with pytest.raises(LoaderError, match=r"state: batch: expected an integer in \[0, 23\], found 1000000"):
        ShuffledLoader(shards, batch_size=8).load_state_dict({**state, "batch": 10**6})


#: Edited states: (field, value, what the message says it found). Before the fix a batch of
#: 1.9 replayed batch 1, strings and booleans were taken, and NaN, infinity or None raised
#: raw ValueError, TypeError or OverflowError.
EDITED = [
    ("batch", 1.9, "1.9"),
    ("batch", 1.0, "1.0"),
    ("batch", True, "True"),
    ("batch", "1", "'1'"),
    ("batch", float("nan"), "nan"),
    ("batch", float("inf"), "inf"),
    ("batch", None, "None"),
    ("batch", -1, "-1"),
    ("batch", [1], "[1]"),
    ("epoch", 0.5, "0.5"),
    ("epoch", float("-inf"), "-inf"),
    ("epoch", None, "None"),
    ("epoch", False, "False"),
    ("epoch", -1, "-1"),
    ("epoch", 2**64, "18446744073709551616"),
    ("epoch", np.int64(1), "np.int64(1)"),
    ("epoch", "x" * 10_000, "'xxxxxxxx"),
    ("seed", 0.0, "0.0"),
    ("seed", None, "None"),
    ("seed", "0", "'0'"),
    ("fingerprint", None, "None"),
    ("fingerprint", 7, "7"),
    ("fingerprint", "G" * 16, "'GGGGGGGGGGGGGGGG'"),
    ("settings", [1, 2], "[1, 2]"),
]


@pytest.mark.parametrize(("field", "value", "shown"), EDITED, ids=[f"{f}={v!r:.20}" for f, v, _ in EDITED])
def test_load_state_dict_names_the_field_of_an_edited_state(
    make_cache: Any, field: str, value: Any, shown: str
) -> None:
    shards, _ = make_cache(small_metadata())
    loader = ShuffledLoader(shards, batch_size=8)
    state = loader.state_dict()
    with pytest.raises(LoaderError, match=rf"^state: {field}: expected .*, found {re.escape(shown)}") as err:
        loader.load_state_dict({**state, field: value})
    assert len(str(err.value)) < 400  # a 10,000-character value is quoted to a bounded length
    # what state_dict gives is accepted as it is, at both ends of its range
    loader.load_state_dict({**state, "batch": len(loader)})
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["batch"] == 0


def test_load_state_dict_lists_every_bad_field_at_once(make_cache: Any) -> None:
    shards, _ = make_cache(small_metadata())
    loader = ShuffledLoader(shards, batch_size=8)
    state = {**loader.state_dict(), "epoch": None, "batch": 1.9}
    with pytest.raises(LoaderError, match=r"state: epoch: expected an integer >= 0, found None; batch: expected"):
        loader.load_state_dict(state)
    for epoch in (1.9, None, "1", -1):  # set_epoch(1.9) used to run epoch 1
        with pytest.raises(LoaderError, match=r"epoch: expected an integer >= 0, found"):
            loader.set_epoch(epoch)  # type: ignore[arg-type]
    loader.set_epoch(np.int64(2))  # type: ignore[arg-type]  # numpy integers are taken
    assert loader.state_dict()["epoch"] == 2


# -- distributed ------------------------------------------------------------------------


@given(
    strategies.metadata(max_examples=25, min_examples=1),
    st.integers(1, 5),
    st.integers(1, 20),
    st.booleans(),
    st.sampled_from([1, 200, 1 << 30]),
)
def test_ranks_are_disjoint_and_cover_the_epoch(
    md: ss.Metadata, world_size: int, batch_size: int, drop_last: bool, buffer_bytes: int
) -> None:
    with cache(md) as (shards, logical):
        per_rank = []
        for rank in range(world_size):
            loader = ShuffledLoader(
                shards,
                batch_size=batch_size,
                seed=5,
                rank=rank,
                world_size=world_size,
                drop_last=drop_last,
                buffer_bytes=buffer_bytes,
                block_bytes=50,
            )
            seen: list[tuple[int, int, int]] = []
            batches = list(loader)
            assert len(batches) == len(loader)
            for b in batches:
                seen += check_batch(b, md, logical)
            per_rank.append(seen)
        everything = [v for seen in per_rank for v in seen]
        assert len(set(everything)) == len(everything)  # disjoint
        want = expected_vectors(md)
        if drop_last:
            assert len({len(s) for s in per_rank}) == 1  # every rank the same number of batches
            assert set(everything) <= set(want)
            assert len(everything) == world_size * ((len(want) // world_size) // batch_size * batch_size)
        else:
            assert sorted(everything) == sorted(want)


def test_world_from_torch_distributed(make_cache: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    shards, _ = make_cache(small_metadata())
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 2)
    monkeypatch.setattr(dist, "get_world_size", lambda: 3)
    loader = ShuffledLoader(shards)
    assert (loader.rank, loader.world_size) == (2, 3)
    with pytest.raises(LoaderError, match="give both rank and world_size"):
        ShuffledLoader(shards, rank=1)
    with pytest.raises(LoaderError, match="0 <= rank < world_size"):
        ShuffledLoader(shards, rank=3, world_size=3)


# -- filters, labels, dtypes -----------------------------------------------------------


@given(
    strategies.metadata(max_examples=20, min_examples=1),
    st.data(),
    st.booleans(),
    st.booleans(),
)
def test_filters_and_labels(md: ss.Metadata, data: st.DataObject, skip_padding: bool, per_slice: bool) -> None:
    ignore = tuple(data.draw(st.sets(st.integers(0, 255), max_size=150)))
    tokens = data.draw(st.sampled_from(["content", "all", "cls"] if md.cls_token else ["content", "all"]))
    layers = (md.layers[-1],) if data.draw(st.booleans()) else None
    lengths = np.array(
        data.draw(st.lists(st.integers(0, md.tokens_per_ex), min_size=md.n_examples, max_size=md.n_examples)),
        dtype=np.int32,
    )
    with cache(md, labels=True, lengths=lengths) as (shards, logical), pytest.MonkeyPatch.context() as mp:
        if per_slice:  # read chosen layers slice by slice even for these tiny slices
            mp.setattr(loaders.plan, "MIN_SLICE_READ", 0)
        labels = labels_for(md)
        for cls in (ShuffledLoader, OrderedLoader):
            loader = cls(
                shards,
                batch_size=13,
                layers=layers,
                tokens=tokens,
                ignore_labels=ignore,
                skip_padding=skip_padding,
                buffer_bytes=300,
                block_bytes=64,
            )
            seen = []
            for b in loader:
                seen += check_batch(b, md, logical)
                assert b.labels is not None and b.labels.dtype == torch.uint8
                ex, tok = b.examples.numpy(), b.tokens.numpy()
                content = tok >= int(md.cls_token)
                if md.patches_per_ex:
                    want = labels[ex[content], tok[content] - int(md.cls_token)]
                    np.testing.assert_array_equal(b.labels.numpy()[content], want)
                assert (b.labels.numpy()[~content] == CLS_LABEL).all()
            want_vectors = expected_vectors(md, layers, tokens, ignore, labels, lengths, skip_padding)
            if cls is OrderedLoader:
                assert seen == want_vectors
            else:
                assert sorted(seen) == sorted(want_vectors)


@pytest.mark.parametrize("stored", ["float16", "bfloat16", "float32", "float8_e4m3"])
@pytest.mark.parametrize("out", [None, "float32", "bfloat16", "float16"])
def test_out_dtype(root: Path, stored: str, out: str | None) -> None:
    """Any output dtype from any stored one; float8_e4m3 comes as float16 by default (its
    logical tensor here is its dequantized values, which float16 holds exactly)."""
    md = small_metadata(dtype=stored)
    logical = write_cache(root, md)
    shards = ss.open(root / md.hash)
    loader = ShuffledLoader(shards, batch_size=32, out_dtype=out, layers=6)
    read = "float16" if stored == "float8_e4m3" else stored
    want_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[out or read]
    for b in loader:
        assert b.acts.dtype == want_dtype
        values = ss.to_float32(logical[b.examples.numpy(), 0, b.tokens.numpy()], read)
        expected = torch.from_numpy(values).to(want_dtype)
        assert torch.equal(b.acts, expected)


def test_batches_are_independent_tensors(make_cache: Any) -> None:
    """Output memory is recycled only once nothing refers to it: kept batches never change."""
    md = small_metadata(n_examples=23)
    shards, logical = make_cache(md)
    loader = ShuffledLoader(shards, batch_size=8, prefetch=1, buffer_bytes=200, block_bytes=64)
    kept = [(b.acts[:3], b.examples[:3].clone(), b.tokens[:3].clone(), b.layers[:3].clone()) for b in loader]
    for acts, ex, tok, lay in kept:
        positions = [md.layers.index(int(v)) for v in lay]
        np.testing.assert_array_equal(acts.numpy(), logical[ex.numpy(), positions, tok.numpy()])


def test_mixed_layers_are_refused(make_cache: Any) -> None:
    """A batch half one layer, half another trains a wrong SAE: more than one layer needs
    stack_layers=True or mix_layers=True, and the one message names the three ways out."""
    md = small_metadata(n_examples=6)
    shards, _ = make_cache(md)
    for make in (loaders.ShuffledLoader, loaders.OrderedLoader):
        for layers in (None, [6, 11]):
            with pytest.raises(LoaderError) as info:
                make(shards, batch_size=4, layers=layers)
            assert str(info.value) == (
                "this cache records layers [6, 11], and a batch would mix them: choose one layer with layers=11, "
                "stack them with stack_layers=True (each row one token at every chosen layer), or pass "
                "mix_layers=True to mix layers in one batch on purpose"
            )
    one = loaders.ShuffledLoader(shards, batch_size=4, layers=6)
    assert {int(v) for b in one for v in b.layers} == {6}
    stacked = loaders.ShuffledLoader(shards, batch_size=4, stack_layers=True)
    assert next(iter(stacked)).acts.shape[1:] == (2, md.d_model)
    mixed = loaders.ShuffledLoader(shards, batch_size=4, mix_layers=True)
    assert {int(v) for b in mixed for v in b.layers} == {6, 11}
    assert mixed.fingerprint == ShuffledLoader(shards, batch_size=4).fingerprint  # a permission, not a setting
    single = small_metadata(layers=(3,), n_examples=4)
    shards1, _ = make_cache(single)
    assert len(loaders.ShuffledLoader(shards1, batch_size=4)) > 0  # one recorded layer: nothing to choose


def test_configuration_errors(make_cache: Any) -> None:
    shards, _ = make_cache(small_metadata(cls_token=False))
    with pytest.raises(LoaderError, match=r"layers: expected values among the recorded layers \[6, 11\], found 7"):
        ShuffledLoader(shards, layers=7)
    with pytest.raises(LoaderError, match="found cls_token=false"):
        ShuffledLoader(shards, tokens="cls")
    with pytest.raises(LoaderError, match="expected one of"):
        ShuffledLoader(shards, tokens="patches")
    with pytest.raises(LoaderError, match=r"labels\.bin"):
        ShuffledLoader(shards, ignore_labels=[0])
    with pytest.raises(LoaderError, match="batch_size: expected an integer >= 1, found 0"):
        ShuffledLoader(shards, batch_size=0)
    with pytest.raises(LoaderError, match="out_dtype"):
        ShuffledLoader(shards, out_dtype="int8")
    with pytest.raises(LoaderError, match="distinct"):
        OrderedLoader(shards, layers=[6, 6])
    assert issubclass(LoaderError, ValueError)


def test_empty_cache_and_everything_filtered(root: Path) -> None:
    md = small_metadata(n_examples=0)
    write_cache(root, md)
    loader = ShuffledLoader(ss.open(root / md.hash))
    assert len(loader) == 0 and list(loader) == []
    md = small_metadata(n_examples=3)
    write_cache(root, md, labels=True)
    loader = ShuffledLoader(root / md.hash, ignore_labels=range(256))  # a path works too
    assert len(loader) == 0 and list(loader) == []


# -- threads stop -----------------------------------------------------------------------


def test_early_break_and_gc_stop_threads(make_cache: Any) -> None:
    shards, _ = make_cache(small_metadata(n_examples=23))
    loader = ShuffledLoader(shards, batch_size=2, buffer_bytes=200, block_bytes=64, prefetch=1)
    for _ in loader:
        break
    # The epoch has stopped and given its threads back: the loader keeps them, idle, for the next.
    spare = loader._spares.pools
    assert spare is not None
    kept = spare.read._threads | spare.gather._threads
    assert collected_until(lambda: set(live_loader_threads()) <= kept)
    assert not spare.read._work_queue.qsize() and not spare.gather._work_queue.qsize()
    loader.close()
    assert live_loader_threads() == []
    batches = list(loader)  # iterating again after close starts over, with new threads
    assert len(batches) == len(loader)
    del loader, batches
    assert collected_until(lambda: live_loader_threads() == [])  # a loader let go of stops its idle threads
    loader = ShuffledLoader(shards, batch_size=2, buffer_bytes=200, block_bytes=64, prefetch=1)
    it = iter(loader)
    next(it)
    assert live_loader_threads()  # running, blocked on a full queue
    del it
    spare = loader._spares.pools
    assert spare is not None
    kept = spare.read._threads | spare.gather._threads
    assert collected_until(lambda: set(live_loader_threads()) <= kept)
    it = iter(loader)
    next(it)
    loader.close()
    assert live_loader_threads() == []
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("device", [None, "cpu"])
def test_a_live_iterator_at_interpreter_exit_prints_nothing(make_cache: Any, device: str | None) -> None:
    """A notebook or script that ends with an iterator mid-epoch exits quietly (it printed
    "Exception ignored in: <generator object TokenLoader._iterate ...> AttributeError")."""
    shards, _ = make_cache(small_metadata(n_examples=200, patches_per_shard=400))
    code = (
        "from saev_shards.loaders import ShuffledLoader\n"
        f"loader = ShuffledLoader({str(shards.path)!r}, batch_size=4, layers=6, buffer_bytes=2000, "
        f"block_bytes=200, device={device!r})\n"
        "it = iter(loader)\nnext(it)\nstacked = iter(ShuffledLoader(loader.shards, batch_size=4, stack_layers=True))\n"
        "next(stacked)\nprint('ok')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stdout, run.stderr) == (0, "ok\n", "")


def test_read_errors_reach_the_consumer(make_cache: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    shards, _ = make_cache(small_metadata(n_examples=23))

    def broken(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(shards, "read_range_raw", broken)
    with pytest.raises(OSError, match="disk on fire"):
        list(ShuffledLoader(shards, batch_size=4))
    assert collected_until(lambda: live_loader_threads() == [])


def test_import_without_torch() -> None:
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, Block())
import saev_shards, saev_shards.loaders, saev_shards.datasets
assert "torch" not in sys.modules
try:
    saev_shards.loaders.ShuffledLoader("/nonexistent")
except ImportError as err:
    print("ok", err)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")


def test_epoch_examples_match_the_batches(make_cache: Any) -> None:
    md = small_metadata(n_examples=23)
    lengths = np.arange(23) % (md.tokens_per_ex + 1)
    shards, _ = make_cache(md, labels=True, lengths=lengths)
    loader = ShuffledLoader(
        shards, batch_size=6, seed=2, rank=1, world_size=2, ignore_labels=range(50), buffer_bytes=300, block_bytes=90
    )
    for epoch in (0, 1):
        got = torch.cat([b.examples for b in loader]).numpy()
        np.testing.assert_array_equal(loader.epoch_examples(epoch), got)
        np.testing.assert_array_equal(loader.epoch_examples(epoch, 7), got[:7])


def test_batches_spanning_windows_are_gathered_on_the_pool(make_cache: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch larger than a window is gathered by one ``numpy.take`` per window it touches,
    every one on the gather pool's threads (at most ``gather_threads`` of them), none on the
    consumer's; the batches hold every vector once."""
    import threading

    md = small_metadata(n_examples=700, patches_per_shard=400)  # 5,600 vectors, 50 examples per shard
    shards, logical = make_cache(md, batches=(100,))
    takes: list[str] = []
    real_take: Any = np.take

    def take(a: Any, indices: Any, axis: Any = None, out: Any = None, mode: str = "raise") -> Any:
        if out is not None:  # a batch gather (planning never gathers into an out array)
            takes.append(threading.current_thread().name)
        return real_take(a, indices, axis=axis, out=out, mode=mode)

    monkeypatch.setattr(np, "take", take)
    loader = ShuffledLoader(shards, batch_size=5000, gather_threads=3, buffer_bytes=20_000, block_bytes=2_000)
    assert loader._window_rows < loader.batch_size  # each batch spans several windows
    seen: list[tuple[int, int, int]] = []
    for b in loader:
        seen += check_batch(b, md, logical)
    assert sorted(seen) == sorted(expected_vectors(md))
    assert len(takes) > len(loader)  # one take per window a batch touches: more than one per batch
    assert all(name.startswith("saev-loader-gather") for name in takes), set(takes)
    assert 1 <= len(set(takes)) <= 3


def test_ordered_ranks_split_the_order(make_cache: Any) -> None:
    md = small_metadata(n_examples=11)
    shards, logical = make_cache(md)

    def vectors(loader: loaders.OrderedLoader) -> list[tuple[int, int, int]]:
        return [v for b in loader for v in check_batch(b, md, logical)]

    whole = vectors(OrderedLoader(shards, batch_size=7))
    parts = [vectors(OrderedLoader(shards, batch_size=7, rank=r, world_size=3)) for r in range(3)]
    assert all(parts)
    assert parts[0] + parts[1] + parts[2] == whole == expected_vectors(md)


@pytest.mark.parametrize("cuda", [False, True])
def test_pin_memory_is_taken_only_with_cuda(make_cache: Any, monkeypatch: pytest.MonkeyPatch, cuda: bool) -> None:
    """``pin_memory=True`` allocates every chunk from the pinned allocator when CUDA is there,
    and is ignored without it (as documented): the allocator is never called, batches come
    out whole. CUDA's presence is declared here; the real allocator runs in the GPU test below."""
    from saev_shards.loaders import host_run

    md = small_metadata()
    shards, logical = make_cache(md)
    calls: list[tuple[int, ...]] = []

    def recording_pinned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        calls.append(shape)
        return torch.empty(shape, dtype=dtype)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(host_run, "pinned_empty", recording_pinned)
    for asked in (False, True):
        calls.clear()
        loader = ShuffledLoader(shards, batch_size=16, pin_memory=asked)
        assert loader.pin_memory == (asked and cuda)
        seen = [v for b in loader for v in check_batch(b, md, logical)]
        assert sorted(seen) == sorted(expected_vectors(md))
        assert bool(calls) == (asked and cuda), calls
    # With a device the loader stages in pinned memory itself; pin_memory does not apply there.
    assert not ShuffledLoader(shards, batch_size=16, pin_memory=True, device="cpu").pin_memory


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pinned host memory)")
def test_pin_memory_pins_batches_on_a_gpu_node(make_cache: Any) -> None:
    md = small_metadata()
    shards, logical = make_cache(md)
    loader = ShuffledLoader(shards, batch_size=16, pin_memory=True)
    assert loader.pin_memory
    seen = []
    for batch in loader:
        assert batch.acts.is_pinned()
        seen += check_batch(batch, md, logical)
        moved = batch.to("cuda", non_blocking=True)
        assert torch.equal(moved.acts.cpu(), batch.acts) and moved.labels is None
    assert sorted(seen) == sorted(expected_vectors(md))


def test_batch_to_keeps_the_values(make_cache: Any) -> None:
    md = small_metadata()
    shards, _ = make_cache(md)
    for batch in ShuffledLoader(shards, batch_size=16, out_dtype="float32"):
        moved = batch.to("cpu")
        assert torch.equal(moved.acts, batch.acts) and moved.labels is None
        assert torch.equal(moved.examples, batch.examples) and torch.equal(moved.tokens, batch.tokens)
        assert not batch.acts.is_pinned()


# -- every chosen layer from one read ----------------------------------------------------


@given(strategies.metadata(max_examples=25, min_examples=1), st.data())
def test_stacked_layers_every_token_once(md: ss.Metadata, data: st.DataObject) -> None:
    layers = sorted(data.draw(st.sets(st.sampled_from(md.layers), min_size=1)), key=md.layers.index)
    tokens = data.draw(st.sampled_from(["content", "all", "cls"] if md.cls_token else ["content", "all"]))
    ignore = tuple(data.draw(st.sets(st.integers(0, 255), max_size=100)))
    world_size = data.draw(st.integers(1, 3))
    drop_last = data.draw(st.booleans())
    size = data.draw(st.integers(1, 20))
    lengths = np.array(
        data.draw(st.lists(st.integers(0, md.tokens_per_ex), min_size=md.n_examples, max_size=md.n_examples))
    )
    with cache(md, labels=True, lengths=lengths) as (shards, logical), pytest.MonkeyPatch.context() as mp:
        if data.draw(st.booleans()):
            mp.setattr(loaders.plan, "MIN_SLICE_READ", 0)  # chosen layers read slice by slice
        labels = labels_for(md)
        positions = [md.layers.index(v) for v in layers]
        per_rank: list[list[tuple[int, int]]] = []
        for rank in range(world_size):
            loader = ShuffledLoader(
                shards, batch_size=size, layers=layers, tokens=tokens, ignore_labels=ignore, seed=2, rank=rank,
                world_size=world_size, drop_last=drop_last, buffer_bytes=300, block_bytes=64, stack_layers=True,
            )  # fmt: skip
            rows: list[tuple[int, int]] = []
            batches = list(loader)
            assert len(batches) == len(loader)
            for b in batches:
                ex, tok = b.examples.numpy(), b.tokens.numpy()
                assert b.acts.shape == (len(ex), len(layers), md.d_model)
                assert b.layers.shape == (len(ex), len(layers)) and (b.layers.numpy() == layers).all()
                got = b.acts.view(torch.int16).numpy().view(np.uint16) if md.dtype == "bfloat16" else b.acts.numpy()
                np.testing.assert_array_equal(got, logical[ex[:, None], np.array(positions)[None, :], tok[:, None]])
                assert b.labels is not None
                content = tok >= int(md.cls_token)
                if md.patches_per_ex:
                    want = labels[ex[content], tok[content] - int(md.cls_token)]
                    np.testing.assert_array_equal(b.labels.numpy()[content], want)
                rows += list(zip(ex.tolist(), tok.tolist(), strict=True))
            per_rank.append(rows)
        want = expected_vectors(md, tuple(layers), tokens, ignore, labels, lengths)
        want_rows = sorted({(e, t) for e, _, t in want})
        everything = [r for rows in per_rank for r in rows]
        assert len(set(everything)) == len(everything)  # every (example, token) at most once
        if drop_last:
            assert len({len(r) for r in per_rank}) == 1
            assert set(everything) <= set(want_rows)
            assert len(everything) == world_size * ((len(want_rows) // world_size) // size * size)
        else:
            assert sorted(everything) == want_rows


def test_stacked_one_layer_is_the_unstacked_order(make_cache: Any) -> None:
    shards, _ = make_cache(small_metadata(n_examples=23), labels=True)
    kwargs: dict[str, Any] = dict(batch_size=9, layers=11, seed=5, buffer_bytes=300, block_bytes=64)
    flat = list(ShuffledLoader(shards, **kwargs))
    stacked = list(ShuffledLoader(shards, stack_layers=True, **kwargs))
    assert [b.acts.shape[1:] for b in stacked] == [(1, 8)] * len(flat)
    for a, b in zip(flat, stacked, strict=True):
        assert torch.equal(a.acts, b.acts[:, 0]) and torch.equal(a.examples, b.examples)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.layers, b.layers[:, 0])


def test_stacked_resume_and_fingerprint(make_cache: Any) -> None:
    md = small_metadata(n_examples=23)
    shards, _ = make_cache(md)
    kwargs: dict[str, Any] = dict(batch_size=6, seed=9, buffer_bytes=300, block_bytes=64, stack_layers=True)
    loader = ShuffledLoader(shards, **kwargs)
    whole = keys(list(loader))
    assert len(whole) == -(-23 * 4 // 6)  # one row per (example, content token), not per layer
    loader.set_epoch(0)
    it = iter(loader)
    first = [next(it) for _ in range(5)]
    state = loader.state_dict()
    del it
    resumed = ShuffledLoader(shards, **kwargs)
    resumed.load_state_dict(state)
    assert keys(first) + keys(list(resumed)) == whole
    plain = ShuffledLoader(shards, batch_size=6, seed=9, buffer_bytes=300, block_bytes=64)
    assert plain.fingerprint != loader.fingerprint
    with pytest.raises(LoaderError, match="different cache or settings"):
        plain.load_state_dict(state)


# -- user mistakes: a string for layers, torch missing -----------------------------------


def test_layers_given_as_a_string_is_an_error_that_says_so(make_cache: Any) -> None:
    shards, _ = make_cache(small_metadata())
    value = shards.metadata.layers[0]
    # A string would otherwise be read character by character ("11" -> layers "1", "1").
    for make in (ShuffledLoader, OrderedLoader, loaders.ExampleDataset):
        with pytest.raises(
            LoaderError,
            match=rf"layers: expected a list of layer values such as \[{value}\], found the string '{value}'",
        ):
            make(shards, layers=str(value))  # type: ignore[arg-type]
    assert ShuffledLoader(shards, layers=[value]).layers == (value,)


def test_loaders_without_torch_say_to_install_the_torch_extra(make_cache: Any) -> None:
    shards, _ = make_cache(small_metadata())
    # A fresh interpreter where `import torch` fails, as on an install without the extra:
    # the core library imports, opening works, and each loader names the extra to install.
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import saev_shards as ss\n"
        "from saev_shards.errors import MissingDependencyError\n"
        "from saev_shards.loaders import ShuffledLoader, OrderedLoader, TokenDataset, ExampleDataset\n"
        f"shards = ss.open({str(shards.path)!r})\n"
        "for make in (ShuffledLoader, OrderedLoader, TokenDataset, ExampleDataset):\n"
        "    try:\n"
        "        make(shards)\n"
        "    except MissingDependencyError as err:\n"
        "        print(err)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split(" needs torch")[0] for line in lines] == [
        "ShuffledLoader",
        "OrderedLoader",
        "TokenDataset",
        "ExampleDataset",
    ], proc.stdout
    checkout = Path(ss.__file__).resolve().parents[1]  # an editable install names its checkout
    assert all(line.endswith(f"install it with: pip install -e '{checkout}[torch]'") for line in lines), proc.stdout
