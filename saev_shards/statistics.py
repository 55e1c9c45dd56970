"""The statistics accumulator: per-layer sums over every token of a cache, in an order that
depends only on the data (protocol.md section 2.6).

The writer sums each shard as it writes it (`saev_shards.writer.stats`) and `finalize`
adds the shards' sums in shard order; the store sums a published cache the same way for
the stats sidecar (`saev_shards.store.sidecar`). Both use `StatsAccumulator`, so a
sidecar holds exactly what the writer would have written.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .codecs import dtypes

#: Examples per step of the statistics pass (bounds its float32 scratch memory).
STATS_CHUNK = 8
#: Examples summed at once inside `example_sums`: few, so the float32 scratch stays in the
#: CPU's cache (measured here: 2 examples of 64 x 384 beat 8 by a third).
_STEP = 2


#: Elements per torch cast in `_fresh_float32`: below torch's parallel grain size (32,768), so
#: each cast runs on the calling thread (the statistics run in threads of their own; torch's
#: intra-op threads would add to them and to the model's).
_TORCH_PIECE = 16_384


def _fresh_float32(raw: npt.NDArray[Any], dtype: str, scales: npt.NDArray[Any] | None) -> npt.NDArray[np.float32]:
    """`dtypes.to_float32` of finite stored values, always into a fresh C-contiguous array.

    float16 widens with torch's vectorised cast when torch is imported (about 3x numpy's
    here); widening float16 is exact, so both give the same values for every finite input
    (they differ only in the payload bits of a signalling NaN, never summed: chunks holding
    inf or NaN are summed one example at a time, `_sums_one_by_one`).
    """
    torch = sys.modules.get("torch")
    if dtype == "float16" and torch is not None:
        src = torch.from_numpy(np.ascontiguousarray(raw)).reshape(-1)
        out = np.empty(raw.shape, np.float32)
        dest = torch.from_numpy(out.reshape(-1))
        for a in range(0, len(src), _TORCH_PIECE):
            dest[a : a + _TORCH_PIECE].copy_(src[a : a + _TORCH_PIECE])
        return out
    x = dtypes.to_float32(raw, dtype, scales)
    if np.may_share_memory(x, raw) or not x.flags.c_contiguous:
        x = np.array(x, np.float32, order="C")
    return x


@dataclasses.dataclass
class ExampleSums:
    """Each example's sums over its tokens, per layer, for some consecutive examples: what
    `StatsAccumulator.add_sums` adds into the totals, in example order (`example_sums`)."""

    #: Per layer: tokens counted, and non-finite tokens left out (integers: order-free).
    count: list[int]
    nonfinite: list[int]
    #: Per layer, ``(b, D)`` float32: each example's sum of its valid tokens, and of their squares.
    sums: list[npt.NDArray[np.float32]]
    sums_sq: list[npt.NDArray[np.float32]]
    #: Per layer, per example: the sum of its tokens' norms, and of their squared norms (float64).
    norm_sums: list[list[float]]
    norm_sq_sums: list[list[float]]


def example_sums(
    acts: npt.NDArray[Any],
    dtype: str,
    lengths: npt.NDArray[Any] | None,
    scales: npt.NDArray[Any] | None = None,
) -> list[ExampleSums]:
    """The sums of every example of ``acts`` (as `StatsAccumulator.update` takes them), one
    `ExampleSums` per step of a few examples.

    Each example's float32 sums are reduced along the same axes in the same order whatever
    else is in the array (numpy's sum along an axis does not depend on the other axes), so
    they are the same bits for any batching, and any split of a batch between threads.
    """
    out = []
    step = max(1, min(_STEP, (1 << 16) // max(1, math.prod(acts.shape[2:]))))
    for start in range(0, acts.shape[0], step):
        block = acts[start : start + step]
        block_scales = None if scales is None else scales[start : start + step]
        block_lengths = None if lengths is None else lengths[start : start + step]
        if dtypes.nonfinite_mask_any(block, dtype):
            out.append(_sums_one_by_one(block, dtype, block_lengths, block_scales))
        else:
            out.append(_sums_finite(block, dtype, block_lengths, block_scales))
    return out


def _sums_finite(
    block: npt.NDArray[Any], dtype: str, lengths: npt.NDArray[Any] | None, scales: npt.NDArray[Any] | None
) -> ExampleSums:
    """`example_sums` of a chunk of finite values, all its examples at once."""
    n_tokens = block.shape[2]
    kept = None if lengths is None else np.clip(np.asarray(lengths), 0, n_tokens).tolist()
    sums = ExampleSums([], [], [], [], [], [])
    for li in range(block.shape[1]):
        # (b, T, D) float32, a fresh array: padding is zeroed in place
        x = _fresh_float32(block[:, li], dtype, None if scales is None else scales[:, li])
        if kept is not None:
            for b, n in enumerate(kept):
                x[b, n:] = 0
        sums.count.append(block.shape[0] * n_tokens if kept is None else sum(kept))
        sums.nonfinite.append(0)
        sq = x * x
        norms_sq = sq.sum(axis=2)  # (b, T): each token's, as (T, D).sum(axis=1) gives it
        sums.sums.append(x.sum(axis=1))  # (b, D): each example's, as (T, D).sum(axis=0) gives it
        sums.sums_sq.append(sq.sum(axis=1))
        sums.norm_sums.append(np.sqrt(norms_sq).sum(axis=1, dtype=np.float64).tolist())
        sums.norm_sq_sums.append(norms_sq.sum(axis=1, dtype=np.float64).tolist())
    return sums


def _sums_one_by_one(
    block: npt.NDArray[Any], dtype: str, lengths: npt.NDArray[Any] | None, scales: npt.NDArray[Any] | None
) -> ExampleSums:
    """`example_sums` of a chunk holding inf or NaN: one example at a time, the tokens holding
    them counted and left out."""
    n_tokens = block.shape[2]
    positions = np.arange(n_tokens)
    sums = ExampleSums([], [], [], [], [], [])
    for li in range(block.shape[1]):
        x = dtypes.to_float32(block[:, li], dtype, None if scales is None else scales[:, li])  # (b, T, D)
        count = nonfinite = 0
        layer_sums, layer_sq, norm_sums, norm_sq_sums = [], [], [], []
        for b in range(block.shape[0]):  # one example at a time: fixed shapes, fixed order
            xb = x[b]  # (T, D)
            finite = np.isfinite(xb).all(axis=1)
            valid = None if lengths is None else positions < lengths[b]
            nonfinite += int(np.count_nonzero(~finite if valid is None else valid & ~finite))
            valid = finite if valid is None else valid & finite
            xb = np.where(valid[:, None], xb, np.float32(0))
            count += int(np.count_nonzero(valid))
            sq = xb * xb
            norms_sq = sq.sum(axis=1)  # (T,)
            layer_sums.append(xb.sum(axis=0))
            layer_sq.append(sq.sum(axis=0))
            norm_sums.append(float(np.sqrt(norms_sq).sum(dtype=np.float64)))
            norm_sq_sums.append(float(norms_sq.sum(dtype=np.float64)))
        sums.count.append(count)
        sums.nonfinite.append(nonfinite)
        sums.sums.append(np.stack(layer_sums))
        sums.sums_sq.append(np.stack(layer_sq))
        sums.norm_sums.append(norm_sums)
        sums.norm_sq_sums.append(norm_sq_sums)
    return sums


class StatsAccumulator:
    """Per-layer sums over the tokens of one shard, accumulated example by example.

    The order of every floating-point addition depends only on the data, never on how
    it was batched, so the sums (and the cache) are byte-identical for any batching.
    """

    def __init__(self, n_layers: int, d_model: int) -> None:
        self.sum = np.zeros((n_layers, d_model), np.float64)
        self.sum_sq = np.zeros((n_layers, d_model), np.float64)
        self.count = np.zeros(n_layers, np.int64)
        self.norm_sum = np.zeros(n_layers, np.float64)
        self.norm_sq_sum = np.zeros(n_layers, np.float64)
        self.nonfinite = np.zeros(n_layers, np.int64)

    def update(
        self,
        acts: npt.NDArray[Any],
        dtype: str,
        lengths: npt.NDArray[Any] | None,
        scales: npt.NDArray[Any] | None = None,
    ) -> None:
        """Add the tokens of ``acts`` (stored dtype, shape (B, L, T, D); float8_e4m3 with its
        ``scales`` (B, L, T), dequantized to float32); padding excluded by ``lengths``, tokens
        holding inf or NaN counted in ``nonfinite`` and left out.

        Each example's float32 sums over its tokens (`example_sums`) go into the float64
        totals one example after the other (`add_sums`), as when the examples were summed one
        at a time: the same bits for any batching, and for the sums computed in several threads.
        """
        self.add_sums(example_sums(acts, dtype, lengths, scales))

    def add_sums(self, chunks: list[ExampleSums]) -> None:
        """Add `example_sums` into the totals, in example order (call in the examples' order)."""
        for chunk in chunks:
            for li in range(len(chunk.count)):
                self.count[li] += chunk.count[li]
                self.nonfinite[li] += chunk.nonfinite[li]
                total, total_sq = self.sum[li], self.sum_sq[li]
                for b in range(len(chunk.norm_sums[li])):
                    total += chunk.sums[li][b]
                    total_sq += chunk.sums_sq[li][b]
                    self.norm_sum[li] += chunk.norm_sums[li][b]
                    self.norm_sq_sum[li] += chunk.norm_sq_sums[li][b]

    def to_json(self) -> dict[str, Any]:
        return {
            "sum": self.sum.tolist(),
            "sum_sq": self.sum_sq.tolist(),
            "count": self.count.tolist(),
            "norm_sum": self.norm_sum.tolist(),
            "norm_sq_sum": self.norm_sq_sum.tolist(),
            "nonfinite": self.nonfinite.tolist(),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any], n_layers: int, d_model: int) -> StatsAccumulator:
        s = cls(n_layers, d_model)
        s.sum[:] = d["sum"]
        s.sum_sq[:] = d["sum_sq"]
        s.count[:] = d["count"]
        s.norm_sum[:] = d["norm_sum"]
        s.norm_sq_sum[:] = d["norm_sq_sum"]
        s.nonfinite[:] = d["nonfinite"]
        return s

    def add(self, other: StatsAccumulator) -> None:
        self.sum += other.sum
        self.sum_sq += other.sum_sq
        self.count += other.count
        self.norm_sum += other.norm_sum
        self.norm_sq_sum += other.norm_sq_sum
        self.nonfinite += other.nonfinite

    def summary(self, layers: Sequence[int]) -> dict[str, Any]:
        """The stats.json object (protocol.md section 2.6)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            n = self.count.astype(np.float64)
            mean = self.sum / n[:, None]
            var = np.maximum(self.sum_sq / n[:, None] - mean * mean, 0.0)
            norm_mean = self.norm_sum / n
            norm_sq_mean = self.norm_sq_sum / n
        empty = self.count == 0
        mean[empty] = 0.0
        var[empty] = 0.0
        norm_mean[empty] = 0.0
        norm_sq_mean[empty] = 0.0
        return {
            "layers": list(layers),
            "count": self.count.tolist(),
            "nonfinite": self.nonfinite.tolist(),
            "mean": mean.tolist(),
            "var": var.tolist(),
            "norm_mean": norm_mean.tolist(),
            "norm_sq_mean": norm_sq_mean.tolist(),
        }
