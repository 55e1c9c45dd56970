"""Vector norms of a cache: the exact median norm per layer and the vectors far above it.

What ``max_norm_multiple=k`` drops (the loaders, `saev-shards shuffle`) is defined here:

* The *norm* of a vector is ``sqrt(sum(x * x))`` computed in float32 from its value read
  as float32 (float16 and bfloat16 widened exactly, float8_e4m3 times its scale); a vector
  holding a non-finite value has norm ``+inf``.
* The *population* of a layer is the one stats.json describes (protocol.md 2.6): every
  position ``< lengths[i]`` where the cache has a ``lengths`` column (every position
  otherwise), [CLS] included, non-finite vectors left out.
* The *median norm* of a layer is the exact lower median of its population's norms: the
  value of rank ``(n - 1) // 2`` (from 0) in ascending order, a float32. It is found in two
  sequential passes with bounded memory: the norms' float32 bit patterns (ordered like the
  values, since norms are never negative) are counted by their high 16 bits, which finds
  the 65,536-wide bucket holding the median, then by their low 16 bits within that bucket.
  Deterministic, independent of batching, and cached per cache for the process.
* A token ``(example, position)`` is dropped when its vector at any chosen layer has a norm
  strictly above ``k`` times that layer's median norm (with one chosen layer: the vector),
  or is not finite: a non-finite vector is dropped whatever the median, even in a layer
  that has no finite vector (whose median is NaN).

The dropped tokens are kept as a bit per ``(example, position)``: ``N * T / 8`` bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..errors import ShardsError
from ..progress import Progress
from ..protocol.jsonfile import short_repr

if TYPE_CHECKING:
    from .shards import Shards

#: Bytes read per step of a pass (bounds its memory: the block and its float32 norms).
PASS_BYTES = 32 << 20
_BUCKETS = 1 << 16

#: (cache path, hash) -> median norm per recorded layer, float32 (L,): computed once per process.
_MEDIANS: dict[tuple[str, str], npt.NDArray[np.float32]] = {}


def _blocks(shards: Shards, what: str, progress: bool | None) -> Iterator[tuple[int, npt.NDArray[np.float32]]]:
    """``(start, norms)`` for consecutive runs of examples (see `vector_blocks`)."""
    for start, _, norms in vector_blocks(shards, what, progress):
        yield start, norms


def vector_blocks(
    shards: Shards, what: str, progress: bool | None
) -> Iterator[tuple[int, npt.NDArray[np.float32], npt.NDArray[np.float32]]]:
    """``(start, x, norms)`` for consecutive runs of examples, reading the cache once in order
    with bounded memory (`PASS_BYTES` a step): ``x`` float32 ``(b, L, T, D)``, norms float32
    ``(b, L, T)``, +inf where a vector holds a non-finite value, NaN outside the population
    (padding)."""
    md = shards.metadata
    per_example = max(1, md.example_nbytes)
    step = max(1, PASS_BYTES // per_example)
    lengths = np.asarray(shards.columns["lengths"]) if "lengths" in shards.manifest.columns else None
    positions = np.arange(md.tokens_per_ex)
    with Progress(md.nbytes, what, enabled=progress) as bar:
        for start in range(0, md.n_examples, step):
            stop = min(md.n_examples, start + step)
            x = shards.read_range(start, stop, dtype="float32")  # (b, L, T, D), float8 dequantized
            with np.errstate(over="ignore", invalid="ignore"):
                norms = np.sqrt((x * x).sum(axis=3, dtype=np.float32))  # one fixed order per vector
            norms[~np.isfinite(x).all(axis=3)] = np.inf
            if lengths is not None:
                outside = positions[None, :] >= lengths[start:stop, None]
                norms[np.broadcast_to(outside[:, None, :], norms.shape)] = np.nan
            bar.update((stop - start) * per_example)
            yield start, x, norms


def _in_population(norms: npt.NDArray[np.float32]) -> npt.NDArray[np.bool_]:
    return np.isfinite(norms)


def median_norms(shards: Shards, *, progress: bool | None = False) -> npt.NDArray[np.float32]:
    """The exact lower median norm of every recorded layer, float32 ``(L,)`` (module docstring);
    NaN for a layer with no vector in its population. Two sequential passes, cached."""
    key = (str(shards.path), shards.metadata.hash)
    if key in _MEDIANS:
        return _MEDIANS[key].copy()
    n_layers = shards.metadata.n_layers
    high = np.zeros((n_layers, _BUCKETS), np.int64)
    for _, norms in _blocks(shards, "median norms (1 of 2)", progress):
        for li in range(n_layers):
            v = norms[:, li][_in_population(norms[:, li])]
            high[li] += np.bincount(v.view(np.uint32) >> 16, minlength=_BUCKETS)
    counts = high.sum(axis=1)
    rank = (counts - 1) // 2  # lower median, 0-based
    bucket = np.array([int(np.searchsorted(np.cumsum(h), r, side="right")) for h, r in zip(high, rank, strict=True)])
    before = np.array([int(h[:b].sum()) for h, b in zip(high, bucket, strict=True)])
    low = np.zeros((n_layers, _BUCKETS), np.int64)
    for _, norms in _blocks(shards, "median norms (2 of 2)", progress):
        for li in range(n_layers):
            bits = norms[:, li][_in_population(norms[:, li])].view(np.uint32)
            low[li] += np.bincount(bits[(bits >> 16) == bucket[li]] & 0xFFFF, minlength=_BUCKETS)
    medians = np.full(n_layers, np.nan, np.float32)
    for li in range(n_layers):
        if counts[li]:
            fine = int(np.searchsorted(np.cumsum(low[li]), rank[li] - before[li], side="right"))
            medians[li] = np.array([(int(bucket[li]) << 16) | fine], np.uint32).view(np.float32)[0]
    _MEDIANS[key] = medians
    return medians.copy()


@dataclasses.dataclass(frozen=True)
class NormFilter:
    """The tokens ``max_norm_multiple`` drops from a cache, for some chosen layers."""

    multiple: float
    #: Positions (in ``metadata.layers``) of the layers the rule looks at.
    layer_positions: tuple[int, ...]
    #: Median norm of each recorded layer (`median_norms`).
    medians: npt.NDArray[np.float32]
    #: Dropped ``(example, position)`` as bits: ``np.packbits(dropped, axis=1)``, ``(N, ceil(T/8))``.
    packed: npt.NDArray[np.uint8]
    tokens_per_ex: int

    def dropped(self, examples: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
        """``(len(examples), T)`` bool: the positions of ``examples`` the rule drops."""
        rows = self.packed[np.asarray(examples, dtype=np.int64)]
        return np.unpackbits(rows, axis=1, count=self.tokens_per_ex).astype(bool)

    def thresholds(self) -> dict[int, float]:
        """Layer position -> the norm above which a vector is dropped."""
        return {p: float(self.multiple * np.float64(self.medians[p])) for p in self.layer_positions}


def parse_multiple(value: object, error: type[ShardsError]) -> float | None:
    """``max_norm_multiple`` checked: None, or a finite number above 1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise error(f"max_norm_multiple: expected None or a number above 1 (such as 10), found {short_repr(value)}")
    try:
        k = float(value)
    except OverflowError:  # an int beyond float's range, such as 2**1100
        k = float("inf")
    if not np.isfinite(k) or k <= 1:
        # k <= 1 would drop at least half of every layer: a multiple of the median is above it.
        raise error(f"max_norm_multiple: expected a finite number above 1 (such as 10), found {short_repr(value)}")
    return k


