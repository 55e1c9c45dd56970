"""Which token vectors of a cache a loader yields: layers, token kind and per-token filters.

The choice itself (layers, token kind, token masks) is `saev_shards.selection`'s, parsed
there for the loaders and the shuffle alike; this module adds what only the loaders have:
the labels and padding filters, the sites, the layers-not-mixed rule and the output dtype.
Shared by the token loaders and the map-style datasets; numpy only (no torch).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import LoaderError, NameNotFoundError
from ..protocol.jsonfile import short_repr
from ..protocol.sites import Site
from ..reader import Shards
from ..selection import TOKEN_CHOICES, SelectionSpec, choose_layers, parse_selection, token_ids_of
from ..store import open_cache

__all__ = [
    "CLS_LABEL",
    "OUT_DTYPES",
    "TOKEN_CHOICES",
    "SiteChoice",
    "TokenSelection",
    "as_shards",
    "check_layers_not_mixed",
    "choose_sites",
    "parse_layers",
    "parse_out_dtype",
]

#: Label reported for a [CLS] token: labels.bin has no CLS column, and 255 is the one
#: value a uint8 label can take that no patch label set we know uses.
CLS_LABEL = 255
#: Output dtypes a caller may ask for (None keeps the stored dtype).
OUT_DTYPES = ("float16", "bfloat16", "float32")
#: Examples per step when counting selected tokens over the whole cache (bounds memory).
_COUNT_CHUNK = 1 << 16


def as_shards(shards: Shards | str | os.PathLike[str]) -> Shards:
    """An open `Shards` from a `Shards`, a cache path, or a hash or hash prefix (`saev_shards.open`)."""
    if isinstance(shards, Shards):
        return shards
    return open_cache(shards)


def parse_layers(shards: Shards, layers: int | Sequence[int] | None) -> tuple[int, ...]:
    """Layer *values* chosen by ``layers`` (None = every recorded layer), checked against the
    cache (`saev_shards.selection.choose_layers`, raising `LoaderError`)."""
    return choose_layers(shards.metadata.layers, layers, LoaderError)


@dataclasses.dataclass(frozen=True)
class SiteChoice:
    """The sites a loader yields (``sites=``, a cache with metadata sites, protocol 3.2), in the
    order asked: one site gives rows ``(D,)``, a list of them rows ``(S, D)``."""

    #: The sites, in the order asked.
    sites: tuple[Site, ...]
    #: Their layer values, in the same order.
    layers: tuple[int, ...]
    #: A list was given: every row holds every site (stacked).
    stacked: bool

    def order(self, disk: Sequence[int]) -> tuple[int, ...] | None:
        """Where each asked site sits among ``disk`` (the layer values in storage order, as the
        loaders gather them), or None when they are asked in that order already."""
        where = tuple(list(disk).index(v) for v in self.layers)
        return None if where == tuple(range(len(where))) else where


def choose_sites(shards: Shards, sites: object, layers: object = None) -> SiteChoice | None:
    """``sites=`` of a loader checked against the cache: None when not given; one site (a
    string ``"module:io"`` or a `Site`) or a list of them, each recorded once. `LoaderError`
    naming the recorded sites otherwise, and when ``layers`` is given as well."""
    if sites is None:
        return None
    if layers is not None:
        raise LoaderError(f"give layers or sites, not both (found layers={short_repr(layers)} and sites)")
    md = shards.metadata
    single = isinstance(sites, (str, Site))
    asked: list[object]
    if single:
        asked = [sites]
    elif isinstance(sites, Iterable) and not isinstance(sites, (bytes, dict)):
        asked = list(sites)
    else:
        raise LoaderError(
            f"sites: expected a site such as 'encoder.layer.3.intermediate:input' or a list of them, "
            f"found {short_repr(sites)}"
        )
    if not asked:
        raise LoaderError("sites: expected at least one site, found none")
    values, chosen = [], []
    for site in asked:
        try:
            value = md.site_layer(site)
        except NameNotFoundError as err:
            raise LoaderError(f"sites: {err}") from None
        values.append(value)
        chosen.append(md.site_of(value))
    if len(set(values)) != len(values):
        raise LoaderError(f"sites: expected each site once, found {[str(s) for s in chosen]}")
    return SiteChoice(tuple(s for s in chosen if s is not None), tuple(values), not single)


def check_layers_not_mixed(shards: Shards, layer_values: Sequence[int], stack_layers: bool, mix_layers: bool) -> None:
    """Refuse batches that would mix layers by accident: with more than one layer chosen, the
    caller stacks them (``stack_layers=True``) or says mixing is meant (``mix_layers=True``).

    An SAE trained on a batch that is half one layer, half another (at different scales) is
    wrong and nothing else says so; the message names the three ways out.
    """
    if len(layer_values) <= 1 or stack_layers or mix_layers:
        return
    recorded = list(shards.metadata.layers)
    chosen = list(layer_values)
    which = "records layers" if chosen == recorded else f"records layers {recorded}; you chose"
    raise LoaderError(
        f"this cache {which} {chosen}, and a batch would mix them: choose one layer with layers={chosen[-1]}, "
        f"stack them with stack_layers=True (each row one token at every chosen layer), or pass mix_layers=True "
        f"to mix layers in one batch on purpose"
    )


def parse_out_dtype(shards: Shards, out_dtype: object) -> str:
    """The dtype name of returned activations: for None the cache's `Shards.read_dtype` (the
    stored dtype; float16 for float8_e4m3, whose values are dequantized), else one of `OUT_DTYPES`."""
    if out_dtype is None:
        return shards.read_dtype
    name = str(out_dtype).removeprefix("torch.")
    if name not in OUT_DTYPES:
        raise LoaderError(f"out_dtype: expected None or one of {list(OUT_DTYPES)}, found {out_dtype!r}")
    return name


class TokenSelection:
    """Which token vectors of a cache a loader yields: layers, token kind and per-token filters.

    ``layers``, ``tokens`` and the token masks (``exclude_token_ids``: positions whose
    ``token_ids`` column value is listed; ``max_norm_multiple=k``: positions whose vector at
    any chosen layer has a norm above ``k`` times its layer's median norm, computed once with
    ``progress``) are `saev_shards.selection.SelectionSpec`'s, checked by its parser
    (`chosen`). ``ignore_labels`` drops content tokens whose ``labels.bin`` value is listed
    (CLS tokens have no label and are never dropped by it). ``skip_padding`` drops positions
    ``>= lengths[i]`` when the cache has a ``lengths`` column. Within an example the
    selected vectors are ordered by layer (metadata order), then token.
    """

    def __init__(
        self,
        shards: Shards,
        layers: int | Sequence[int] | None = None,
        tokens: str = "content",
        ignore_labels: Iterable[int] = (),
        skip_padding: bool = True,
        exclude_token_ids: Iterable[int] = (),
        max_norm_multiple: float | None = None,
        progress: bool | None = None,
    ) -> None:
        md = shards.metadata
        self.shards = shards
        ignore = sorted({int(v) for v in ignore_labels})
        spec = SelectionSpec(layers, tokens, exclude_token_ids, max_norm_multiple)
        # (checked before the norm filter is computed: a mistake here should not wait for it)
        choose_layers(md.layers, layers, LoaderError)
        if any(not 0 <= v <= 255 for v in ignore):
            raise LoaderError(f"ignore_labels: expected uint8 label values 0..255, found {ignore}")
        if ignore and shards.manifest.labels is None:
            raise LoaderError(f"ignore_labels={ignore}: expected a cache with labels.bin, found none at {shards.path}")
        #: The layers, token kind and token masks, checked (`saev_shards.selection`).
        self.chosen = parse_selection(shards, spec, LoaderError, progress=progress)
        self.layer_values = self.chosen.layers
        #: Positions of the chosen layers in ``metadata.layers``, ascending (disk order).
        self.layer_positions = np.array(self.chosen.layer_positions, dtype=np.int64)
        self.n_layers = len(self.layer_positions)
        self.tokens = self.chosen.tokens
        self.cls = int(md.cls_token)
        self.tokens_per_ex = md.tokens_per_ex
        self.base_mask = self.chosen.base_mask
        #: Token positions chosen when no per-example filter applies.
        self.base_tokens = np.array(self.chosen.positions, dtype=np.int64)
        self.ignore_labels = np.array(ignore, dtype=np.uint8)
        self.has_labels = shards.manifest.labels is not None
        self.label_filter = bool(ignore) and self.tokens != "cls" and md.patches_per_ex > 0
        self.length_filter = bool(skip_padding) and self.chosen.has_lengths
        self.skip_padding = bool(skip_padding)
        self.exclude_token_ids = self.chosen.excluded
        #: The tokens ``max_norm_multiple`` drops (None without it); computed once.
        self.norm_filter = self.chosen.norm_filter
        #: True when the chosen tokens differ from example to example.
        self.varies = self.label_filter or self.length_filter or self.chosen.masked
        self._counts: npt.NDArray[np.int64] | None = None
        self._dropped: dict[str, int] = {}

    # -- per-example masks -----------------------------------------------------------------
    def mask(
        self, examples: npt.NDArray[np.int64], labels: npt.NDArray[np.uint8] | None = None
    ) -> npt.NDArray[np.bool_]:
        """``(len(examples), T)`` bool: the chosen token positions of each example.

        ``labels`` may pass the examples' ``labels.bin`` rows when the caller has them already.
        """
        mask = np.broadcast_to(self.base_mask, (len(examples), self.tokens_per_ex))
        if not self.varies or len(examples) == 0:
            return mask
        return self._masks(examples, labels)[0]

    def _masks(
        self, examples: npt.NDArray[np.int64], labels: npt.NDArray[np.uint8] | None = None
    ) -> tuple[npt.NDArray[np.bool_], dict[str, npt.NDArray[np.bool_]]]:
        """The chosen positions, and what each token mask took away from the rest (`Selection.mask`)."""
        keep = None
        if self.label_filter:
            if labels is None:
                labels = self.labels_of(examples)
            keep = np.ones((len(examples), self.tokens_per_ex), dtype=bool)
            keep[:, self.cls :] = ~np.isin(labels, self.ignore_labels)
        lengths = None
        if self.length_filter:
            lengths = np.asarray(self.shards.columns["lengths"][examples]).astype(np.int64)
        mask, taken = self.chosen.mask(
            examples, lengths=lengths, token_ids=lambda: token_ids_of(self.shards, examples), keep=keep
        )
        return mask, taken

    @property
    def dropped(self) -> dict[str, int]:
        """Token positions each mask drops from what the other filters keep, per chosen layer
        (``{"exclude_token_ids": n, "max_norm_multiple": m}``; a position both drop counts
        for ``exclude_token_ids``); empty without token masks."""
        if self.counts is not None and self._dropped:
            return dict(self._dropped)
        return {}

    def labels_of(self, examples: npt.NDArray[np.int64]) -> npt.NDArray[np.uint8]:
        """``(len(examples), patches_per_ex)`` labels of ``examples``, in any order, repeats
        allowed (one ascending run of consecutive examples is read as one slice)."""
        labels = self.shards.labels
        if labels is None:
            raise LoaderError(f"labels: expected a cache with labels.bin, found none at {self.shards.path}")
        if len(examples) and examples[-1] - examples[0] + 1 == len(examples) and (np.diff(examples) == 1).all():
            return np.array(labels[int(examples[0]) : int(examples[-1]) + 1])
        return np.asarray(labels[examples])

    def tokens_of(self, example: int) -> npt.NDArray[np.int64]:
        """Chosen token positions of one example, ascending."""
        if not self.varies:
            return self.base_tokens
        return np.flatnonzero(self.mask(np.array([example], dtype=np.int64))[0]).astype(np.int64)

    @property
    def counts(self) -> npt.NDArray[np.int64] | None:
        """Chosen tokens per example (one layer), or None when every example has ``len(base_tokens)``.

        Computed once by a sequential pass over labels.bin and the lengths column.
        """
        if not self.varies:
            return None
        if self._counts is None:
            n = self.shards.n_examples
            counts = np.empty(n, dtype=np.int64)
            dropped: dict[str, int] = {}
            for start in range(0, n, _COUNT_CHUNK):
                stop = min(n, start + _COUNT_CHUNK)
                mask, taken = self._masks(np.arange(start, stop, dtype=np.int64))
                counts[start:stop] = mask.sum(axis=1)
                for name, where in taken.items():
                    dropped[name] = dropped.get(name, 0) + int(where.sum())
            self._counts = counts
            self._dropped = dropped
        return self._counts

    def tokens_before(self, examples: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Chosen tokens (one layer) in all examples before each of ``examples``."""
        counts = self.counts
        if counts is None:
            return np.asarray(examples, dtype=np.int64) * len(self.base_tokens)
        return self.cumulative()[np.asarray(examples, dtype=np.int64)]

    def cumulative(self) -> npt.NDArray[np.int64]:
        """``(n_examples + 1,)``: chosen tokens (one layer) before each example, then the total
        (for a selection that `varies`; computed once)."""
        cum: npt.NDArray[np.int64] | None = getattr(self, "_cum", None)
        if cum is None:
            counts = self.counts
            assert counts is not None
            cum = np.zeros(len(counts) + 1, dtype=np.int64)
            np.cumsum(counts, out=cum[1:])
            self._cum = cum
        return cum

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_cum", None)  # rebuilt from counts on demand; halves what workers receive
        return state
