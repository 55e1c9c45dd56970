"""PyTorch training loaders: shuffled batches of token vectors at disk speed, and ordered walks.

`ShuffledLoader` is the training path. Each epoch it cuts the cache into blocks of whole
examples (``block_bytes``, 4 MiB by default; one ``pread`` each, or one per ``(example,
layer)`` when few layers of large slices are chosen), permutes the blocks over the whole
cache, loads consecutive runs of them into a shuffle window (``buffer_bytes``) with
background threads, permutes every chosen token vector of the window, and gathers batches
with one vectorised ``take``. Two windows are held: one is consumed while the next loads.
Everything random is drawn from ``(seed, epoch, window)``, so the batches do not depend on
thread timing and `state_dict` resumes mid-epoch exactly. docs/loaders.md documents the
shuffle quality.

`OrderedLoader` walks the same selection in ``(example, layer, token)`` order with
sequential reads. The map-style datasets live in `saev_shards.datasets` and are
re-exported here. torch is imported when a loader is created, never at import time.

>>> loader = ShuffledLoader(shards, batch_size=4096, layers=11, out_dtype="float32")  # doctest: +SKIP
>>> for batch in loader:                                                             # doctest: +SKIP
...     loss = sae(batch.acts.cuda(non_blocking=True))
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import queue
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .datasets import (
    CLS_LABEL,
    ExampleDataset,
    LayerPairDataset,
    TokenDataset,
    TokenSelection,
    as_shards,
    parse_out_dtype,
    to_tensor,
    torch_dtype,
)
from .errors import LoaderError
from .reader import Shards

if TYPE_CHECKING:
    import torch

__all__ = [
    "CLS_LABEL",
    "Batch",
    "ExampleDataset",
    "LayerPairDataset",
    "LoaderError",
    "OrderedLoader",
    "ShuffledLoader",
    "TokenDataset",
    "TokenSelection",
]

#: Default bytes per read block: large enough that a request costs what the disk streams.
BLOCK_BYTES = 4 << 20
#: Below this many bytes per ``(example, layer)`` slice, a proper subset of layers is read
#: as whole examples (one large read, discarding the other layers) instead of slice by slice.
MIN_SLICE_READ = 128 << 10
#: Fewest rows a gather thread copies: below this, handing work to a thread costs more than it saves.
_MIN_GATHER_ROWS = 1024


@dataclasses.dataclass
class Batch:
    """One batch of token vectors and where each came from."""

    #: ``(B, D)`` activations (stored dtype, or the loader's ``out_dtype``).
    acts: torch.Tensor
    #: ``(B,)`` int64 example indices.
    examples: torch.Tensor
    #: ``(B,)`` int64 positions on the T axis (0 is CLS when the cache has one).
    tokens: torch.Tensor
    #: ``(B,)`` int64 layer values (not positions).
    layers: torch.Tensor
    #: ``(B,)`` uint8 patch labels (`CLS_LABEL` for CLS tokens), or None without labels.bin.
    labels: torch.Tensor | None

    def __len__(self) -> int:
        return int(self.acts.shape[0])

    def to(self, device: Any, non_blocking: bool = False) -> Batch:
        """The same batch on ``device`` (use ``non_blocking`` with ``pin_memory=True``)."""
        labels = None if self.labels is None else self.labels.to(device, non_blocking=non_blocking)
        return Batch(
            self.acts.to(device, non_blocking=non_blocking),
            self.examples.to(device, non_blocking=non_blocking),
            self.tokens.to(device, non_blocking=non_blocking),
            self.layers.to(device, non_blocking=non_blocking),
            labels,
        )


# --------------------------------------------------------------------------------------
# the plan: blocks, epochs, windows (pure numpy, no I/O beyond the selection counts)


class _Blocks:
    """Read units: runs of consecutive examples inside one shard, with their chosen vectors."""

    def __init__(self, shards: Shards, selection: TokenSelection, block_bytes: int) -> None:
        md = shards.metadata
        slice_bytes = md.tokens_per_ex * md.d_model * md.itemsize
        #: Whole examples are read when every layer is chosen or slices are small.
        self.whole = selection.n_layers == md.n_layers or slice_bytes < MIN_SLICE_READ
        #: ``(T, D)`` slices each example occupies in a window buffer.
        self.rows_per_ex = md.n_layers if self.whole else selection.n_layers
        #: Position of each chosen layer among an example's rows in the buffer.
        self.slots = selection.layer_positions if self.whole else np.arange(selection.n_layers, dtype=np.int64)
        self.read_positions = selection.layer_positions
        ex_bytes = self.rows_per_ex * slice_bytes
        self.examples_per_block = max(1, block_bytes // max(1, ex_bytes))

        n, eps = shards.n_examples, shards.examples_per_shard
        n_shards = shards.n_shards
        shard_lo = np.arange(n_shards, dtype=np.int64) * eps
        shard_hi = np.minimum(shard_lo + eps, n)
        per_shard = -(-(shard_hi - shard_lo) // self.examples_per_block)
        shard_of_block = np.repeat(np.arange(n_shards, dtype=np.int64), per_shard)
        first = np.zeros(n_shards, dtype=np.int64)
        np.cumsum(per_shard[:-1], out=first[1:])
        within = np.arange(len(shard_of_block), dtype=np.int64) - first[shard_of_block]
        start = shard_lo[shard_of_block] + within * self.examples_per_block
        stop = np.minimum(start + self.examples_per_block, shard_hi[shard_of_block])
        vectors = (selection.tokens_before(stop) - selection.tokens_before(start)) * selection.n_layers
        keep = vectors > 0  # blocks whose tokens are all filtered out are never read
        self.start = start[keep]
        self.stop = stop[keep]
        self.shard = shard_of_block[keep]
        self.vectors = vectors[keep]
        self.rows = (self.stop - self.start) * self.rows_per_ex
        self.total = int(self.vectors.sum())
        self.max_rows = int(self.rows.max()) if len(self.rows) else 0

    def __len__(self) -> int:
        return len(self.start)


@dataclasses.dataclass
class _Window:
    """Consecutive blocks of one epoch's stream, loaded together and shuffled together."""

    index: int
    blocks: npt.NDArray[np.int64]
    trim_lo: int  # vectors of the first block that belong to the previous rank
    trim_hi: int  # vectors of the last block that belong to the next rank
    n_vectors: int


