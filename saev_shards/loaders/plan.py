"""The plan of an epoch: read spans, the windows of this rank, and each window's order.

numpy (and compiled kernels where numba is installed: `codecs.gather`), no torch and no
activation I/O (only the selection's label and length columns are read), so the order of any
epoch can be computed, tested and measured from metadata.

A *unit* is one row of a batch: a token vector ``(D,)``, or with stacked layers the
``(L, D)`` vectors of one ``(example, token)`` at every chosen layer.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from ..codecs import gather
from ..reader import Shards
from ..world import share
from .selection import CLS_LABEL, TokenSelection

#: Default bytes per read block: large enough that a request costs what the disk streams.
BLOCK_BYTES = 4 << 20
#: Below this many bytes per ``(example, layer)`` slice, a proper subset of layers is read
#: as whole examples (one large read, discarding the other layers) instead of slice by slice.
MIN_SLICE_READ = 128 << 10


class ReadSpans:
    """What the loaders read at once: runs of consecutive examples inside one shard, about
    ``block_bytes`` each (one ``pread``, or one per ``(example, layer)`` slice), with the units
    they hold. (A *block* is a 16 MiB piece of blocks.json's digests; the loaders' keyword
    ``block_bytes`` keeps its name.)"""

    def __init__(
        self,
        shards: Shards,
        selection: TokenSelection,
        block_bytes: int,
        stack_layers: bool = False,
    ) -> None:
        md = shards.metadata
        slice_bytes = md.tokens_per_ex * md.d_model * md.itemsize
        #: Whole examples are read when every layer is chosen or slices are small.
        self.whole = selection.n_layers == md.n_layers or slice_bytes < MIN_SLICE_READ
        #: ``(T, D)`` slices each example occupies in a window buffer.
        self.rows_per_ex = md.n_layers if self.whole else selection.n_layers
        #: Position of each chosen layer among an example's rows in the buffer.
        self.slots = selection.layer_positions if self.whole else np.arange(selection.n_layers, dtype=np.int64)
        self.read_positions = selection.layer_positions
        #: Layer value of each slot of an example's rows (0 for rows read but not chosen).
        self.slot_layer = np.zeros(self.rows_per_ex, dtype=np.int64)
        self.slot_layer[self.slots] = np.array(selection.layer_values, dtype=np.int64)
        self.stack_layers = bool(stack_layers)
        #: Token vectors in one unit: every chosen layer when stacked, else one.
        self.layers_per_unit = selection.n_layers if self.stack_layers else 1
        ex_bytes = self.rows_per_ex * slice_bytes
        self.examples_per_span = max(1, block_bytes // max(1, ex_bytes))

        n, eps = shards.n_examples, shards.examples_per_shard
        n_shards = shards.n_shards
        shard_lo = np.arange(n_shards, dtype=np.int64) * eps
        shard_hi = np.minimum(shard_lo + eps, n)
        per_shard = -(-(shard_hi - shard_lo) // self.examples_per_span)
        shard_of_block = np.repeat(np.arange(n_shards, dtype=np.int64), per_shard)
        first = np.zeros(n_shards, dtype=np.int64)
        np.cumsum(per_shard[:-1], out=first[1:])
        within = np.arange(len(shard_of_block), dtype=np.int64) - first[shard_of_block]
        start = shard_lo[shard_of_block] + within * self.examples_per_span
        stop = np.minimum(start + self.examples_per_span, shard_hi[shard_of_block])
        tokens = selection.tokens_before(stop) - selection.tokens_before(start)
        units = tokens if self.stack_layers else tokens * selection.n_layers
        keep = units > 0  # spans whose tokens are all filtered out are never read
        self.start = start[keep]
        self.stop = stop[keep]
        self.shard = shard_of_block[keep]
        #: Units (batch rows) each block yields.
        self.units = units[keep]
        #: ``(T, D)`` slices each block occupies in a window buffer.
        self.rows = (self.stop - self.start) * self.rows_per_ex
        self.total = int(self.units.sum())
        self.max_rows = int(self.rows.max()) if len(self.rows) else 0

    def __len__(self) -> int:
        return len(self.start)


@dataclasses.dataclass
class Window:
    """Consecutive spans of one epoch's stream, loaded together and shuffled together."""

    index: int
    spans: npt.NDArray[np.int64]
    trim_lo: int  # units of the first block that belong to the previous rank
    trim_hi: int  # units of the last block that belong to the next rank
    n_units: int


