"""Where every value of a cache lives: pure offset arithmetic (protocol.md sections 3 and 4).

Every function here is a pure function of plain integers taken from the metadata and
the shard sizes; nothing touches the disk or allocates arrays, so caches of 10^9
examples are handled exactly (Python integers never overflow). The vectorised
`locate_many` is the one exception that works on numpy arrays; it uses int64, which
holds any byte offset of a file smaller than 8 EiB.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from ..errors import MetadataError

#: Largest byte count a single file (and numpy's int64 offsets) may describe.
MAX_NBYTES = 2**63 - 1

F = TypeVar("F", bound=Callable[..., Any])


def _earlier_keywords(f: F) -> F:
    """Let ``f`` take the keywords of this module's earlier signatures: ``eps`` for
    ``examples_per_shard``, and ``d_model`` with ``itemsize`` for ``vector_nbytes`` (their
    product)."""
    names = set(f.__code__.co_varnames[: f.__code__.co_argcount + f.__code__.co_kwonlyargcount])

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if kwargs.keys() <= names:
            return f(*args, **kwargs)
        if "eps" in kwargs:
            if "examples_per_shard" in kwargs:
                raise TypeError(f"{f.__name__}() got both eps and examples_per_shard (the same argument)")
            kwargs["examples_per_shard"] = kwargs.pop("eps")
        if "d_model" in kwargs or "itemsize" in kwargs:
            if "vector_nbytes" in kwargs or not {"d_model", "itemsize"} <= kwargs.keys():
                raise TypeError(f"{f.__name__}() takes vector_nbytes, or d_model and itemsize together")
            kwargs["vector_nbytes"] = kwargs.pop("d_model") * kwargs.pop("itemsize")
        return f(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


#: Largest byte count a single file (and numpy's int64 offsets) may describe.
MAX_NBYTES = 2**63 - 1


def tokens_per_ex(patches_per_ex: int, cls_token: bool) -> int:
    """Length T of the token axis: the patches plus one for [CLS] when present."""
    return patches_per_ex + (1 if cls_token else 0)


def examples_per_shard(patches_per_shard: int, tokens: int, n_layers: int) -> int:
    """Examples in every shard but the last: ``patches_per_shard // (T * L)``.

    >>> examples_per_shard(2_400_000, 197, 2)
    6091
    """
    per_example = tokens * n_layers
    eps = patches_per_shard // per_example
    if eps < 1:
        raise MetadataError(
            f"patches_per_shard={patches_per_shard} is too small: one example needs "
            f"tokens_per_ex * len(layers) = {tokens} * {n_layers} = {per_example} "
            f"slots, so examples_per_shard would be 0; use patches_per_shard >= {per_example}"
        )
    return eps


@_earlier_keywords
def n_shards(n_examples: int, examples_per_shard: int) -> int:
    """Number of shard files: ``ceil(n_examples / examples_per_shard)``."""
    return -(-n_examples // examples_per_shard)


@_earlier_keywords
def shard_n_examples(shard: int, n_examples: int, examples_per_shard: int) -> int:
    """Examples held by shard ``shard``: ``examples_per_shard`` for all but the last, the rest in the last."""
    count = n_shards(n_examples, examples_per_shard)
    if not 0 <= shard < count:
        raise IndexError(f"shard {shard} out of range for a cache of {count} shards")
    return min(examples_per_shard, n_examples - shard * examples_per_shard)


def example_nbytes(n_layers: int, tokens: int, d_model: int, itemsize: int) -> int:
    """Bytes of one example: its ``(L, T, D)`` block."""
    return n_layers * tokens * d_model * itemsize


@_earlier_keywords
def shard_of(example: int, examples_per_shard: int) -> tuple[int, int]:
    """``(shard_idx, ex_in_shard)`` of a global example index (protocol.md 4.2 step 1)."""
    return divmod(example, examples_per_shard)


def offset_in_vectors(ex_in_shard: int, layer_idx: int, token: int, n_layers: int, tokens: int) -> int:
    """Vectors before ``[ex_in_shard, layer_idx, token]`` in a C-order ``(S, L, T, D)`` shard."""
    return ex_in_shard * n_layers * tokens + layer_idx * tokens + token


@_earlier_keywords
def locate(
    example: int,
    layer_idx: int,
    token: int,
    *,
    n_examples: int,
    examples_per_shard: int,
    n_layers: int,
    tokens: int,
    vector_nbytes: int,
) -> tuple[int, int]:
    """``(shard_idx, byte_offset)`` of the first byte of vector ``[example, layer_idx, token]``.

    ``layer_idx`` is a position in ``metadata.layers`` (not a layer value). ``vector_nbytes``
    is ``d_model * itemsize`` in a shard file, 4 in a float8_e4m3 cache's scale file (one
    float32 per vector); the earlier keywords ``eps``, ``d_model`` and ``itemsize`` still work.
    Raises `IndexError` for coordinates outside the logical tensor.
    """
    if not 0 <= example < n_examples:
        raise IndexError(f"example {example} out of range [0, {n_examples})")
    if not 0 <= layer_idx < n_layers:
        raise IndexError(f"layer index {layer_idx} out of range [0, {n_layers})")
    if not 0 <= token < tokens:
        raise IndexError(f"token {token} out of range [0, {tokens})")
    shard, ex_in_shard = shard_of(example, examples_per_shard)
    vectors = offset_in_vectors(ex_in_shard, layer_idx, token, n_layers, tokens)
    return shard, vectors * vector_nbytes


@_earlier_keywords
def locate_many(
    examples: npt.ArrayLike,
    layer_idx: npt.ArrayLike,
    tokens_idx: npt.ArrayLike,
    *,
    examples_per_shard: int,
    n_layers: int,
    tokens: int,
    vector_nbytes: int,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Vectorised `locate` without bounds checks: int64 arrays ``(shard_idx, byte_offset)``."""
    ex = np.asarray(examples, dtype=np.int64)
    shard = ex // examples_per_shard
    vectors = (ex % examples_per_shard) * (n_layers * tokens) + np.asarray(layer_idx, np.int64) * tokens
    vectors = vectors + np.asarray(tokens_idx, np.int64)
    return shard, vectors * vector_nbytes
