"""`Batch`: one batch of token vectors and where each came from."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass
class Batch:
    """One batch of token vectors and where each came from.

    With ``stack_layers=True`` a row is one ``(example, token)`` at every chosen layer:
    ``acts`` is ``(B, L, D)`` and ``layers`` ``(B, L)`` (the same values on every row).
    """

    #: ``(B, D)`` activations (stored dtype, or the loader's ``out_dtype``); ``(B, L, D)`` stacked.
    acts: torch.Tensor
    #: ``(B,)`` int64 example indices.
    examples: torch.Tensor
    #: ``(B,)`` int64 positions on the T axis (0 is CLS when the cache has one).
    tokens: torch.Tensor
    #: ``(B,)`` int64 layer values (not positions); ``(B, L)`` stacked.
    layers: torch.Tensor
    #: ``(B,)`` uint8 patch labels (`CLS_LABEL` for CLS tokens), or None without labels.bin.
    labels: torch.Tensor | None

    def __len__(self) -> int:
        return int(self.acts.shape[0])

    def to(self, device: Any, non_blocking: bool = False) -> Batch:
        """The same batch on ``device`` (use ``non_blocking`` with ``pin_memory=True``)."""
        labels = None if self.labels is None else self.labels.to(device, non_blocking=non_blocking)
        return Batch(
            self.acts.to(device, non_blocking=non_blocking),
            self.examples.to(device, non_blocking=non_blocking),
            self.tokens.to(device, non_blocking=non_blocking),
            self.layers.to(device, non_blocking=non_blocking),
            labels,
        )
