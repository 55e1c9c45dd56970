"""The loaders' compiled window indexes (`saev_shards.codecs.gather`) against the numpy code they
replace: the same index columns for any window, selection and order, and so the same batches
(test_exact_batches.py pins those; tests/unit/codecs/test_gather.py tests the kernels alone)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import saev_shards as ss
from saev_shards import loaders
from saev_shards.codecs import gather
from saev_shards.loaders.plan import ReadSpans, index_window

from ...support.caches import small_metadata, write_cache

pytestmark = pytest.mark.skipif(not gather.kernels_in_use(), reason="numba (the `fast` extra) is not installed")


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ss.Shards]:
    md = small_metadata(n_examples=60, patches_per_ex=16, d_model=8, patches_per_shard=25 * 16)
    lengths = np.random.default_rng(3).integers(0, 18, md.n_examples).astype(np.int32)
    root = tmp_path_factory.mktemp("compiled")
    write_cache(root, md, batches=(7,), labels=True, lengths=lengths)
    opened = ss.open(root / md.hash)
    yield opened
    opened.close()


def _index(shards: ss.Shards, options: dict[str, Any], block: int, window: int, seed: int, mapped: bool) -> Any:
    loader = loaders.TokenLoader(shards, batch_size=5, seed=seed, block_bytes=block, buffer_bytes=window, **options)
    try:
        spans = ReadSpans(shards, loader.selection, block, bool(options.get("stack_layers")))
        plan = loader.plan(0)
        source = None
        if mapped:  # where the rows of a window are when it is read in place: anywhere in a bigger array

            def source(examples: Any, spans: ReadSpans) -> tuple[Any, Any]:
                return examples * 1000 + 17, np.arange(spans.rows_per_ex, dtype=np.int64) * 31

        found = []
        for w in plan.windows:
            rng = loader._window_rng(0, w.index)
            found.append(index_window(loader.selection, spans, w, rng, source))
        return found
    finally:
        loader.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    layers=st.sampled_from([11, [6], [6, 11], None]),
    stack=st.booleans(),
    tokens=st.sampled_from(["content", "all", "cls"]),
    skip_padding=st.booleans(),
    ignore=st.sampled_from([(), (3, 5)]),
    order=st.sampled_from(["shuffled", "ordered"]),
    rank=st.sampled_from([(0, 1), (1, 3)]),
    block=st.integers(1_000, 20_000),
    window=st.integers(2_000, 60_000),
    seed=st.integers(0, 2**31),
    mapped=st.booleans(),
)
def test_window_index_matches_numpy(
    shards: ss.Shards,
    layers: Any,
    stack: bool,
    tokens: str,
    skip_padding: bool,
    ignore: tuple[int, ...],
    order: str,
    rank: tuple[int, int],
    block: int,
    window: int,
    seed: int,
    mapped: bool,
) -> None:
    """Every window of an epoch, for selections whose tokens are the same in every example (the
    units' numbers) and those that differ (listed units: lengths, ignored labels), stacked or not,
    shuffled or in order, trimmed to a rank's share, in a window buffer or read in place."""
    options: dict[str, Any] = {"tokens": tokens, "skip_padding": skip_padding, "ignore_labels": ignore, "order": order}
    options["rank"], options["world_size"] = rank
    if layers is not None:
        options["layers"] = layers
    options["stack_layers" if stack else "mix_layers"] = True
    compiled = _index(shards, options, block, window, seed, mapped)
    with gather.numpy_only():
        expected = _index(shards, options, block, window, seed, mapped)
    assert len(compiled) == len(expected)
    for got, want in zip(compiled, expected, strict=True):
        for name in ("flat", "examples", "tokens", "layers", "labels"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert a.dtype == b.dtype and np.array_equal(a, b), name
