"""What one epoch runs: the loader's settings (`Config`), the epoch (`Epoch`), and its chunks
of batches with the windows each touches (`Schedule`), for the host run and the device run alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import numpy.typing as npt

from ..protocol.common import FLOAT8
from ..reader import Shards
from .mapped import CacheMap
from .plan import EpochPlan, ReadSpans, WindowIndex
from .selection import TokenSelection

#: Smallest output of one gather task: below this the Python around a ``numpy.take`` costs
#: more than the copy, so small batches are gathered several per task.
CHUNK_BYTES = 4 << 20


@dataclasses.dataclass(eq=False)
class Config:
    """Everything a running epoch needs, given once by the loader (`TokenLoader`) and taken whole
    by every part of an epoch; holds no reference to the loader object."""

    shards: Shards
    selection: TokenSelection
    spans: ReadSpans
    batch_size: int
    out_dtype: str
    pin_memory: bool
    read_threads: int
    prefetch: int
    gather_threads: int
    #: The cache mapped in place (`mapped.CacheMap`): windows are gathered from the page
    #: cache, not from buffers. None: windows are read into buffers.
    mapped: CacheMap | None = None
    # Derived from the above (`__post_init__`):
    tokens: int = dataclasses.field(init=False)
    d_model: int = dataclasses.field(init=False)
    stored: str = dataclasses.field(init=False)
    numpy_dtype: np.dtype[Any] = dataclasses.field(init=False)
    #: float8_e4m3: windows hold the stored bytes and a float32 scale per vector beside them,
    #: and batches are dequantized when they are assembled.
    float8: bool = dataclasses.field(init=False)
    stack: bool = dataclasses.field(init=False)
    #: Layer values of a stacked row, in the order of its ``L`` axis.
    layer_values: npt.NDArray[np.int64] = dataclasses.field(init=False)
    #: Shape of one output row: ``(D,)``, or ``(L, D)`` stacked.
    row_shape: tuple[int, ...] = dataclasses.field(init=False)
    #: Batches gathered by one task.
    chunk_batches: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        md = self.shards.metadata
        self.tokens = md.tokens_per_ex
        self.d_model = md.d_model
        self.stored = md.dtype
        self.numpy_dtype = self.shards.numpy_dtype
        self.float8 = md.dtype == FLOAT8
        self.stack = self.spans.stack_layers
        self.layer_values = np.array(self.selection.layer_values, dtype=np.int64)
        self.row_shape = (self.selection.n_layers, md.d_model) if self.stack else (md.d_model,)
        row_bytes = md.d_model * md.itemsize * self.spans.layers_per_unit
        self.chunk_batches = max(1, -(-CHUNK_BYTES // max(1, self.batch_size * row_bytes)))


class Schedule:
    """Chunks of batches ``[start, n_batches)`` and the windows each touches."""

    def __init__(self, plan: EpochPlan, start: int, chunk_batches: int) -> None:
        self.plan = plan
        self.first_batch = np.arange(start, plan.n_batches, chunk_batches, dtype=np.int64)
        stop_batch = np.minimum(self.first_batch + chunk_batches, plan.n_batches)
        self.lo = self.first_batch * plan.batch_size
        self.hi = np.minimum(stop_batch * plan.batch_size, plan.n_units)
        self.stop_batch = stop_batch
        ws = plan.window_start
        self.w_first = np.searchsorted(ws, self.lo, side="right") - 1
        self.w_last = np.searchsorted(ws, self.hi - 1, side="right") - 1
        #: Window buffers held at once: two (one consumed while the next loads), or the most
        #: windows one chunk spans, whichever is larger.
        span = int((self.w_last - self.w_first).max()) + 1 if len(self) else 1
        self.n_slots = max(2, span)
        #: Chunks that gather from each window of the plan (a window is free once all have).
        edges = np.zeros(len(plan.windows) + 1, dtype=np.int64)
        np.add.at(edges, self.w_first, 1)
        np.add.at(edges, self.w_last + 1, -1)
        self.readers = np.cumsum(edges)  # and a 0 after the last window

    def __len__(self) -> int:
        return len(self.first_batch)


@dataclasses.dataclass(frozen=True)
class Epoch:
    """One epoch to run: its chunks from the first batch to yield (`Schedule`, which holds the
    plan), its number, and where each window's order comes from (``window_rng(epoch, window)``)."""

    schedule: Schedule
    number: int
    window_rng: Callable[[int, int], np.random.Generator | None]
    #: The index of the plan's first window in the cache mapped in place, computed while the
    #: epoch before ended (`ahead.IndexAhead`), or None. Used only where that window is read in
    #: place: the same index its load would compute.
    first_index: WindowIndex | None = None
    #: Called with the last window's load once the run has started it: the next epoch's first
    #: window may be indexed on a read thread once that load is done, while its gathers run.
    after_last_load: Callable[[Future[Any]], None] = lambda load: None

    @property
    def plan(self) -> EpochPlan:
        return self.schedule.plan

    def rng(self, window: int) -> np.random.Generator | None:
        """The generator that permutes window ``window`` (None: not permuted)."""
        return self.window_rng(self.number, window)