@dataclasses.dataclass
class _EpochPlan:
    windows: list[_Window]
    window_start: npt.NDArray[np.int64]  # stream position of each window's first vector
    n_vectors: int
    n_batches: int


def _rank_range(total: int, rank: int, world_size: int) -> tuple[int, int]:
    return rank * total // world_size, (rank + 1) * total // world_size


def _plan_epoch(
    blocks: _Blocks,
    order: npt.NDArray[np.int64],
    rank: int,
    world_size: int,
    window_rows: int,
    batch_size: int,
    drop_last: bool,
) -> _EpochPlan:
    vectors = blocks.vectors[order]
    cum = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(vectors, out=cum[1:])
    total = int(cum[-1])
    lo, hi = _rank_range(total, rank, world_size)
    first = int(np.searchsorted(cum[1:], lo, side="right"))
    end = int(np.searchsorted(cum[:-1], hi, side="left"))
    mine = order[first:end]
    n_local = hi - lo
    if drop_last:
        n_batches = (total // world_size) // batch_size  # the same on every rank
    else:
        n_batches = -(-n_local // batch_size)
    if n_local == 0:
        return _EpochPlan([], np.zeros(1, dtype=np.int64), 0, n_batches)
    # A block joins the window its first row falls in: every window holds at most
    # window_rows + one block's rows, and all but the last are at least window_rows.
    rows = blocks.rows[mine]
    row_start = np.zeros(len(mine), dtype=np.int64)
    np.cumsum(rows[:-1], out=row_start[1:])
    window_of = row_start // max(1, window_rows)
    cuts = np.flatnonzero(np.diff(window_of)) + 1
    groups = np.split(np.arange(len(mine)), cuts)
    trim_lo, trim_hi = lo - int(cum[first]), int(cum[end]) - hi
    windows = []
    position = 0
    starts = []
    for w, group in enumerate(groups):
        ids = mine[group]
        n = int(blocks.vectors[ids].sum())
        t_lo = trim_lo if group[0] == 0 else 0
        t_hi = trim_hi if group[-1] == len(mine) - 1 else 0
        n -= t_lo + t_hi
        windows.append(_Window(w, ids, t_lo, t_hi, n))
        starts.append(position)
        position += n
    starts.append(position)
    return _EpochPlan(windows, np.array(starts, dtype=np.int64), n_local, n_batches)


@dataclasses.dataclass
class _WindowIndex:
    """Every vector of a loaded window, in the order the batches take them.

    Batches turn the compact int32 columns into their int64 and uint8 outputs with one small
    gather each (which also gives them fresh arrays of their own).
    """

    flat: npt.NDArray[np.int64]  # vector index into the buffer ``(rows * T, D)``
    ex_local: npt.NDArray[np.int32]  # example slot in the window
    tokens: npt.NDArray[np.int32]
    slots: npt.NDArray[np.int32]  # layer slot of the example's rows
    examples: npt.NDArray[np.int64]  # global example of each example slot
    labels: npt.NDArray[np.uint8] | None  # (n_examples_in_window * T,): labels.bin rows, CLS_LABEL at CLS

    def __len__(self) -> int:
        return len(self.flat)


def _index_window(
    selection: TokenSelection,
    blocks: _Blocks,
    window: _Window,
    rng: np.random.Generator | None,
) -> _WindowIndex:
    """Where each chosen vector of ``window`` lands in its buffer, permuted by ``rng`` (if any).

    The buffer holds the window's blocks back to back, each example as ``rows_per_ex``
    ``(T, D)`` slices; vectors are listed by example, layer, token before the permutation.
    """
    starts, stops = blocks.start[window.blocks], blocks.stop[window.blocks]
    sizes = stops - starts
    ex_first = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], out=ex_first[1:])
    n_ex = int(sizes.sum())
    examples = np.repeat(starts - ex_first, sizes) + np.arange(n_ex, dtype=np.int64)
    tokens = selection.tokens_per_ex
    labels = None
    if selection.has_labels:
        rows = [selection.labels_of(np.arange(a, b)) for a, b in zip(starts.tolist(), stops.tolist(), strict=True)]
        labels = np.full((n_ex, tokens), CLS_LABEL, dtype=np.uint8)
        labels[:, selection.cls :] = np.concatenate(rows)
    slots = blocks.slots.astype(np.int32)
    n_slots = len(slots)
    if not selection.varies:
        chosen = selection.base_tokens.astype(np.int32)
        per_ex = n_slots * len(chosen)
        ex_c = np.repeat(np.arange(n_ex, dtype=np.int32), per_ex)
        slot_c = np.tile(np.repeat(slots, len(chosen)), n_ex)
        tok_c = np.tile(chosen, n_ex * n_slots)
    else:
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
        ex_c = np.empty(len(position), dtype=np.int32)
        tok_c = np.empty(len(position), dtype=np.int32)
        slot_c = np.empty(len(position), dtype=np.int32)
        ex_c[position] = np.tile(ex_j.astype(np.int32), n_slots)
        tok_c[position] = np.tile(tok_j.astype(np.int32), n_slots)
        slot_c[position] = np.repeat(slots, len(ex_j))
    if window.trim_lo or window.trim_hi:
        keep = slice(window.trim_lo, len(ex_c) - window.trim_hi)
        ex_c, slot_c, tok_c = ex_c[keep], slot_c[keep], tok_c[keep]
    if rng is not None:
        order = rng.permutation(len(ex_c))
        ex_c, slot_c, tok_c = ex_c[order], slot_c[order], tok_c[order]
    flat = (ex_c.astype(np.int64) * blocks.rows_per_ex + slot_c) * tokens + tok_c
    return _WindowIndex(flat, ex_c, tok_c, slot_c, examples, None if labels is None else labels.ravel())