@dataclasses.dataclass
class EpochPlan:
    """This rank's windows of one epoch and where each starts in its stream of units."""

    windows: list[Window]
    window_start: npt.NDArray[np.int64]  # stream position of each window's first unit, then the total
    n_units: int
    n_batches: int
    batch_size: int

    def batch_range(self, batch: int) -> tuple[int, int]:
        """Stream positions ``[lo, hi)`` of batch ``batch``."""
        lo = batch * self.batch_size
        return lo, min(lo + self.batch_size, self.n_units)

    def __post_init__(self) -> None:
        self._starts: list[int] = self.window_start.tolist()

    def segments(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """``(window, first, stop)`` pieces of stream positions ``[lo, hi)``, positions local to each window.

        Pure Python: every gather task calls it, and a numpy call that lets go of the GIL
        (``searchsorted`` does) costs a wait to take it back while other threads hold it:
        0.4 ms on average on the 2-core development machine, more than the search itself.
        """
        starts = self._starts
        w = bisect.bisect_right(starts, lo) - 1
        out = []
        while lo < hi:
            start, end = starts[w], starts[w + 1]
            take = min(hi, end)
            if take > lo:
                out.append((w, lo - start, take - start))
            lo = take
            w += 1
        return out


def plan_epoch(
    spans: ReadSpans,
    order: npt.NDArray[np.int64],
    rank: int,
    world_size: int,
    window_rows: int,
    batch_size: int,
    drop_last: bool,
    first_window_rows: int | None = None,
) -> EpochPlan:
    """Cut the block stream ``order`` into this rank's share, then into windows of ``window_rows``
    (the first of ``first_window_rows`` when given and smaller: an order whose windows are not
    permuted gives the same batches however they are cut, and a small first window is read sooner)."""
    units = spans.units[order]
    cum = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(units, out=cum[1:])
    total = int(cum[-1])
    mine_range = share(total, rank, world_size)
    lo, hi = mine_range.start, mine_range.stop
    first = int(np.searchsorted(cum[1:], lo, side="right"))
    end = int(np.searchsorted(cum[:-1], hi, side="left"))
    mine = order[first:end]
    n_local = hi - lo
    if drop_last:
        n_batches = (total // world_size) // batch_size  # the same on every rank
    else:
        n_batches = -(-n_local // batch_size)
    if n_local == 0:
        return EpochPlan([], np.zeros(1, dtype=np.int64), 0, n_batches, batch_size)
    # A block joins the window its first row falls in: every window holds at most
    # window_rows + one block's rows, and all but the last are at least window_rows.
    rows = spans.rows[mine]
    row_start = np.zeros(len(mine), dtype=np.int64)
    np.cumsum(rows[:-1], out=row_start[1:])
    window_of = row_start // max(1, window_rows)
    if first_window_rows is not None and first_window_rows < window_rows:
        first_rows = max(1, first_window_rows)
        window_of = np.where(row_start < first_rows, 0, 1 + (row_start - first_rows) // max(1, window_rows))
    cuts = np.flatnonzero(np.diff(window_of)) + 1
    groups = np.split(np.arange(len(mine)), cuts)
    trim_lo, trim_hi = lo - int(cum[first]), int(cum[end]) - hi
    windows = []
    position = 0
    starts = []
    for w, group in enumerate(groups):
        ids = mine[group]
        n = int(spans.units[ids].sum())
        t_lo = trim_lo if group[0] == 0 else 0
        t_hi = trim_hi if group[-1] == len(mine) - 1 else 0
        n -= t_lo + t_hi
        windows.append(Window(w, ids, t_lo, t_hi, n))
        starts.append(position)
        position += n
    starts.append(position)
    return EpochPlan(windows, np.array(starts, dtype=np.int64), n_local, n_batches, batch_size)


@dataclasses.dataclass
class WindowIndex:
    """Every unit of a loaded window, in the order the batches take them.

    ``flat`` indexes the window buffer viewed as ``(rows * T, D)`` vectors: ``(n,)``, or
    ``(n, L)`` with stacked layers. The other columns are the batches' metadata, computed
    once per window so that a batch only slices them.
    """

    flat: npt.NDArray[np.int64]
    examples: npt.NDArray[np.int64]
    tokens: npt.NDArray[np.int64]
    layers: npt.NDArray[np.int64] | None  # layer value of each unit; None with stacked layers
    labels: npt.NDArray[np.uint8] | None  # labels.bin value (CLS_LABEL at CLS); None without labels.bin

    def __len__(self) -> int:
        return len(self.flat)


#: Where the rows of a window's examples are in the array its gathers read: ``(first vector
#: of each example, offset in vectors of each slot)``, given the window's examples (global
#: indices) and its `ReadSpans`. None: the window's buffer, examples back to back.
RowSource = Callable[[npt.NDArray[np.int64], ReadSpans], tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]]


def index_window(
    selection: TokenSelection,
    spans: ReadSpans,
    window: Window,
    rng: np.random.Generator | None,
    source: RowSource | None = None,
) -> WindowIndex:
    """Where each chosen unit of ``window`` is, permuted by ``rng`` (if any).

    By default in the window's buffer: its spans back to back, each example as
    ``rows_per_ex`` ``(T, D)`` slices; ``source`` says where else the rows are (the cache
    read in place: `mapped.CacheMap.source`). Before the permutation, units are listed by
    example, layer, token (by example, token with stacked layers).
    """
    starts, stops = spans.start[window.spans], spans.stop[window.spans]
    sizes = stops - starts
    ex_first = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], out=ex_first[1:])
    n_ex = int(sizes.sum())
    examples = np.repeat(starts - ex_first, sizes) + np.arange(n_ex, dtype=np.int64)
    tokens = selection.tokens_per_ex
    labels = None
    if selection.has_labels:
        # One read for the window (one slice where its examples are consecutive), not one per span.
        labels = np.full((n_ex, tokens), CLS_LABEL, dtype=np.uint8)
        labels[:, selection.cls :] = selection.labels_of(examples)
    slots = spans.slots.astype(np.int32)
    n_slots = 1 if spans.stack_layers else len(slots)  # slots enumerated per unit
    if source is None:  # the window buffer
        ex_vector = np.arange(n_ex, dtype=np.int64) * (spans.rows_per_ex * tokens)
        slot_vector = np.arange(spans.rows_per_ex, dtype=np.int64) * tokens
    else:
        ex_vector, slot_vector = source(examples, spans)
    stacked = slot_vector[spans.slots] if spans.stack_layers else None
    # Compiled (`codecs.gather`): the columns in one pass over the permuted units, the same values.
    where = gather.Rows(ex_vector, slot_vector, stacked, examples, spans.slot_layer, labels, tokens)
    if not selection.varies:
        # Unit u (in example, layer, token order) is example u // per_ex, slot and token from
        # the rest: computed from the permuted unit numbers, no gather of unit-sized arrays.
        chosen = selection.base_tokens.astype(np.int64)
        per_ex = n_slots * len(chosen)
        lo, hi = window.trim_lo, n_ex * per_ex - window.trim_hi
        order = None if rng is None else rng.permutation(hi - lo)
        columns = gather.window_index(order, lo, hi - lo, per_ex, slots, chosen, where)
        if columns is not None:
            return WindowIndex(*columns)
        unit = np.arange(lo, hi, dtype=np.int64) if order is None else order + lo
        ex_c, rest = np.divmod(unit, per_ex)
        s_c, t_c = np.divmod(rest, len(chosen))
        slot_c, tok_c = slots[s_c], chosen[t_c]
    else:
        ex_c, slot_c, tok_c = _listed_units(selection, window, examples, labels, slots[:n_slots])
        listed_order = None if rng is None else rng.permutation(len(ex_c))
        columns = gather.window_index_listed(listed_order, (ex_c, slot_c, tok_c), where)
        if columns is not None:
            return WindowIndex(*columns)
        if listed_order is not None:
            ex_c, slot_c, tok_c = ex_c[listed_order], slot_c[listed_order], tok_c[listed_order]
    first = ex_vector[ex_c]
    if stacked is not None:
        flat = first[:, None] + stacked[None, :] + tok_c[:, None]
        layer_col = None
    else:
        flat = first + slot_vector[slot_c] + tok_c
        layer_col = spans.slot_layer[slot_c]
    label_col = None if labels is None else labels.ravel()[ex_c * tokens + tok_c]
    return WindowIndex(flat, examples[ex_c], tok_c, layer_col, label_col)


def _listed_units(
    selection: TokenSelection,
    window: Window,
    examples: npt.NDArray[np.int64],
    labels: npt.NDArray[np.uint8] | None,
    slots: npt.NDArray[np.int32],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32], npt.NDArray[np.int64]]:
    """The units of a window whose examples hold different tokens, ``(example in the window, slot,
    token)``, in example, slot, token order (``slots``: those enumerated per unit), trimmed to the
    rank's share."""
    n_ex, n_slots = len(examples), len(slots)
    mask = selection.mask(examples, None if labels is None else labels[:, selection.cls :])
    counts = mask.sum(axis=1).astype(np.int64)
    ex_j, tok_j = np.nonzero(mask)
    first_of_ex = np.zeros(n_ex, dtype=np.int64)
    np.cumsum(counts[:-1], out=first_of_ex[1:])
    rank_j = np.arange(len(ex_j), dtype=np.int64) - first_of_ex[ex_j]
    # Position in (example, layer, token) order of entry j at the s-th chosen layer.
    position = (first_of_ex[ex_j] * n_slots + rank_j)[None, :] + (
        np.arange(n_slots, dtype=np.int64)[:, None] * counts[ex_j][None, :]
    )
    position = position.ravel()
    ex_c = np.empty(len(position), dtype=np.int64)
    tok_c = np.empty(len(position), dtype=np.int64)
    slot_c = np.empty(len(position), dtype=np.int32)
    ex_c[position] = np.tile(ex_j, n_slots)
    tok_c[position] = np.tile(tok_j.astype(np.int64), n_slots)
    slot_c[position] = np.repeat(slots, len(ex_j))
    if window.trim_lo or window.trim_hi:
        keep = slice(window.trim_lo, len(ex_c) - window.trim_hi)
        ex_c, slot_c, tok_c = ex_c[keep], slot_c[keep], tok_c[keep]
    return ex_c, slot_c, tok_c
