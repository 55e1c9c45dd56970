"""The ``exclude_token_ids`` token mask, checked once for the loaders and the shuffle: the ids
given, and the cache's ``token_ids`` column they are compared with (the other mask,
``max_norm_multiple``, is `saev_shards.reader.norms`).

* The ids are integers in ``[-2**63, 2**63)``: the column holds integers of at most 64 bits,
  and numpy compares them as int64.
* The column holds one integer per token position: shape ``(n_examples, T)`` (protocol.md
  2.4, what ``saev-shards dump`` writes), or ``(n_examples,)`` when ``T`` is 1 (a shuffled
  cache's, protocol.md 2.8: one value per row). `token_ids_problem` says what else it holds;
  `token_ids_of` reads it as ``(n, T)`` either way.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..errors import ShardsError
from ..protocol.jsonfile import is_int, short_repr

if TYPE_CHECKING:
    from ..reader import Shards

#: The column the ids are compared with.
COLUMN = "token_ids"
_INT64 = (-(2**63), 2**63)


def parse_exclude_token_ids(value: object, error: type[ShardsError]) -> npt.NDArray[np.int64]:
    """``exclude_token_ids`` as sorted distinct int64 ids; ``error`` naming the argument for
    anything but an iterable of integers in ``[-2**63, 2**63)`` (a string included)."""
    ids: list[Any] | None = None
    if not isinstance(value, (str, bytes)) and isinstance(value, Iterable):
        try:
            ids = list(value)
        except TypeError:  # a 0-d array
            ids = None
    if ids is None:
        raise error(f"exclude_token_ids: expected a list of token ids, found {short_repr(value)}")
    if not all(is_int(t, numpy_ok=True) for t in ids):
        raise error(f"exclude_token_ids: expected integer token ids, found {short_repr(ids)}")
    outside = [int(t) for t in ids if not _INT64[0] <= int(t) < _INT64[1]]
    if outside:
        raise error(
            f"exclude_token_ids: expected token ids in [-2**63, 2**63) (the token_ids column holds integers of at "
            f"most 64 bits), found {short_repr(outside[0])}"
        )
    return np.array(sorted({int(t) for t in ids}), dtype=np.int64)


def token_ids_problem(shards: Shards) -> str | None:
    """What is wrong with ``shards``' ``token_ids`` column for the mask (module docstring), or
    None when it holds one integer per token position (or is missing: the caller says so)."""
    entry = shards.manifest.columns.get(COLUMN)
    if entry is None:
        return None
    md = shards.metadata
    shape = tuple(entry.shape)
    dtype = np.dtype(entry.dtype)
    fits = shape == (md.n_examples, md.tokens_per_ex) or (md.tokens_per_ex == 1 and shape == (md.n_examples,))
    if fits and dtype.kind in "iu":
        return None
    return (
        f"{shards.path}: {COLUMN}: expected integers of shape {(md.n_examples, md.tokens_per_ex)} (one per token "
        f"position{', or one per row' if md.tokens_per_ex == 1 else ''}), found {dtype.name} of shape {shape}"
    )


def token_ids_of(shards: Shards, examples: npt.NDArray[np.int64]) -> npt.NDArray[Any]:
    """The ``token_ids`` of ``examples`` as ``(len(examples), T)`` (a column checked by
    `token_ids_problem`)."""
    ids = np.asarray(shards.columns[COLUMN][examples])
    return ids.reshape(len(examples), shards.metadata.tokens_per_ex)
