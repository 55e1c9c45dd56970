"""Which token vectors of a cache a loader yields: layers, token kind and per-token filters.

Shared by the token loaders and `TokenDataset`; numpy only (no torch).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import token_masks
from .._layers import string_layers_problem
from ..errors import LoaderError, NameNotFoundError
from ..protocol.jsonfile import is_int, short_repr
from ..protocol.sites import Site
from ..reader import Shards, norms
from ..store import open_cache

#: Label reported for a [CLS] token: labels.bin has no CLS column, and 255 is the one
#: value a uint8 label can take that no patch label set we know uses.
CLS_LABEL = 255
#: Token choices: the patches, the [CLS] token, or both.
TOKEN_CHOICES = ("content", "cls", "all")
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
    """Layer *values* chosen by ``layers`` (None = every recorded layer), checked against the cache."""
    recorded = shards.metadata.layers
    if layers is None:
        return tuple(recorded)
    as_string = string_layers_problem("layers", layers)
    if as_string is not None:
        raise LoaderError(as_string)
    chosen = (layers,) if isinstance(layers, (int, np.integer)) else tuple(layers)
    if not chosen:
        raise LoaderError(f"layers: expected at least one layer of {list(recorded)}, found none")
    values = []
    for layer in chosen:
        if not is_int(layer, numpy_ok=True) or int(layer) not in recorded:
            raise LoaderError(f"layers: expected recorded layer values {list(recorded)}, found {layer!r}")
        values.append(int(layer))
    if len(set(values)) != len(values):
        raise LoaderError(f"layers: expected distinct layer values, found {values}")
    return tuple(values)


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

    ``tokens`` is ``"content"`` (patches; positions ``cls_token .. T-1``), ``"cls"`` (position
    0, caches with a CLS token) or ``"all"``. ``ignore_labels`` drops content tokens whose
    ``labels.bin`` value is listed (CLS tokens have no label and are never dropped by it).
    ``skip_padding`` drops positions ``>= lengths[i]`` when the cache has a ``lengths`` column.
    The token masks: ``exclude_token_ids`` drops positions whose ``token_ids`` column value
    is listed (BOS, padding ids: a dump records the column); ``max_norm_multiple=k`` drops
    positions whose vector at any chosen layer has a norm above ``k`` times its layer's
    median norm (`saev_shards.reader.norms` defines both exactly; computed once, with ``progress``).
    Within an example the selected vectors are ordered by layer (metadata order), then token.
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
        self.layer_values = parse_layers(shards, layers)
        #: Positions of the chosen layers in ``metadata.layers``, ascending (disk order).
        self.layer_positions = np.array(sorted(shards.layer_index(v) for v in self.layer_values), dtype=np.int64)
        self.layer_values = tuple(md.layers[int(p)] for p in self.layer_positions)
        self.n_layers = len(self.layer_positions)
        if tokens not in TOKEN_CHOICES:
            raise LoaderError(f"tokens: expected one of {list(TOKEN_CHOICES)}, found {tokens!r}")
        if tokens == "cls" and not md.cls_token:
            raise LoaderError("tokens='cls': expected a cache with a CLS token (cls_token=true), found cls_token=false")
        self.tokens = tokens
        self.cls = int(md.cls_token)
        self.tokens_per_ex = md.tokens_per_ex
        base = np.zeros(md.tokens_per_ex, dtype=bool)
        if tokens in ("content", "all"):
            base[self.cls :] = True
        if tokens in ("cls", "all"):
            base[0] = True
        self.base_mask = base
        #: Token positions chosen when no per-example filter applies.
        self.base_tokens = np.flatnonzero(base).astype(np.int64)

        ignore = sorted({int(v) for v in ignore_labels})
        if any(not 0 <= v <= 255 for v in ignore):
            raise LoaderError(f"ignore_labels: expected uint8 label values 0..255, found {ignore}")
        if ignore and shards.manifest.labels is None:
            raise LoaderError(f"ignore_labels={ignore}: expected a cache with labels.bin, found none at {shards.path}")
        self.ignore_labels = np.array(ignore, dtype=np.uint8)
        self.has_labels = shards.manifest.labels is not None
        self.label_filter = bool(ignore) and tokens != "cls" and md.patches_per_ex > 0
        self.length_filter = bool(skip_padding) and "lengths" in shards.manifest.columns
        self.skip_padding = bool(skip_padding)
        self.exclude_token_ids = token_masks.parse_exclude_token_ids(exclude_token_ids, LoaderError)
        if len(self.exclude_token_ids):
            if "token_ids" not in shards.manifest.columns:
                raise LoaderError(
                    f"exclude_token_ids: expected a cache with a token_ids column (saev-shards dump records it), "
                    f"found columns {sorted(shards.manifest.columns)} at {shards.path}"
                )
            problem = token_masks.token_ids_problem(shards)
            if problem is not None:
                raise LoaderError(problem)
        multiple = norms.parse_multiple(max_norm_multiple, LoaderError)
        #: The tokens ``max_norm_multiple`` drops (None without it); computed here, once.
        self.norm_filter = (
            None
            if multiple is None
            else norms.norm_filter(shards, multiple, [int(p) for p in self.layer_positions], progress=progress)
        )
        #: True when the chosen tokens differ from example to example.
        self.varies = (
            self.label_filter
            or self.length_filter
            or bool(len(self.exclude_token_ids))
            or (self.norm_filter is not None)
        )
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
        """The chosen positions, and what each token mask took away from the rest (in order)."""
        mask = np.broadcast_to(self.base_mask, (len(examples), self.tokens_per_ex)).copy()
        if self.label_filter:
            if labels is None:
                labels = self.labels_of(examples)
            mask[:, self.cls :] &= ~np.isin(labels, self.ignore_labels)
        if self.length_filter:
            lengths = np.asarray(self.shards.columns["lengths"][examples]).astype(np.int64)
            mask &= np.arange(self.tokens_per_ex) < lengths[:, None]
        taken: dict[str, npt.NDArray[np.bool_]] = {}
        if len(self.exclude_token_ids):
            ids = token_masks.token_ids_of(self.shards, examples)
            taken["exclude_token_ids"] = mask & np.isin(ids, self.exclude_token_ids)
            mask &= ~taken["exclude_token_ids"]
        if self.norm_filter is not None:
            taken["max_norm_multiple"] = mask & self.norm_filter.dropped(examples)
            mask &= ~taken["max_norm_multiple"]
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
        """``(len(examples), patches_per_ex)`` labels of ``examples`` (sorted runs read fastest)."""
        labels = self.shards.labels
        if labels is None:
            raise LoaderError(f"labels: expected a cache with labels.bin, found none at {self.shards.path}")
        if len(examples) and examples[-1] - examples[0] + 1 == len(examples):  # one contiguous run
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
        cum = self._cumulative()
        return cum[np.asarray(examples, dtype=np.int64)]

    def _cumulative(self) -> npt.NDArray[np.int64]:
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
