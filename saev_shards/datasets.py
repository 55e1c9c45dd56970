"""Kept for imports written before the loaders became a package: the map-style datasets and the
token selection now live in `saev_shards.loaders` (``datasets`` and ``selection``)."""

from .loaders.datasets import ExampleDataset, LayerPairDataset, TokenDataset
from .loaders.selection import (
    CLS_LABEL,
    OUT_DTYPES,
    TOKEN_CHOICES,
    TokenSelection,
    as_shards,
    parse_layers,
    parse_out_dtype,
)
from .loaders.tensors import to_tensor, torch_dtype

__all__ = [
    "CLS_LABEL",
    "OUT_DTYPES",
    "TOKEN_CHOICES",
    "ExampleDataset",
    "LayerPairDataset",
    "TokenDataset",
    "TokenSelection",
    "as_shards",
    "parse_layers",
    "parse_out_dtype",
    "to_tensor",
    "torch_dtype",
]
