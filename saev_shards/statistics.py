"""The statistics accumulator: per-layer sums over every token of a cache, in an order that
depends only on the data (protocol.md section 2.6).

The writer sums each shard as it writes it (`saev_shards.writer.stats`) and `finalize`
adds the shards' sums in shard order; the store sums a published cache the same way for
the stats sidecar (`saev_shards.store.sidecar`). Both use `StatsAccumulator`, so a
sidecar holds exactly what the writer would have written.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from . import dtypes

#: Examples per step of the statistics pass (bounds its float32 scratch memory).
STATS_CHUNK = 8


def _fresh_float32(raw: npt.NDArray[Any], dtype: str, scales: npt.NDArray[Any] | None) -> npt.NDArray[np.float32]:
    """`dtypes.to_float32` of finite stored values, always into a fresh C-contiguous array.

    float16 widens with torch's vectorised cast when torch is imported (about 3x numpy's
    here); widening float16 is exact, so both give the same values for every finite input
    (they differ only in the payload bits of a signalling NaN, never summed: chunks holding
    inf or NaN take `StatsAccumulator._update_one_by_one`).
    """
    torch = sys.modules.get("torch")
    if dtype == "float16" and torch is not None:
        return np.asarray(torch.from_numpy(np.ascontiguousarray(raw)).to(torch.float32).numpy())
    x = dtypes.to_float32(raw, dtype, scales)
    if np.may_share_memory(x, raw) or not x.flags.c_contiguous:
        x = np.array(x, np.float32, order="C")
    return x


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
        ``scales`` (B, L, T), dequantized to float32); padding excluded by ``lengths``.

        Each step takes `STATS_CHUNK` examples at once, but adds exactly as one example at a
        time would (`_update_one_by_one`, which chunks holding inf or NaN still go through):
        each example's float32 sums over its tokens are reduced along the same axes in the
        same order (numpy's sum along an axis does not depend on the other axes), then added
        to the float64 totals example by example. So the sums are the same bits as before,
        and the same for any batching.
        """
        for start in range(0, acts.shape[0], STATS_CHUNK):
            block = acts[start : start + STATS_CHUNK]
            block_scales = None if scales is None else scales[start : start + STATS_CHUNK]
            block_lengths = None if lengths is None else lengths[start : start + STATS_CHUNK]
            if dtypes.nonfinite_mask_any(block, dtype):
                self._update_one_by_one(block, dtype, block_lengths, block_scales)
                continue
            n_tokens = block.shape[2]
            kept = None if block_lengths is None else np.minimum(np.asarray(block_lengths), n_tokens).tolist()
            for li in range(block.shape[1]):
                # (b, T, D) float32, a fresh array: padding is zeroed in place
                x = _fresh_float32(block[:, li], dtype, None if block_scales is None else block_scales[:, li])
                if kept is not None:
                    for b, n in enumerate(kept):
                        x[b, max(n, 0) :] = 0
                    self.count[li] += sum(max(n, 0) for n in kept)
                else:
                    self.count[li] += block.shape[0] * n_tokens
                sq = x * x
                norms_sq = sq.sum(axis=2)  # (b, T): each token's, as (T, D).sum(axis=1) gives it
                sums, sums_sq = x.sum(axis=1), sq.sum(axis=1)  # (b, D) float32, each example's
                norm_sums = np.sqrt(norms_sq).sum(axis=1, dtype=np.float64).tolist()
                norm_sq_sums = norms_sq.sum(axis=1, dtype=np.float64).tolist()
                for b in range(block.shape[0]):  # into the float64 totals in example order
                    self.sum[li] += sums[b]
                    self.sum_sq[li] += sums_sq[b]
                    self.norm_sum[li] += norm_sums[b]
                    self.norm_sq_sum[li] += norm_sq_sums[b]

    def _update_one_by_one(
        self,
        block: npt.NDArray[Any],
        dtype: str,
        lengths: npt.NDArray[Any] | None,
        scales: npt.NDArray[Any] | None,
    ) -> None:
        """`update` of one chunk, one example at a time, counting non-finite tokens (excluded)."""
        n_tokens = block.shape[2]
        positions = np.arange(n_tokens)
        for li in range(block.shape[1]):
            x = dtypes.to_float32(block[:, li], dtype, None if scales is None else scales[:, li])  # (b, T, D)
            for b in range(block.shape[0]):  # one example at a time: fixed shapes, fixed order
                xb = x[b]  # (T, D)
                finite = np.isfinite(xb).all(axis=1)
                valid = None if lengths is None else positions < lengths[b]
                self.nonfinite[li] += int(np.count_nonzero(~finite if valid is None else valid & ~finite))
                valid = finite if valid is None else valid & finite
                xb = np.where(valid[:, None], xb, np.float32(0))
                self.count[li] += int(np.count_nonzero(valid))
                sq = xb * xb
                norms_sq = sq.sum(axis=1)  # (T,)
                self.sum[li] += xb.sum(axis=0)
                self.sum_sq[li] += sq.sum(axis=0)
                self.norm_sum[li] += float(np.sqrt(norms_sq).sum(dtype=np.float64))
                self.norm_sq_sum[li] += float(norms_sq.sum(dtype=np.float64))

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
