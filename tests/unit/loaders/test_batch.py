"""loaders.batch: a batch's length is its rows, and `Batch.to` moves every tensor (labels only
when there are some) without changing a value."""

from __future__ import annotations

import torch

from saev_shards.loaders import Batch
from saev_shards.loaders.batch import Batch as Home


def batch(labels: bool, stacked: bool = False) -> Batch:
    n, d = 5, 3
    shape = (n, 2, d) if stacked else (n, d)
    return Batch(
        acts=torch.arange(n * d * (2 if stacked else 1), dtype=torch.float16).reshape(shape),
        examples=torch.arange(n, dtype=torch.int64),
        tokens=torch.arange(n, dtype=torch.int64) % 2,
        layers=torch.full((n, 2) if stacked else (n,), 6, dtype=torch.int64),
        labels=torch.arange(n, dtype=torch.uint8) if labels else None,
    )


def test_a_batchs_length_is_its_rows() -> None:
    assert Batch is Home
    assert len(batch(labels=False)) == 5 and len(batch(labels=True, stacked=True)) == 5


def test_to_moves_every_tensor_and_keeps_its_values() -> None:
    for labels in (False, True):
        original = batch(labels)
        moved = original.to("meta")
        tensors = [moved.acts, moved.examples, moved.tokens, moved.layers]
        assert all(t.device.type == "meta" for t in tensors)
        assert (moved.labels is None) == (not labels)
        if labels:
            assert moved.labels is not None and moved.labels.device.type == "meta"
        back = original.to("cpu", non_blocking=True)
        for name in ("acts", "examples", "tokens", "layers", "labels"):
            a, b = getattr(original, name), getattr(back, name)
            assert (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b)), name
        assert [t.dtype for t in tensors] == [torch.float16, torch.int64, torch.int64, torch.int64]
