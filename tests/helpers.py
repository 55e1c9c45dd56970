"""Helpers shared by the tests: deterministic synthetic caches."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

import saev_shards as ss
from saev_shards.dtypes import float32_to_bf16


def small_metadata(**changes: Any) -> ss.Metadata:
    """A small 3.0 cache: 23 examples of 2 layers x (CLS + 4) tokens x 8 dims, 5 per shard."""
    fields: dict[str, Any] = dict(
        family="clip",
        ckpt="test/ckpt",
        layers=(6, 11),
        patches_per_ex=4,
        cls_token=True,
        d_model=8,
        n_examples=23,
        patches_per_shard=50,
        data={"name": "synthetic"},
        dataset="/data/synthetic",
        dtype="float16",
    )
    fields.update(changes)
    return ss.Metadata(**fields)


def logical_tensor(md: ss.Metadata, seed: int = 0) -> npt.NDArray[Any]:
    """Deterministic stored-dtype values of shape (N, L, T, D), finite, distinct per position."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(md.shape, dtype=np.float32) * 4
    if md.dtype == "bfloat16":
        return float32_to_bf16(values)
    return values.astype(md.numpy_dtype)


def float_input(md: ss.Metadata, logical: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """Writer input that casts exactly to ``logical`` (bfloat16 bits widened to float32)."""
    if md.dtype == "bfloat16":
        return ss.bf16_to_float32(logical)
    return logical


def split(n: int, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Cut range(n) into consecutive batches of the given sizes (cycled), ``(start, stop)`` pairs."""
    out = []
    start = 0
    i = 0
    while start < n:
        size = max(1, sizes[i % len(sizes)]) if sizes else n
        out.append((start, min(n, start + size)))
        start += size
        i += 1
    return out


def labels_for(md: ss.Metadata, seed: int = 1) -> npt.NDArray[np.uint8]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (md.n_examples, md.patches_per_ex), dtype=np.uint8)


def write_cache(
    root: Path,
    md: ss.Metadata,
    *,
    batches: Sequence[int] = (7,),
    seed: int = 0,
    labels: bool = False,
    lengths: npt.NDArray[Any] | None = None,
    text: bool = False,
    **writer_kwargs: Any,
) -> npt.NDArray[Any]:
    """Write ``md``'s synthetic cache under ``root`` in the given batch sizes; returns the logical tensor."""
    logical = logical_tensor(md, seed)
    source = float_input(md, logical)
    lab = labels_for(md) if labels else None
    writer_kwargs.setdefault("durable", False)
    with ss.ShardWriter(root, md, **writer_kwargs) as w:
        for a, b in split(md.n_examples, batches):
            w.write(
                source[a:b],
                labels=None if lab is None else lab[a:b],
                columns=None if lengths is None else {"lengths": lengths[a:b]},
                text={"prompt": [f"example {i}: é" for i in range(a, b)]} if text else None,
            )
    return logical


def tree_bytes(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` by relative name, for byte-identity checks."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