class _Recycler:
    """Output arrays handed out as tensors, reused once nothing outside refers to them.

    A fresh multi-megabyte array costs a page fault per 4 KiB on first touch, which
    halves the gather rate. ``torch.from_numpy`` keeps a reference to its array for as long
    as any tensor or view of that memory lives, so an array whose only reference is ours
    is free. At most ``keep`` arrays are remembered; when all are in use a new one is made.
    """

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.arrays: list[npt.NDArray[Any]] = []
        probe = [np.empty(1)]
        self.free_refs = sys.getrefcount(probe[0])  # the list's reference and the argument's

    def get(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
        for i in range(len(self.arrays)):
            if sys.getrefcount(self.arrays[i]) == self.free_refs:
                arr = self.arrays.pop(i)
                if arr.shape == shape and arr.dtype == dtype:
                    self.arrays.append(arr)
                    return arr
                break  # a batch of another size (the last): drop it, make one below
        arr = np.empty(shape, dtype=dtype)
        self.arrays.append(arr)
        if len(self.arrays) > self.keep:
            del self.arrays[0]
        return arr


# --------------------------------------------------------------------------------------
# the loaders


class _Config:
    """Everything a running epoch needs; holds no reference to the loader object."""

    def __init__(
        self,
        shards: Shards,
        selection: TokenSelection,
        blocks: _Blocks,
        batch_size: int,
        out_dtype: str,
        pin_memory: bool,
        read_threads: int,
        prefetch: int,
        gather_threads: int,
    ) -> None:
        self.shards = shards
        self.selection = selection
        self.blocks = blocks
        self.batch_size = batch_size
        self.out_dtype = out_dtype
        self.pin_memory = pin_memory
        self.read_threads = read_threads
        self.prefetch = prefetch
        self.gather_threads = gather_threads
        md = shards.metadata
        self.tokens = md.tokens_per_ex
        self.d_model = md.d_model
        self.stored = md.dtype
        self.numpy_dtype = shards.numpy_dtype
        slot_layer = np.zeros(blocks.rows_per_ex, dtype=np.int64)
        slot_layer[blocks.slots] = np.array(selection.layer_values, dtype=np.int64)
        self.slot_layer = slot_layer


class _TokenLoader:
    """Shared machinery of `ShuffledLoader` and `OrderedLoader`."""

    _shuffle = True

    def __init__(
        self,
        shards: Shards | str | os.PathLike[str],
        batch_size: int,
        layers: int | Sequence[int] | None,
        tokens: str,
        seed: int,
        drop_last: bool,
        out_dtype: str | None,
        ignore_labels: Iterable[int],
        skip_padding: bool,
        rank: int | None,
        world_size: int | None,
        pin_memory: bool,
        buffer_bytes: int,
        block_bytes: int,
        read_threads: int,
        prefetch: int,
        gather_threads: int | None,
    ) -> None:
        import torch

        self.shards = as_shards(shards)
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise LoaderError(f"batch_size: expected an integer >= 1, found {batch_size!r}")
        if int(seed) < 0:
            raise LoaderError(f"seed: expected an integer >= 0, found {seed}")
        for name, value, low in (
            ("buffer_bytes", buffer_bytes, 1),
            ("block_bytes", block_bytes, 1),
            ("read_threads", read_threads, 1),
            ("prefetch", prefetch, 1),
            ("gather_threads", 1 if gather_threads is None else gather_threads, 1),
        ):
            if int(value) < low:
                raise LoaderError(f"{name}: expected an integer >= {low}, found {value}")
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.rank, self.world_size = _world(rank, world_size)
        self.selection = TokenSelection(self.shards, layers, tokens, ignore_labels, skip_padding)
        self.layers = self.selection.layer_values
        self.out_dtype = parse_out_dtype(self.shards, out_dtype)
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()  # no pinned memory without CUDA
        self.buffer_bytes = int(buffer_bytes)
        self.block_bytes = int(block_bytes)
        self._blocks = _Blocks(self.shards, self.selection, self.block_bytes)
        md = self.shards.metadata
        slice_bytes = md.tokens_per_ex * md.d_model * md.itemsize
        self._window_rows = max(1, self.buffer_bytes // max(1, slice_bytes))
        self._config = _Config(
            self.shards,
            self.selection,
            self._blocks,
            self.batch_size,
            self.out_dtype,
            self.pin_memory,
            int(read_threads),
            int(prefetch),
            default_gather_threads() if gather_threads is None else int(gather_threads),
        )
        total = self._blocks.total
        lo, hi = _rank_range(total, self.rank, self.world_size)
        self.n_tokens = hi - lo  # vectors this rank yields per epoch (before drop_last)
        if self.drop_last:
            self._len = (total // self.world_size) // self.batch_size
        else:
            self._len = -(-self.n_tokens // self.batch_size)
        self._next_epoch = 0
        self._resume_batch = 0
        self._position: tuple[int, int] | None = None  # (epoch, batches yielded) of the live iteration
        self._runs: weakref.WeakSet[_Run] = weakref.WeakSet()
        self._spare: list[npt.NDArray[Any]] = []
        self._spare_lock = threading.Lock()

    # -- size and identity -------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return self._len

    @property
    def fingerprint(self) -> str:
        """Digest of everything that decides the batches; `load_state_dict` checks it."""
        md = self.shards.metadata
        sel = self.selection
        config = {
            "cache": md.hash,
            "shuffle": self._shuffle,
            "batch_size": self.batch_size,
            "layers": list(sel.layer_values),
            "tokens": sel.tokens,
            "ignore_labels": sel.ignore_labels.tolist(),
            "skip_padding": sel.skip_padding,
            "drop_last": self.drop_last,
            "rank": self.rank,
            "world_size": self.world_size,
            "buffer_bytes": self.buffer_bytes if self._shuffle else 0,
            "block_bytes": self.block_bytes if self._shuffle else 0,
        }
        return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]

    # -- epochs and resuming -----------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` run epoch ``epoch`` from its first batch."""
        if int(epoch) < 0:
            raise LoaderError(f"epoch: expected an integer >= 0, found {epoch}")
        self._next_epoch = int(epoch)
        self._resume_batch = 0
        self._position = None

    def state_dict(self) -> dict[str, Any]:
        """Where the next ``iter()`` starts: mid-epoch while an iteration is under way."""
        if self._position is not None:
            epoch, batch = self._position
            if batch >= self._len:
                epoch, batch = epoch + 1, 0
        else:
            epoch, batch = self._next_epoch, self._resume_batch
        return {"epoch": epoch, "batch": batch, "seed": self.seed, "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume exactly where `state_dict` was taken (same cache and settings)."""
        expected = {"epoch", "batch", "seed", "fingerprint"}
        if not isinstance(state, dict) or set(state) != expected:
            found = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise LoaderError(f"state: expected keys {sorted(expected)}, found {found}")
        if state["fingerprint"] != self.fingerprint or state["seed"] != self.seed:
            raise LoaderError(
                f"state: expected a state of this loader (seed {self.seed}, fingerprint {self.fingerprint}), "
                f"found seed {state['seed']}, fingerprint {state['fingerprint']} (different cache or settings)"
            )
        epoch, batch = int(state["epoch"]), int(state["batch"])
        if epoch < 0 or not 0 <= batch <= self._len:
            raise LoaderError(f"state: expected epoch >= 0 and batch in [0, {self._len}], found {epoch}, {batch}")
        self._next_epoch, self._resume_batch = (epoch + 1, 0) if batch == self._len else (epoch, batch)
        self._position = None

    def plan(self, epoch: int) -> _EpochPlan:
        """The windows of epoch ``epoch`` on this rank (cheap: no data is read)."""
        blocks = self._blocks
        if self._shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(blocks)).astype(np.int64)
        else:
            order = np.arange(len(blocks), dtype=np.int64)
        return _plan_epoch(
            blocks, order, self.rank, self.world_size, self._window_rows, self.batch_size, self.drop_last
        )

    def epoch_examples(self, epoch: int, limit: int | None = None) -> npt.NDArray[np.int64]:
        """Example of each of the first ``limit`` vectors this rank yields in epoch ``epoch``.

        Computed from the plan alone (no activation is read), so the shuffle quality of any
        cache can be measured from its metadata; batch ``i`` holds entries ``[i*B, (i+1)*B)``.
        """
        plan = self.plan(epoch)
        need = plan.n_vectors if limit is None else min(limit, plan.n_vectors)
        pieces, got = [], 0
        for window in plan.windows:
            if got >= need:
                break
            index = _index_window(self.selection, self._blocks, window, self._window_rng(epoch, window.index))
            pieces.append(index.examples[index.ex_local])
            got += len(index)
        return np.concatenate(pieces)[:need] if pieces else np.zeros(0, dtype=np.int64)

    def _window_rng(self, epoch: int, window: int) -> np.random.Generator | None:
        if not self._shuffle:
            return None
        return np.random.default_rng([self.seed, epoch, window, self.rank, self.world_size])

    # -- iteration ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        epoch, start = self._next_epoch, self._resume_batch
        self._next_epoch, self._resume_batch = epoch + 1, 0
        self._position = (epoch, start)
        return self._iterate(epoch, start)

    def _iterate(self, epoch: int, start: int) -> Iterator[Batch]:
        plan = self.plan(epoch)
        run = _Run(self._config, plan, epoch, start, self._window_rng, self._take_buffers, self._give_buffers)
        self._runs.add(run)
        try:
            for i, batch in enumerate(run, start=start + 1):
                if self._position is not None and self._position[0] == epoch:
                    self._position = (epoch, i)
                yield batch
        finally:
            run.close()

    def _take_buffers(self) -> list[npt.NDArray[Any]]:
        cfg = self._config
        rows = min(self._window_rows + self._blocks.max_rows, int(self._blocks.rows.sum()))
        shape = (rows * cfg.tokens, cfg.d_model)
        with self._spare_lock:
            spare, self._spare = self._spare, []
        buffers = [b for b in spare if b.shape == shape]
        while len(buffers) < 2:
            buffers.append(np.empty(shape, dtype=cfg.numpy_dtype))
        return buffers[:2]

    def _give_buffers(self, buffers: list[npt.NDArray[Any]]) -> None:
        with self._spare_lock:
            self._spare = buffers

    def close(self) -> None:
        """Stop every running iteration (threads joined) and free the shuffle buffers."""
        for run in list(self._runs):
            run.close()
        with self._spare_lock:
            self._spare = []

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __enter__(self) -> _TokenLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def default_gather_threads() -> int:
    """Threads that gather one batch: one per core, at most 4 (the gather waits on memory, not compute)."""
    return max(1, min(4, os.cpu_count() or 1))


def _world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)``: explicit values, else torch.distributed's when initialised, else (0, 1)."""
    if rank is None and world_size is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    if rank is None or world_size is None:
        raise LoaderError(f"rank and world_size: expected both or neither, found rank={rank}, world_size={world_size}")
    if int(world_size) < 1 or not 0 <= int(rank) < int(world_size):
        raise LoaderError(f"rank: expected 0 <= rank < world_size={world_size}, found {rank}")
    return int(rank), int(world_size)


class ShuffledLoader(_TokenLoader):
    """Shuffled batches ``(B, D)`` of single token vectors; every chosen token once per epoch.

    ``layers``: None (all recorded), a layer value or a sequence of them. ``tokens``:
    ``"content"``, ``"cls"`` or ``"all"``. ``ignore_labels`` skips content tokens whose label is
    listed; ``skip_padding`` skips positions ``>= lengths[i]`` when the cache has a lengths
    column. ``out_dtype``: None (stored; bfloat16 comes back as torch.bfloat16), ``"float32"``
    or ``"bfloat16"``. With ``rank`` and ``world_size`` (default: torch.distributed's when
    initialised) each rank gets a disjoint share; ``drop_last=True`` gives every rank the same
    number of full batches. Memory: two windows of about ``buffer_bytes`` each.

    Iterating runs one epoch, each with a new order drawn from ``(seed, epoch)``. Breaking out
    of the loop, `close`, or garbage collection stops the background threads.
    """

    _shuffle = True

    def __init__(
        self,
        shards: Shards | str | os.PathLike[str],
        batch_size: int = 4096,
        layers: int | Sequence[int] | None = None,
        tokens: str = "content",
        seed: int = 0,
        drop_last: bool = False,
        out_dtype: str | None = None,
        ignore_labels: Iterable[int] = (),
        skip_padding: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        pin_memory: bool = False,
        *,
        buffer_bytes: int = 1 << 30,
        block_bytes: int = BLOCK_BYTES,
        read_threads: int = 4,
        prefetch: int = 4,
        gather_threads: int | None = None,
    ) -> None:
        super().__init__(
            shards,
            batch_size,
            layers,
            tokens,
            seed,
            drop_last,
            out_dtype,
            ignore_labels,
            skip_padding,
            rank,
            world_size,
            pin_memory,
            buffer_bytes,
            block_bytes,
            read_threads,
            prefetch,
            gather_threads,
        )


class OrderedLoader(_TokenLoader):
    """Batches ``(B, D)`` in strict ``(example, layer, token)`` order, identical every epoch.

    Same selection arguments as `ShuffledLoader`. Reads are sequential blocks prefetched
    by background threads; batches run across shard boundaries. With ``rank`` and
    ``world_size`` each rank walks one contiguous part of the order.
    """

    _shuffle = False

    def __init__(
        self,
        shards: Shards | str | os.PathLike[str],
        batch_size: int = 4096,
        layers: int | Sequence[int] | None = None,
        tokens: str = "content",
        drop_last: bool = False,
        out_dtype: str | None = None,
        ignore_labels: Iterable[int] = (),
        skip_padding: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        pin_memory: bool = False,
        *,
        buffer_bytes: int = 64 << 20,
        block_bytes: int = BLOCK_BYTES,
        read_threads: int = 2,
        prefetch: int = 4,
        gather_threads: int | None = None,
    ) -> None:
        super().__init__(
            shards,
            batch_size,
            layers,
            tokens,
            0,
            drop_last,
            out_dtype,
            ignore_labels,
            skip_padding,
            rank,
            world_size,
            pin_memory,
            buffer_bytes,
            block_bytes,
            read_threads,
            prefetch,
            gather_threads,
        )


# --------------------------------------------------------------------------------------
# one running epoch: reader threads fill windows, an assembler thread gathers batches


class _End:
    """Queued after the last batch."""


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Run:
    """The threads of one epoch. Iterate it for batches; `close` stops and joins everything."""

    def __init__(
        self,
        cfg: _Config,
        plan: _EpochPlan,
        epoch: int,
        start: int,
        window_rng: Any,
        take_buffers: Any,
        give_buffers: Any,
    ) -> None:
        self.cfg = cfg
        self.plan = plan
        self.epoch = epoch
        self.start = start
        self.window_rng = window_rng
        self.give_buffers = give_buffers
        self.buffers: list[npt.NDArray[Any]] = take_buffers() if plan.windows and start < plan.n_batches else []
        self.stop = threading.Event()
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=cfg.prefetch)
        self.pool = ThreadPoolExecutor(max_workers=cfg.read_threads, thread_name_prefix="saev-read")
        self.gather_pool = (
            ThreadPoolExecutor(max_workers=cfg.gather_threads - 1, thread_name_prefix="saev-gather")
            if cfg.gather_threads > 1
            else None
        )
        self.opened: set[int] = set()  # shards whose file descriptor this run has opened
        self.open_lock = threading.Lock()
        self.closed = False
        self.thread = threading.Thread(target=self._assemble, name="saev-assemble", daemon=True)
        self.thread.start()

    # -- consumer side -----------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        while not self.closed:
            try:
                item = self.queue.get(timeout=0.1)
            except queue.Empty:
                if self.thread.is_alive():
                    continue
                return  # stopped by close()
            if isinstance(item, _End):
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.stop.set()
        if threading.current_thread() is not self.thread:
            self.thread.join()
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.gather_pool is not None:
            self.gather_pool.shutdown(wait=True, cancel_futures=True)
        if self.buffers:
            self.give_buffers(self.buffers)
            self.buffers = []

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # -- producer side -----------------------------------------------------------------
    def _put(self, item: object) -> None:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def _read_block(self, block: int, buffer: npt.NDArray[Any], row_offset: int) -> None:
        if self.stop.is_set():
            return
        cfg = self.cfg
        blocks = cfg.blocks
        shard = int(blocks.shard[block])
        if shard not in self.opened:
            # Shards opens descriptors lazily; the first read of a shard is serialised so that
            # two threads never both open (and one leak) the same descriptor.
            with self.open_lock:
                if shard not in self.opened:
                    self._read_into(block, buffer, row_offset)
                    self.opened.add(shard)
                    return
        self._read_into(block, buffer, row_offset)

    def _read_into(self, block: int, buffer: npt.NDArray[Any], row_offset: int) -> None:
        cfg = self.cfg
        blocks = cfg.blocks
        start, stop = int(blocks.start[block]), int(blocks.stop[block])
        count = stop - start
        rows_per_ex = blocks.rows_per_ex
        dest = buffer[row_offset * cfg.tokens : (row_offset + count * rows_per_ex) * cfg.tokens]
        if blocks.whole:
            cfg.shards.read_range(start, stop, dest.reshape(count, rows_per_ex, cfg.tokens, cfg.d_model))
            return
        slices = dest.reshape(count, rows_per_ex, cfg.tokens, cfg.d_model)
        for e in range(count):
            if self.stop.is_set():
                return
            for s, position in enumerate(blocks.read_positions.tolist()):
                cfg.shards.read_example(start + e, position, slices[e, s])

    def _submit(self, w: int) -> tuple[list[Future[None]], Future[_WindowIndex]]:
        cfg = self.cfg
        window = self.plan.windows[w]
        buffer = self.buffers[w % 2]
        rows = cfg.blocks.rows[window.blocks]
        offsets = np.zeros(len(rows), dtype=np.int64)
        np.cumsum(rows[:-1], out=offsets[1:])
        # The index first: it needs no data, so it is ready by the time the reads are.
        rng = self.window_rng(self.epoch, w)
        index = self.pool.submit(_index_window, cfg.selection, cfg.blocks, window, rng)
        reads = [
            self.pool.submit(self._read_block, int(b), buffer, int(o))
            for b, o in zip(window.blocks.tolist(), offsets.tolist(), strict=True)
        ]
        return reads, index

    def _assemble(self) -> None:
        try:
            self._produce()
        except BaseException as err:
            self._put(_Failure(err))
        else:
            self._put(_End())

    def _produce(self) -> None:
        cfg, plan = self.cfg, self.plan
        n_windows = len(plan.windows)
        if self.start >= plan.n_batches or n_windows == 0:
            return
        size = cfg.batch_size
        position = self.start * size
        w = int(np.searchsorted(plan.window_start, position, side="right")) - 1
        offset = position - int(plan.window_start[w])
        pending = {w: self._submit(w)}
        if w + 1 < n_windows:
            pending[w + 1] = self._submit(w + 1)
        ready: dict[int, _WindowIndex] = {}
        recycler = _Recycler(keep=cfg.prefetch + 4)
        scratch = np.empty((size, cfg.d_model), dtype=cfg.numpy_dtype) if self._converts() else None
        for b in range(self.start, plan.n_batches):
            n = min(size, plan.n_vectors - b * size)
            raw = scratch[:n] if scratch is not None else self._output(recycler, n)
            parts = []
            filled = 0
            while filled < n:
                if w not in ready:
                    reads, index = pending.pop(w)
                    for future in reads:
                        future.result()
                    ready[w] = index.result()
                if self.stop.is_set():
                    return
                win = ready[w]
                take = min(n - filled, len(win) - offset)
                # One vectorised gather (torch's runs on every core; numpy's on one).
                self._gather(self.buffers[w % 2], win.flat[offset : offset + take], raw[filled : filled + take])
                parts.append((win, offset, offset + take))
                filled += take
                offset += take
                if offset == len(win):
                    del ready[w]
                    if w + 2 < n_windows:
                        pending[w + 2] = self._submit(w + 2)
                    w += 1
                    offset = 0
            self._put(self._batch(raw, recycler, parts))
            if self.stop.is_set():
                return

    def _gather(self, source: npt.NDArray[Any], idx: npt.NDArray[np.int64], out: npt.NDArray[Any]) -> None:
        """``out[:] = source[idx]``, split over the gather threads for large batches."""
        # mode="clip": with the default "raise", numpy gathers into a temporary and copies.
        parts = self.cfg.gather_threads
        if parts == 1 or len(idx) < 2 * _MIN_GATHER_ROWS:
            np.take(source, idx, axis=0, out=out, mode="clip")
            return
        bounds = np.linspace(0, len(idx), min(parts, len(idx) // _MIN_GATHER_ROWS) + 1).astype(int).tolist()
        assert self.gather_pool is not None
        futures = [
            self.gather_pool.submit(np.take, source, idx[a:b], 0, out[a:b], "clip")
            for a, b in itertools.pairwise(bounds[1:])
        ]
        np.take(source, idx[: bounds[1]], axis=0, out=out[: bounds[1]], mode="clip")  # numpy releases the GIL
        for future in futures:
            future.result()

    def _converts(self) -> bool:
        return self.cfg.out_dtype != self.cfg.stored

    def _output(self, recycler: _Recycler, n: int) -> npt.NDArray[Any]:
        """Where the gather of a batch of stored-dtype vectors writes (pinned when asked)."""
        import torch

        cfg = self.cfg
        if cfg.pin_memory:  # torch's pinned allocator caches its blocks itself
            acts = torch.empty((n, cfg.d_model), dtype=torch_dtype(cfg.stored), pin_memory=True)
            return acts.view(torch.int16).numpy().view(cfg.numpy_dtype) if cfg.stored == "bfloat16" else acts.numpy()
        return recycler.get((n, cfg.d_model), cfg.numpy_dtype)

    def _batch(self, raw: npt.NDArray[Any], recycler: _Recycler, parts: list[tuple[_WindowIndex, int, int]]) -> Batch:
        import torch

        cfg = self.cfg
        if not self._converts():
            acts = to_tensor(raw, cfg.stored, cfg.stored)
        else:
            out = torch_dtype(cfg.out_dtype)
            n = len(raw)
            if cfg.pin_memory:
                acts = torch.empty((n, cfg.d_model), dtype=out, pin_memory=True)
            else:
                arr = recycler.get((n, cfg.d_model), np.dtype(np.float32 if cfg.out_dtype == "float32" else np.int16))
                acts = torch.from_numpy(arr)
                if cfg.out_dtype != "float32":
                    acts = acts.view(out)
            acts.copy_(to_tensor(raw, cfg.stored, cfg.stored))

        examples, tokens, layers, labels = [], [], [], []
        for win, lo, hi in parts:
            ex_local, token, slot = win.ex_local[lo:hi], win.tokens[lo:hi], win.slots[lo:hi]
            examples.append(win.examples[ex_local])
            tokens.append(token.astype(np.int64))
            layers.append(cfg.slot_layer[slot])
            if win.labels is not None:
                labels.append(win.labels[ex_local.astype(np.int64) * cfg.tokens + token])

        def tensor(pieces: list[npt.NDArray[Any]]) -> torch.Tensor:
            return torch.from_numpy(pieces[0] if len(pieces) == 1 else np.concatenate(pieces))

        return Batch(
            acts=acts,
            examples=tensor(examples),
            tokens=tensor(tokens),
            layers=tensor(layers),
            labels=tensor(labels) if labels else None,
        )