def norm_filter(
    shards: Shards, multiple: float, layer_positions: Sequence[int], *, progress: bool | None = False
) -> NormFilter:
    """The tokens whose vector at any of ``layer_positions`` has a norm above ``multiple`` times
    its layer's median norm (the medians' passes first when not cached, then one pass)."""
    md = shards.metadata
    medians = median_norms(shards, progress=progress)
    limits = {p: multiple * np.float64(medians[p]) for p in layer_positions}
    packed = np.zeros((md.n_examples, -(-md.tokens_per_ex // 8)), dtype=np.uint8)
    for start, norms in _blocks(shards, f"norms above {multiple:g} x the median", progress):
        block = np.zeros(norms[:, 0].shape, dtype=bool)
        for p, limit in limits.items():
            with np.errstate(invalid="ignore"):
                block |= norms[:, p].astype(np.float64) > limit  # NaN (padding) compares False
            # A non-finite vector's norm is +inf: dropped whatever the limit, even when the
            # layer has no finite vector (its median, and so the limit, is NaN) or the limit
            # overflowed to +inf.
            block |= norms[:, p] == np.inf
        packed[start : start + len(norms)] = np.packbits(block, axis=1)
    return NormFilter(multiple, tuple(layer_positions), medians, packed, md.tokens_per_ex)


def to_json(nf: NormFilter, layers: Sequence[int]) -> dict[str, Any]:
    """What a cache's metadata records of a norm filter: the multiple and each layer's median
    (null for a layer with no finite vector, whose median is NaN: JSON has no NaN)."""
    medians = {str(layers[p]): float(nf.medians[p]) for p in nf.layer_positions}
    return {"multiple": nf.multiple, "median_norms": {k: None if np.isnan(v) else v for k, v in medians.items()}}
