"""loaders.host_run: one epoch on the host. With pin_memory every batch is gathered into
memory from the one pinned allocator, cast there when ``out_dtype`` asks, and every token of
every layer comes once."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from saev_shards import loaders
from saev_shards.loaders import host_run
from saev_shards.loaders.tensors import torch_dtype

from ...support.caches import expected_vectors, small_metadata
from ...support.loaders import check_batch

# The cache has two layers: a batch mixes them on purpose (mix_layers=True; the loaders refuse
# that unless told: test_mixed_layers_are_refused).


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
    loader = loaders.ShuffledLoader(
        shards, mix_layers=True, batch_size=300, pin_memory=True, out_dtype=out_dtype, buffer_bytes=20_000
    )
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
