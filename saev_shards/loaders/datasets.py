"""Map-style PyTorch datasets over a cache.

Every dataset works with ``torch.utils.data.DataLoader`` for any ``num_workers`` and
start method: it holds a `Shards` (which pickles without handles and memmaps lazily in
each process) and a few small numpy arrays, never an open file. torch is imported only
when an item is read, so ``import saev_shards`` needs numpy alone.

>>> ds = ExampleDataset(shards, layers=11)              # doctest: +SKIP
>>> ds[3]["acts"].shape                                  # doctest: +SKIP
torch.Size([197, 768])
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..errors import LoaderError
from ..protocol.jsonfile import is_int, short_repr
from ..reader import Shards
from ..reader.indexing import wrap_index
from .selection import (
    CLS_LABEL,
    TokenSelection,
    as_shards,
    check_layers_not_mixed,
    choose_sites,
    parse_layers,
    parse_out_dtype,
)
from .tensors import require_torch, to_tensor

if TYPE_CHECKING:
    from torch.utils.data import Dataset

    # Type checkers see torch's Dataset (DataLoader's parameter type); at run time the base is
    # object, so importing this module does not import torch.
    _MapDataset = Dataset[dict[str, Any]]
else:
    _MapDataset = object


class TokenDataset(_MapDataset):
    """index -> one token vector ``(D,)`` of one layer, with its example and token index.

    Items are dicts: ``acts`` (tensor ``(D,)``), ``example``, ``token`` (position on the T
    axis) and, when the cache has labels.bin, ``label`` (`CLS_LABEL` for a CLS token).
    Index ``i`` walks examples in order, then their chosen tokens in order.

    ``sites`` (a cache that records sites, protocol 3.2), instead of ``layer``: one site
    (``"module:io"``) is that slot; a list of sites gives each token at every one of them,
    ``acts`` ``(S, D)`` in the order listed and ``layers`` (their values).

    >>> ds = TokenDataset(shards, layer=11, tokens="content", ignore_labels=[0])  # doctest: +SKIP
    >>> DataLoader(ds, batch_size=4096, shuffle=True, num_workers=4)             # doctest: +SKIP
    """

    def __init__(
        self,
        shards: Shards | str | os.PathLike[str],
        layer: int | None = None,
        tokens: str = "content",
        ignore_labels: Iterable[int] = (),
        skip_padding: bool = True,
        out_dtype: str | None = None,
        *,
        exclude_token_ids: Iterable[int] = (),
        max_norm_multiple: float | None = None,
        sites: Any = None,
    ) -> None:
        require_torch(type(self).__name__)
        self.shards = as_shards(shards)
        recorded = self.shards.metadata.layers
        choice = choose_sites(self.shards, sites, layer)
        #: The sites each item holds, in order (``sites=`` a list); None otherwise.
        self.sites = choice.sites if choice is not None and choice.stacked else None
        chosen: int | Sequence[int] | None = layer
        if choice is not None:
            chosen = choice.layers if choice.stacked else choice.layers[0]
        elif layer is None:
            if len(recorded) != 1:
                raise LoaderError(
                    f"layer: expected one of {list(recorded)} (the cache records several, and a TokenDataset yields "
                    f"one layer; ExampleDataset and the token loaders can stack them), found None"
                )
            chosen = recorded[0]
        self.selection = TokenSelection(
            self.shards, chosen, tokens, ignore_labels, skip_padding, exclude_token_ids, max_norm_multiple
        )
        stacked = choice is not None and self.sites is not None
        self.layer = choice.layers[0] if choice is not None and stacked else self.selection.layer_values[0]
        self.layer_position = self.shards.layer_index(self.layer)
        #: Stacked sites: their layer values and positions, in the order asked.
        self.layers = None if choice is None or self.sites is None else choice.layers
        self._positions = None if self.layers is None else [self.shards.layer_index(v) for v in self.layers]
        self.out_dtype = parse_out_dtype(self.shards, out_dtype)
        counts = self.selection.counts
        per_example = len(self.selection.base_tokens)
        self._len = int(counts.sum()) if counts is not None else self.shards.n_examples * per_example

    def __len__(self) -> int:
        return self._len

    def locate(self, index: int) -> tuple[int, int]:
        """``(example, token)`` of item ``index``."""
        i = wrap_index(int(index), self._len, "index", "for a dataset of {n} tokens")
        sel = self.selection
        if not sel.varies:
            per_example = len(sel.base_tokens)
            return i // per_example, int(sel.base_tokens[i % per_example])
        cum = sel.cumulative()
        example = int(np.searchsorted(cum, i, side="right")) - 1
        return example, int(sel.tokens_of(example)[i - int(cum[example])])

    def __getitem__(self, index: int) -> dict[str, Any]:
        example, token = self.locate(index)
        shard, local = divmod(example, self.shards.examples_per_shard)
        where: int | list[int] = self.layer_position if self._positions is None else self._positions
        raw = np.array(self.shards.shard(shard)[local, where, token])  # (D,), or (S, D) for stacked sites
        scales = None
        if self.shards.scales is not None:  # float8_e4m3: the vector's scale, by the same arithmetic
            scales = np.array(self.shards.scale_shard(shard)[local, where, token])
            md = self.shards.metadata
            slots = np.asarray(where, dtype=np.int64)
            self.shards.check_scales(scales, lambda: (example * md.n_layers + slots) * md.tokens_per_ex + token)
        item: dict[str, Any] = {
            "acts": to_tensor(raw, self.shards.dtype, self.out_dtype, scales),
            "example": example,
            "token": token,
        }
        if self.layers is not None:
            import torch

            item["layers"] = torch.tensor(self.layers, dtype=torch.int64)
        if self.selection.has_labels:
            labels = self.shards.labels
            assert labels is not None
            cls = self.selection.cls
            item["label"] = CLS_LABEL if token < cls else int(labels[example, token - cls])
        return item


class ExampleDataset(_MapDataset):
    """index -> the ``(T, D)`` slice of one ``(example, layer)`` pair, read with one ``pread``.

    With one layer, index ``i`` is example ``i``. With several (a cache of more than one
    layer and ``layers=None``, or a list), say how they come: ``stack_layers=True`` gives
    example ``i`` at every chosen layer, ``acts`` ``(L, T, D)`` and ``layers`` (values);
    ``mix_layers=True`` makes index ``i`` example ``i // n_layers`` at the ``i % n_layers``-th
    chosen layer, so a shuffled DataLoader mixes layers in a batch. Items are dicts: ``acts``,
    ``example``, ``layer`` (the layer value; ``layers`` when stacked), ``length`` when the cache
    has a lengths column, and ``labels`` ``(patches_per_ex,)`` when ``with_labels`` is set.
    No other activation bytes are read. ``sites`` (a cache that records sites), instead of
    ``layers``: one site, or a list of them stacked ``(S, T, D)`` in the order listed.
    """

    def __init__(
        self,
        shards: Shards | str | os.PathLike[str],
        layers: int | Sequence[int] | None = None,
        out_dtype: str | None = None,
        with_labels: bool = False,
        *,
        stack_layers: bool = False,
        mix_layers: bool = False,
        sites: Any = None,
    ) -> None:
        require_torch(type(self).__name__)
        self.shards = as_shards(shards)
        choice = choose_sites(self.shards, sites, layers)
        if choice is not None:
            layers = choice.layers if choice.stacked else choice.layers[0]
            stack_layers = bool(stack_layers) or (choice.stacked and not mix_layers)
        #: The sites asked for (``sites=``), in the order items hold them; None without.
        self.sites = None if choice is None else choice.sites
        self.layers = parse_layers(self.shards, layers)
        self.stack_layers = bool(stack_layers)
        check_layers_not_mixed(self.shards, self.layers, self.stack_layers, bool(mix_layers))
        self.layer_positions = tuple(self.shards.layer_index(v) for v in self.layers)
        self.out_dtype = parse_out_dtype(self.shards, out_dtype)
        if with_labels and self.shards.manifest.labels is None:
            raise LoaderError(f"with_labels=True: expected a cache with labels.bin, found none at {self.shards.path}")
        self.with_labels = with_labels
        self.has_lengths = "lengths" in self.shards.manifest.columns

    def __len__(self) -> int:
        return self.shards.n_examples * (1 if self.stack_layers else len(self.layers))

    def __getitem__(self, index: int) -> dict[str, Any]:
        float8 = self.shards.scales is not None  # float8_e4m3: each slice's scales, by the same arithmetic
        if self.stack_layers:
            import torch

            example = wrap_index(int(index), len(self), "index", "for a dataset of {n} examples")
            md = self.shards.metadata
            raw = np.empty((len(self.layers), md.tokens_per_ex, md.d_model), dtype=self.shards.numpy_dtype)
            scales = np.empty((len(self.layers), md.tokens_per_ex), np.float32) if float8 else None
            for j, position in enumerate(self.layer_positions):
                self.shards.read_example_raw(example, position, raw[j])
                if scales is not None:
                    self.shards.read_example_scales(example, position, scales[j])
            item: dict[str, Any] = {
                "acts": to_tensor(raw, self.shards.dtype, self.out_dtype, scales),
                "example": example,
                "layers": torch.tensor(self.layers, dtype=torch.int64),
            }
        else:
            i = wrap_index(int(index), len(self), "index", "for a dataset of {n} (example, layer) slices")
            example, which = divmod(i, len(self.layers))
            position = self.layer_positions[which]
            raw = self.shards.read_example_raw(example, position)
            slice_scales = self.shards.read_example_scales(example, position) if float8 else None
            item = {
                "acts": to_tensor(raw, self.shards.dtype, self.out_dtype, slice_scales),
                "example": example,
                "layer": self.layers[which],
            }
        if self.has_lengths:
            item["length"] = int(self.shards.columns["lengths"][example])
        if self.with_labels:
            labels = self.shards.labels
            assert labels is not None
            item["labels"] = np.array(labels[example])
        return item


class LayerPairDataset(_MapDataset):
    """saev's own training pattern (pairs of layers): index -> example ``i`` at 2 random distinct layers, ``(2, T, D)``.

    The pair is drawn from ``(seed, epoch, i)``, so every worker and every rerun agrees;
    `set_epoch` draws new pairs (call it before each epoch; persistent workers keep the
    epoch they were started with). Two ``pread`` calls per item, nothing else is read.
    Items are dicts ``acts`` ``(2, T, D)``, ``example`` and ``layers`` (int64 ``(2,)``, values),
    so ``DataLoader(ds, batch_size=b, shuffle=True)`` yields ``(b, 2, T, D)`` batches.
    """

    def __init__(
        self,
        shards: Shards | str | os.PathLike[str],
        layers: Sequence[int] | None = None,
        seed: int = 0,
        out_dtype: str | None = None,
    ) -> None:
        require_torch(type(self).__name__)
        self.shards = as_shards(shards)
        self.layers = parse_layers(self.shards, layers)
        if len(self.layers) < 2:
            raise LoaderError(f"layers: expected at least 2 layers to draw pairs from, found {list(self.layers)}")
        self.layer_positions = np.array([self.shards.layer_index(v) for v in self.layers], dtype=np.int64)
        self.out_dtype = parse_out_dtype(self.shards, out_dtype)
        if int(seed) < 0:
            raise LoaderError(f"seed: expected an integer >= 0, found {seed}")
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Draw the pairs of epoch ``epoch`` from now on."""
        if not (is_int(epoch, numpy_ok=True) and 0 <= epoch < 2**63):
            raise LoaderError(f"epoch: expected an integer >= 0, found {short_repr(epoch)}")
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.shards.n_examples

    def pair(self, example: int) -> npt.NDArray[np.int64]:
        """Indices into `layers` of the two layers drawn for ``example`` this epoch."""
        rng = np.random.default_rng([self.seed, self.epoch, example])
        return rng.choice(len(self.layers), size=2, replace=False).astype(np.int64)

    def __getitem__(self, index: int) -> dict[str, Any]:
        import torch

        example = wrap_index(int(index), len(self), "index", "for a dataset of {n} examples")
        which = self.pair(example)
        md = self.shards.metadata
        raw = np.empty((2, md.tokens_per_ex, md.d_model), dtype=self.shards.numpy_dtype)
        scales = np.empty((2, md.tokens_per_ex), np.float32) if self.shards.scales is not None else None
        for j in range(2):
            position = int(self.layer_positions[which[j]])
            self.shards.read_example_raw(example, position, raw[j])
            if scales is not None:
                self.shards.read_example_scales(example, position, scales[j])
        values = np.array(self.layers, dtype=np.int64)[which]
        return {
            "acts": to_tensor(raw, self.shards.dtype, self.out_dtype, scales),
            "example": example,
            "layers": torch.from_numpy(values),
        }
