"""numpy-style indexing of the logical ``(N, L, T, D)`` tensor across shard files.

The result always equals ``logical[key]`` for the same key, with numpy's semantics
(basic and advanced indexing, negative indices, steps, broadcasting of index arrays).
The example axis is resolved to shards by pure arithmetic; every other component of
the key is handed to numpy on the shard memmaps, so only the bytes asked for are read.
Not supported: ``np.newaxis`` and a boolean index spanning the example axis and more.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from ..protocol.jsonfile import is_int

NDIM = 4


class ShardedArray(Protocol):
    """What indexing needs of a cache (`saev_shards.Shards` is one): its logical shape, the
    examples per shard, the stored numpy dtype, and each shard as an array."""

    @property
    def shape(self) -> tuple[int, int, int, int]: ...
    @property
    def n_examples(self) -> int: ...
    @property
    def examples_per_shard(self) -> int: ...
    @property
    def numpy_dtype(self) -> np.dtype[Any]: ...
    def shard(self, k: int) -> npt.NDArray[Any]:
        """Shard ``k``, shape ``(n_examples_k, L, T, D)``."""
        ...


def _is_array(c: object) -> bool:
    return isinstance(c, (list, tuple, np.ndarray)) or (hasattr(c, "__array__") and not np.isscalar(c))


#: The range wording of the cache's example axis (``wrap_index(..., CACHE_RANGE)``).
CACHE_RANGE = "for a cache of {n} examples"


def wrap_index(index: int, n: int, noun: str, within: str = "[0, {n})") -> int:
    """``index`` into a sequence of ``n`` items as ``0..n-1``, negative counting from the end
    like Python's; `IndexError` ``"<noun> <index> out of range <within>"`` otherwise
    (``within`` formatted with ``n``). The one place the reader, the text fields and the
    map-style datasets wrap an index."""
    if 0 <= index < n:
        return index
    if -n <= index < 0:
        return index + n
    raise IndexError(f"{noun} {index} out of range {within.format(n=n)}")


def _normalize(key: Any, shape: tuple[int, ...]) -> tuple[Any, ...]:
    if not isinstance(key, tuple):
        key = (key,)
    if any(c is None for c in key):
        raise IndexError("np.newaxis is not supported when indexing Shards; index the result instead")
    consumed = 0
    for c in key:
        if c is Ellipsis:
            continue
        if _is_array(c):
            arr = np.asarray(c)
            consumed += arr.ndim if arr.dtype == bool else 1
        else:
            consumed += 1
    n_ellipsis = sum(c is Ellipsis for c in key)
    if n_ellipsis > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if consumed > NDIM:
        raise IndexError(f"too many indices: the logical tensor is {NDIM}-dimensional, but {consumed} were indexed")
    fill = (slice(None),) * (NDIM - consumed)
    if n_ellipsis:
        i = next(i for i, c in enumerate(key) if c is Ellipsis)
        key = key[:i] + fill + key[i + 1 :]
    else:
        key = key + fill
    out = tuple(_as_index_array(c) if _is_array(c) else c for c in key)
    axis = 0
    for c in out:
        if isinstance(c, np.ndarray) and c.dtype == bool:
            if c.shape != tuple(shape[axis : axis + c.ndim]):
                raise IndexError(
                    f"boolean index did not match indexed array along axis {axis}; "
                    f"size is {shape[axis : axis + c.ndim]} but corresponding boolean size is {c.shape}"
                )
            axis += c.ndim
        else:
            axis += 1
    return out


def _as_index_array(c: object) -> npt.NDArray[Any]:
    arr = np.asarray(c)
    if arr.size == 0 and arr.dtype.kind not in "iub":
        return arr.astype(np.intp)  # numpy treats an empty list as an empty integer index
    return arr


def _expand_bools(rest: tuple[Any, ...]) -> tuple[Any, ...]:
    out: list[Any] = []
    for c in rest:
        if isinstance(c, np.ndarray) and c.dtype == bool:
            out.extend(c.nonzero())
        else:
            out.append(c)
    return tuple(out)


def getitem(shards: ShardedArray, key: Any) -> npt.NDArray[Any]:
    """``logical[key]`` for the cache behind ``shards``."""
    key = _normalize(key, shards.shape)
    first, rest = key[0], _expand_bools(key[1:])
    n = shards.n_examples
    rest_has_array = any(isinstance(c, np.ndarray) for c in rest)
    if is_int(first, numpy_ok=True) and not rest_has_array:
        i = int(first)
        if not -n <= i < n:
            raise IndexError(f"index {i} is out of bounds for axis 0 with size {n}")
        k, local = divmod(i % n, shards.examples_per_shard)
        return np.asarray(shards.shard(k)[(local, *rest)])
    if isinstance(first, slice):
        return _slice_first(shards, first, rest)
    if isinstance(first, np.ndarray) or is_int(first, numpy_ok=True):
        return _array_first(shards, np.asarray(first), rest)
    raise IndexError("only integers, slices (`:`), ellipsis (`...`) and integer or boolean arrays are valid indices")


def _tail_dummy(shards: ShardedArray, count: int) -> np.ndarray[Any, Any]:
    shape = (count, *shards.shape[1:])
    return np.broadcast_to(np.zeros((), shards.numpy_dtype), shape)


def _slice_first(shards: ShardedArray, sl: slice, rest: tuple[Any, ...]) -> npt.NDArray[Any]:
    n, eps = shards.n_examples, shards.examples_per_shard
    start, stop, step = sl.indices(n)
    pieces: list[tuple[int, slice]] = []
    e = start
    if step > 0:
        while e < stop:
            k = e // eps
            end = min(stop, (k + 1) * eps)
            count = -(-(end - e) // step)
            local = e - k * eps
            pieces.append((k, slice(local, local + (count - 1) * step + 1, step)))
            e += count * step
    else:
        while e > stop:
            k = e // eps
            low = max(stop, k * eps - 1)
            count = -(-(e - low) // -step)
            local = e - k * eps
            last = local + (count - 1) * step
            pieces.append((k, slice(local, last - 1 if last > 0 else None, step)))
            e += count * step
    # Where the example axis lands: numpy moves it behind non-adjacent advanced indices.
    one = _tail_dummy(shards, 1)[(slice(None), *rest)].shape
    two = _tail_dummy(shards, 2)[(slice(None), *rest)].shape
    axis = next(i for i, (a, b) in enumerate(zip(one, two, strict=True)) if a != b)
    if not pieces:
        empty = list(one)
        empty[axis] = 0
        return np.empty(tuple(empty), shards.numpy_dtype)
    parts = [np.asarray(shards.shard(k)[(s, *rest)]) for k, s in pieces]
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts, axis=axis)


def _array_first(shards: ShardedArray, idx: npt.NDArray[Any], rest: tuple[Any, ...]) -> npt.NDArray[Any]:
    n, eps = shards.n_examples, shards.examples_per_shard
    if idx.dtype == bool:
        if idx.ndim != 1:
            raise IndexError("a boolean index over the example axis must be 1-dimensional here")
        if idx.shape[0] != n:
            raise IndexError(f"boolean index did not match axis 0; size is {n} but index is {idx.shape[0]}")
        idx = np.flatnonzero(idx)
    elif idx.dtype.kind not in "iu":
        if idx.size == 0:
            idx = idx.astype(np.int64)
        else:
            raise IndexError("arrays used as indices must be of integer (or boolean) type")
    idx = idx.astype(np.int64, copy=False)
    if idx.size and (idx.min() < -n or idx.max() >= n):
        bad = idx[(idx < -n) | (idx >= n)][0]
        raise IndexError(f"index {bad} is out of bounds for axis 0 with size {n}")
    idx = np.where(idx < 0, idx + n, idx)
    adv = [i for i, c in enumerate(rest) if isinstance(c, np.ndarray)]
    try:
        arrays = np.broadcast_arrays(idx, *(rest[i] for i in adv)) if adv else [idx]
    except ValueError as err:
        raise IndexError(f"shape mismatch: indexing arrays could not be broadcast together ({err})") from None
    shape_b = arrays[0].shape
    flat = [a.reshape(-1) for a in arrays]
    ex = flat[0]
    # Shape of one selected element: what numpy leaves after the advanced dimensions.
    probe_key = (np.zeros(1, np.int64), *(np.zeros(1, np.int64) if i in adv else c for i, c in enumerate(rest)))
    tail = _tail_dummy(shards, 1)[probe_key].shape[1:]
    out = np.empty((ex.size, *tail), shards.numpy_dtype)
    if ex.size:
        shard_of = ex // eps
        order = np.argsort(shard_of, kind="stable")
        sorted_shards = shard_of[order]
        bounds = np.flatnonzero(np.diff(sorted_shards)) + 1
        for sel in np.split(order, bounds):
            k = int(shard_of[sel[0]])
            sub = [c for c in rest]
            for j, i in enumerate(adv):
                sub[i] = flat[j + 1][sel]
            out[sel] = shards.shard(k)[(ex[sel] - k * eps, *sub)]
    return out.reshape(shape_b + tail)
