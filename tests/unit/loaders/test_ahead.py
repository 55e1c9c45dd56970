"""The next epoch's first window indexed while the epoch before ends (`loaders.ahead`): the
same batches as an epoch started on its own, whatever comes between two epochs."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from saev_shards import loaders
from saev_shards.loaders import ahead, mapped, windows
from saev_shards.loaders.plan import index_window

from ...support.caches import small_metadata
from ...support.loaders import check_batch

#: A batch's acts (copied), examples, tokens, layers and labels (None without labels).
Fields = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


def fields(batches: list[loaders.Batch]) -> list[Fields]:
    return [(b.acts.clone(), b.examples, b.tokens, b.layers, b.labels) for b in batches]


def assert_same(got: list[Fields], want: list[Fields]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(g[:4], w[:4], strict=True))
        assert (g[4] is w[4] is None) or (g[4] is not None and w[4] is not None and torch.equal(g[4], w[4]))


def alone(make: Callable[[], loaders.TokenLoader], epoch: int) -> list[Fields]:
    """Epoch ``epoch`` of a new loader: nothing computed ahead for it."""
    loader = make()
    loader.set_epoch(epoch)
    try:
        return fields(list(loader))
    finally:
        loader.close()


@pytest.fixture(autouse=True)
def in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """The small caches below read in place, as a page-cached cache of real shards is."""
    monkeypatch.setattr(mapped, "MIN_SHARD_BYTES", 0)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """The windows indexed by a window's load and by the loader ahead of an epoch."""
    seen: dict[str, list[int]] = {"load": [], "ahead": []}

    def counting(kind: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def index(*args: Any, **kwargs: Any) -> Any:
            seen[kind].append(args[2].index)
            return real(*args, **kwargs)

        return index

    monkeypatch.setattr(windows, "index_window", counting("load", index_window))
    monkeypatch.setattr(ahead, "index_window", counting("ahead", index_window))
    return seen


#: Bytes of one (T, D) slice of the caches below (5 tokens x 8 values x 2 bytes).
SLICE = 80
CASES: dict[str, dict[str, Any]] = {
    "shuffled, several windows": {"order": "shuffled", "buffer_bytes": 7 * SLICE},
    "shuffled, one window": {"order": "shuffled", "buffer_bytes": 1 << 30},
    "ordered": {"order": "ordered", "buffer_bytes": 3 * SLICE},
}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="caches are read in place on Linux only")
@pytest.mark.parametrize("read_in_place", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_epochs_back_to_back_give_the_batches_of_epochs_run_alone(
    make_cache: Any, counted: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch, case: str, read_in_place: bool
) -> None:
    if not read_in_place:  # windows read into buffers: nothing is computed ahead
        monkeypatch.setattr(mapped, "MIN_SHARD_BYTES", 1 << 62)
    md = small_metadata(n_examples=23, patches_per_shard=50)
    shards, logical = make_cache(md, labels=True)
    assert md.tokens_per_ex * md.d_model * md.itemsize == SLICE
    options = CASES[case]

    def make() -> loaders.TokenLoader:
        return loaders.TokenLoader(shards, 13, seed=3, block_bytes=1, mix_layers=True, **options)

    loader = make()
    got = []
    for _ in range(3):  # one epoch after the other, as a training loop runs them
        batches = list(loader)
        for batch in batches:
            check_batch(batch, md, logical)
        got.append(fields(batches))
    assert (loader._spares.map is not None) == read_in_place
    loader.close()
    loads, indexed_ahead = list(counted["load"]), list(counted["ahead"])
    for epoch, epoch_fields in enumerate(got):
        assert_same(epoch_fields, alone(make, epoch))
    if read_in_place:  # epochs 1 and 2 took their first window's index from the epoch before
        assert indexed_ahead == [0, 0, 0]  # after each epoch's last window, the next one's first
        assert loads.count(0) == 1  # window 0 indexed by a load in epoch 0 only
    else:
        assert indexed_ahead == [] and loads.count(0) == 3


def test_another_epoch_or_a_resumed_state_drops_what_was_computed_ahead(
    make_cache: Any, counted: dict[str, list[int]]
) -> None:
    md = small_metadata(n_examples=23, patches_per_shard=50)
    shards, _ = make_cache(md, labels=True)

    def make() -> loaders.ShuffledLoader:
        return loaders.ShuffledLoader(shards, 13, seed=5, buffer_bytes=7 * SLICE, block_bytes=1, mix_layers=True)

    loader = make()
    list(loader)  # epoch 0: epoch 1's first window indexed ahead
    loader.set_epoch(4)
    assert_same(fields(list(loader)), alone(make, 4))  # not epoch 1's
    # A state saved part-way through epoch 5 resumes there: the batches still to come.
    saver = make()
    saver.set_epoch(5)
    it = iter(saver)
    for _ in range(3):
        next(it)
    loader.load_state_dict(saver.state_dict())  # epoch 5's first window was indexed ahead: not used
    assert_same(fields(list(loader)), alone(make, 5)[3:])
    assert_same(fields(list(loader)), alone(make, 6))  # and the epoch after it as ever
    loader.close()
    saver.close()


def test_a_closed_loader_keeps_nothing_computed_ahead(make_cache: Any) -> None:
    shards, _ = make_cache(small_metadata(n_examples=23, patches_per_shard=50))
    loader = loaders.OrderedLoader(shards, 13, block_bytes=1, mix_layers=True)
    list(loader)  # epoch 1's first window indexed ahead
    loader.close()
    assert loader._ahead._future is None
    # Iterating again after close starts over, the same batches as a new loader's.
    again = fields(list(loader))
    fresh = loaders.OrderedLoader(shards, 13, block_bytes=1, mix_layers=True)
    fresh.set_epoch(1)
    assert_same(again, fields(list(fresh)))
    loader.close()
    fresh.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork: POSIX only")
def test_a_forked_child_computes_its_own_first_window(make_cache: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child forked after an epoch (a DataLoader worker, say) has none of the parent's threads:
    what they are computing ahead is not waited for there; the child's epoch is the same."""
    shards, _ = make_cache(small_metadata(n_examples=23, patches_per_shard=50))

    def make() -> loaders.ShuffledLoader:
        return loaders.ShuffledLoader(shards, 13, seed=2, buffer_bytes=7 * SLICE, block_bytes=1, mix_layers=True)

    want = [f[1].tolist() for f in alone(make, 1)]
    gate, started = threading.Event(), threading.Event()

    def held(*args: Any, **kwargs: Any) -> Any:  # the parent's work ahead, held until the child is done
        started.set()
        gate.wait()
        return index_window(*args, **kwargs)

    monkeypatch.setattr(ahead, "index_window", held)
    loader = make()
    list(loader)  # epoch 1's first window being indexed ahead on this process's threads
    assert started.wait(30)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: epoch 1, reported through the pipe, then out without cleanup
        signal.alarm(60)  # a child that waits for the parent's threads is killed, not left hanging
        code = 1
        try:
            got = [b.examples.tolist() for b in loader]
            os.write(write, json.dumps(got).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as pipe:
        reported = pipe.read()
    _, status = os.waitpid(pid, 0)
    gate.set()
    assert os.waitstatus_to_exitcode(status) == 0
    assert json.loads(reported) == want
    assert [b.examples.tolist() for b in loader] == want  # and here, with what was computed ahead
    loader.close()
