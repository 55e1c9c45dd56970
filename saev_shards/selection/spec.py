"""Which tokens of a cache to take: asked (`SelectionSpec`), checked once (`parse_selection`),
chosen (`Selection`), and the per-example mask every reader of the choice applies.

The loaders (`TokenSelection` adds their labels and padding options), the map-style datasets
and the shuffle all build on this one parser, so a choice is refused with the same words
wherever it is made; each caller names its own error class (`LoaderError`, `ShuffleError`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..errors import ShardsError
from ..reader import norms
from . import token_masks
from .layers import choose_layers

if TYPE_CHECKING:
    from ..reader import Shards

#: Token choices: the patches (content tokens), the [CLS] token, or both.
TOKEN_CHOICES = ("content", "cls", "all")


@dataclasses.dataclass(frozen=True)
class SelectionSpec:
    """Which tokens of a cache to take, as asked; `parse_selection` checks it against a cache.

    ``layers``: None (every recorded layer), a layer value or a list of them. ``tokens``:
    ``"content"`` (the patches: positions ``cls_token .. T-1``), ``"cls"`` (position 0, caches
    with a [CLS] token) or ``"all"``. The token masks: ``exclude_token_ids`` leaves out the
    positions whose ``token_ids`` column value is listed (BOS, padding ids: a dump records the
    column); ``max_norm_multiple=k`` leaves out the positions whose vector at any chosen layer
    has a norm above ``k`` times its layer's median norm (`saev_shards.reader.norms` defines both).
    """

    layers: int | Sequence[int] | None = None
    tokens: str = "content"
    exclude_token_ids: Iterable[int] = ()
    max_norm_multiple: float | None = None


@dataclasses.dataclass(frozen=True)
class Selection:
    """A `SelectionSpec` checked against one cache: the chosen layers and token positions.

    Within an example the chosen vectors are ordered by layer (storage order), then token.
    Positions vary from example to example (`varies`) where the cache has a ``lengths``
    column (padding is skipped) or a token mask is set.
    """

    #: The chosen layer values, in storage order (``metadata.layers``' order).
    layers: tuple[int, ...]
    tokens: str
    #: Positions of `layers` in ``metadata.layers`` (ascending).
    layer_positions: tuple[int, ...]
    #: Token positions the token kind chooses in every example, before any per-example filter (ascending).
    positions: tuple[int, ...]
    #: Token positions per example (``T``).
    tokens_per_ex: int
    #: Whether the cache has a ``lengths`` column (positions ``>= lengths[i]`` are padding).
    has_lengths: bool
    #: The ``exclude_token_ids`` mask: sorted distinct ids (empty: no mask).
    exclude_token_ids: tuple[int, ...] = ()
    #: The ``max_norm_multiple`` mask, computed once (None: no mask).
    norm_filter: norms.NormFilter | None = dataclasses.field(default=None, compare=False)
    #: The cache's recorded layers (a norm filter's positions index them).
    recorded: tuple[int, ...] = ()

    @property
    def per_example(self) -> int:
        """Chosen tokens of an example before the per-example filters."""
        return len(self.positions)

    @property
    def masked(self) -> bool:
        """Whether a token mask is set."""
        return bool(self.exclude_token_ids) or self.norm_filter is not None

    @property
    def varies(self) -> bool:
        """Whether the chosen positions differ from example to example (padding skipped, or a token mask)."""
        return self.has_lengths or self.masked

    @functools.cached_property
    def base_mask(self) -> npt.NDArray[np.bool_]:
        """``(T,)`` bool: `positions` as a mask."""
        mask = np.zeros(self.tokens_per_ex, dtype=bool)
        mask[list(self.positions)] = True
        return mask

    @functools.cached_property
    def excluded(self) -> npt.NDArray[np.int64]:
        """`exclude_token_ids` as an array (what ``np.isin`` compares with)."""
        return np.array(self.exclude_token_ids, dtype=np.int64)

    def mask(
        self,
        examples: npt.NDArray[np.int64],
        *,
        lengths: npt.NDArray[np.int64] | None = None,
        token_ids: Callable[[], npt.NDArray[Any]] | None = None,
        keep: npt.NDArray[np.bool_] | None = None,
    ) -> tuple[npt.NDArray[np.bool_], dict[str, npt.NDArray[np.bool_]]]:
        """``(len(examples), T)`` bool: the chosen positions of ``examples``, and what each token
        mask took from the rest, by name (a position both drop counts for ``exclude_token_ids``).

        Chosen: the token kind's `positions`, those the caller's ``keep`` keeps (the loaders'
        ``ignore_labels``), those below ``lengths`` (the examples' ``lengths`` column, where the
        caller skips padding), less what the token masks drop. ``token_ids()`` gives the
        examples' ``token_ids`` rows ``(n, T)``; it is called only with ``exclude_token_ids``.
        """
        mask = np.broadcast_to(self.base_mask, (len(examples), self.tokens_per_ex))
        if keep is not None:
            mask = mask & keep
        if lengths is not None:
            mask = mask & (np.arange(self.tokens_per_ex) < lengths[:, None])
        taken: dict[str, npt.NDArray[np.bool_]] = {}
        if self.exclude_token_ids:
            if token_ids is None:
                raise ValueError("Selection.mask: exclude_token_ids is set, so token_ids is needed")
            taken["exclude_token_ids"] = mask & np.isin(token_ids(), self.excluded)
            mask = mask & ~taken["exclude_token_ids"]
        if self.norm_filter is not None:
            taken["max_norm_multiple"] = mask & self.norm_filter.dropped(examples)
            mask = mask & ~taken["max_norm_multiple"]
        return mask, taken

    def to_json(self) -> dict[str, Any]:
        """The selection as a shuffled cache's metadata records it (padding is always skipped there);
        the token masks only when set, so a shuffle without them keeps the metadata (and hash)
        it always had."""
        out: dict[str, Any] = {"layers": list(self.layers), "tokens": self.tokens, "skip_padding": True}
        if self.exclude_token_ids:
            out["exclude_token_ids"] = list(self.exclude_token_ids)
        if self.norm_filter is not None:
            out["max_norm_multiple"] = norms.to_json(self.norm_filter, self.recorded)
        return out


def token_positions(tokens: str, cls_token: bool, tokens_per_ex: int) -> tuple[int, ...]:
    """The token positions ``tokens`` chooses in an example of ``tokens_per_ex`` (module docstring)."""
    cls = int(cls_token)
    if tokens == "content":
        return tuple(range(cls, tokens_per_ex))
    if tokens == "cls":
        return (0,)
    return tuple(range(tokens_per_ex))


def parse_tokens(shards: Shards, tokens: object, error: type[ShardsError]) -> str:
    """``tokens`` checked: one of `TOKEN_CHOICES`, and ``"cls"`` only for a cache with a CLS token."""
    if not isinstance(tokens, str) or tokens not in TOKEN_CHOICES:
        raise error(f"tokens: expected one of {list(TOKEN_CHOICES)}, found {tokens!r}")
    if tokens == "cls" and not shards.metadata.cls_token:
        raise error(
            f"tokens='cls': expected a cache with a CLS token (cls_token=true), found cls_token=false at {shards.path}"
        )
    return tokens


def choose_excluded_ids(shards: Shards, value: object, error: type[ShardsError]) -> tuple[int, ...]:
    """``exclude_token_ids`` checked (`token_masks.parse_exclude_token_ids`), and, when any are
    given, the cache's ``token_ids`` column they are compared with."""
    ids = tuple(token_masks.parse_exclude_token_ids(value, error).tolist())
    if not ids:
        return ids
    if token_masks.COLUMN not in shards.manifest.columns:
        raise error(
            f"exclude_token_ids: expected a cache with a token_ids column (saev-shards dump records it), "
            f"found columns {sorted(shards.manifest.columns)} at {shards.path}"
        )
    problem = token_masks.token_ids_problem(shards)
    if problem is not None:
        raise error(problem)
    return ids


def parse_selection(
    shards: Shards, spec: SelectionSpec, error: type[ShardsError], *, progress: bool | None = False
) -> Selection:
    """Check ``spec`` against ``shards``; ``error`` (the caller's class) names the first problem.
    A norm filter is computed here, once (`saev_shards.reader.norms`, with a progress bar when
    ``progress``)."""
    md = shards.metadata
    recorded = tuple(md.layers)
    values = choose_layers(recorded, spec.layers, error)
    tokens = parse_tokens(shards, spec.tokens, error)
    excluded = choose_excluded_ids(shards, spec.exclude_token_ids, error)
    multiple = norms.parse_multiple(spec.max_norm_multiple, error)
    layer_positions = tuple(sorted(recorded.index(v) for v in values))
    return Selection(
        layers=tuple(recorded[p] for p in layer_positions),
        tokens=tokens,
        layer_positions=layer_positions,
        positions=token_positions(tokens, md.cls_token, md.tokens_per_ex),
        tokens_per_ex=md.tokens_per_ex,
        has_lengths="lengths" in shards.manifest.columns,
        exclude_token_ids=excluded,
        norm_filter=None
        if multiple is None
        else norms.norm_filter(shards, multiple, layer_positions, progress=progress),
        recorded=recorded,
    )
