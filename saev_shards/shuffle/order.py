"""The order of a shuffled cache: a pure function of the seed and the number of tokens.

Every chosen token of the source has an *ordinal* ``i``: its position when the chosen
tokens are listed in source order (example by example, token positions ascending). Token
``i`` gets the 64-bit sort key

    key(i) = mix64(mix64(seed) + (i + 1) * GOLDEN  mod 2**64)

(SplitMix64: ``mix64`` is its output function, ``GOLDEN`` its increment), and the shuffled
cache holds the tokens sorted by ``(key, i)``: row ``j`` is the token with the ``j``-th
smallest key. Keys are independent and uniform, so the order is a uniformly random
permutation (ties, which have probability about ``n**2 / 2**65``, keep source order).

The external shuffle never needs the whole permutation: bucket ``b`` of ``K`` holds the keys
``b * 2**64 / K <= key < (b + 1) * 2**64 / K`` (computed from the key's top 32 bits, so it is
monotone in the key), and sorting each bucket by key and concatenating the buckets gives the
global order. The result therefore does not depend on ``K``, on how the source is cut into
chunks or on how many processes do the work; `shuffle_order` is the in-memory reference.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

#: SplitMix64's increment (2**64 / golden ratio, odd) and its output function's multipliers.
GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1
#: Most buckets a shuffle may use: bucket numbers are computed from the key's top 32 bits.
MAX_BUCKETS = 1 << 32


def mix64_int(z: int) -> int:
    """SplitMix64's output function on one Python integer (the seed's scrambling)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def sort_keys(seed: int, ordinals: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    """The sort key of each ordinal (see the module docstring); vectorised, ~20 ns per key."""
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed: expected an integer in [0, 2**63), found {seed}")
    z = np.asarray(ordinals, dtype=np.uint64) + np.uint64(1)
    with np.errstate(over="ignore"):  # arithmetic modulo 2**64 is the point
        z *= np.uint64(GOLDEN)
        z += np.uint64(mix64_int(seed))
        z ^= z >> np.uint64(30)
        z *= _MIX1
        z ^= z >> np.uint64(27)
        z *= _MIX2
    z ^= z >> np.uint64(31)
    return z


def bucket_of(keys: npt.NDArray[np.uint64], n_buckets: int) -> npt.NDArray[np.int64]:
    """Bucket of each key among ``n_buckets`` equal ranges of the key space (monotone in the key)."""
    if not 1 <= n_buckets <= MAX_BUCKETS:
        raise ValueError(f"n_buckets: expected 1 to {MAX_BUCKETS}, found {n_buckets}")
    with np.errstate(over="ignore"):  # (key >> 32) * n_buckets < 2**64: no overflow in fact
        scaled = (keys >> np.uint64(32)) * np.uint64(n_buckets)
    return (scaled >> np.uint64(32)).astype(np.int64)


def shuffle_order(n_tokens: int, seed: int) -> npt.NDArray[np.int64]:
    """Ordinals in shuffled order: row ``j`` of the shuffled cache holds token ``shuffle_order(n, seed)[j]``.

    The in-memory reference of what the external shuffle writes (it holds all ``n`` keys).

    >>> shuffle_order(5, seed=0).tolist()
    [4, 1, 0, 2, 3]
    """
    keys = sort_keys(seed, np.arange(n_tokens, dtype=np.int64))
    return np.argsort(keys, kind="stable").astype(np.int64)
