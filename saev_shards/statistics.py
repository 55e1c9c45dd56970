"""The statistics accumulator: per-layer sums over every token of a cache, in an order that
depends only on the data (protocol.md section 2.6).

The writer sums each shard as it writes it (`saev_shards.writer.stats`) and `finalize`
adds the shards' sums in shard order; the store sums a published cache the same way for
the stats sidecar (`saev_shards.store.sidecar`). Both use `StatsAccumulator`, so a
sidecar holds exactly what the writer would have written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .codecs import dtypes

#: Examples per step of the statistics pass (bounds its float32 scratch memory).
STATS_CHUNK = 8


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
        ``scales`` (B, L, T), dequantized to float32); padding excluded by ``lengths``."""
        n_tokens = acts.shape[2]
        positions = np.arange(n_tokens)
        for start in range(0, acts.shape[0], STATS_CHUNK):
            block = acts[start : start + STATS_CHUNK]
            block_scales = None if scales is None else scales[start : start + STATS_CHUNK]
            has_nonfinite = dtypes.nonfinite_mask_any(block, dtype)
            for li in range(block.shape[1]):
                # (b, T, D) float32
                x = dtypes.to_float32(block[:, li], dtype, None if block_scales is None else block_scales[:, li])
                for b in range(block.shape[0]):  # one example at a time: fixed shapes, fixed order
                    xb = x[b]  # (T, D)
                    valid = None
                    if lengths is not None:
                        valid = positions < lengths[start + b]
                    if has_nonfinite:
                        finite = np.isfinite(xb).all(axis=1)
                        self.nonfinite[li] += int(np.count_nonzero(~finite if valid is None else valid & ~finite))
                        valid = finite if valid is None else valid & finite
                    if valid is not None:
                        xb = np.where(valid[:, None], xb, np.float32(0))
                        self.count[li] += int(np.count_nonzero(valid))
                    else:
                        self.count[li] += n_tokens
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
