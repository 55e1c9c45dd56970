"""Helpers shared by the tests: deterministic synthetic caches and reference models of what readers yield."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

import saev_shards as ss
from saev_shards.codecs.bfloat16 import float32_to_bf16
from saev_shards.protocol.common import FLOAT8
from saev_shards.protocol.float8 import FLOAT8_DTYPE


def small_metadata(**changes: Any) -> ss.Metadata:
    """A small cache of this library's protocol: 23 examples of 2 layers x (CLS + 4) tokens x 8
    dims, 5 per shard."""
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
    """Deterministic values of shape (N, L, T, D) as the cache reads them back by default (the
    stored dtype; float16 for float8_e4m3), finite, distinct per position.

    float8_e4m3: E4M3 values times a power of two per vector, each vector holding +-448 once,
    so that the rule quantizes them exactly (scale the power of two) and reads give them back.
    """
    rng = np.random.default_rng(seed)
    if md.dtype == FLOAT8:
        codes = rng.integers(0, 256, md.shape, dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0  # no NaN
        values = codes.view(FLOAT8_DTYPE).astype(np.float32)
        at = rng.integers(0, md.d_model, md.shape[:3]) if md.d_model else None
        if at is not None:
            np.put_along_axis(values, at[..., None], np.where(at % 2 == 0, 448.0, -448.0)[..., None], axis=-1)
        scales = 2.0 ** rng.integers(-3, 3, md.shape[:3])
        exact: npt.NDArray[np.float16] = (values * scales[..., None]).astype(np.float16)
        return exact
    values = rng.standard_normal(md.shape, dtype=np.float32) * 4
    if md.dtype == "bfloat16":
        return float32_to_bf16(values)
    return values.astype(md.numpy_dtype)


def float_input(md: ss.Metadata, logical: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """Writer input that casts (quantizes) exactly to ``logical`` (bfloat16 bits widened to float32)."""
    if md.dtype == "bfloat16":
        return ss.bf16_to_float32(logical)
    if md.dtype == FLOAT8:
        return logical.astype(np.float32)
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


def colliding_metadata(digits: int = 4) -> tuple[ss.Metadata, ss.Metadata]:
    """Two small configurations whose hashes share their first ``digits`` hex digits."""
    seen: dict[str, ss.Metadata] = {}
    for i in range(100_000):
        md = small_metadata(n_examples=3, data={"name": "synthetic", "i": i})
        other = seen.setdefault(md.hash[:digits], md)
        if other is not md:
            return other, md
    raise AssertionError("no collision found")


def writable_copy(src: Path, dest_root: Path, name: str | None = None) -> Path:
    """A writable copy of a published cache (to break it on purpose)."""
    dest = dest_root / (name or src.name)
    shutil.copytree(src, dest)
    os.chmod(dest, 0o755)
    for p in dest.iterdir():
        os.chmod(p, 0o644)
    return dest


def expected_vectors(
    md: ss.Metadata,
    layers: tuple[int, ...] | None = None,
    tokens: str = "content",
    ignore: tuple[int, ...] = (),
    labels: np.ndarray[Any, Any] | None = None,
    lengths: np.ndarray[Any, Any] | None = None,
    skip_padding: bool = True,
) -> list[tuple[int, int, int]]:
    """Every chosen ``(example, layer value, token)``, in ``(example, layer position, token)`` order."""
    chosen = [v for v in md.layers if layers is None or v in layers]
    out = []
    cls = int(md.cls_token)
    for e in range(md.n_examples):
        for layer in chosen:
            for t in range(md.tokens_per_ex):
                is_cls = md.cls_token and t == 0
                if tokens == "content" and is_cls:
                    continue
                if tokens == "cls" and not is_cls:
                    continue
                if not is_cls and ignore and labels is not None and labels[e, t - cls] in ignore:
                    continue
                if skip_padding and lengths is not None and t >= lengths[e]:
                    continue
                out.append((e, layer, t))
    return out
