"""What a loader keeps from one epoch to the next and lends to each in turn (`Spares`): its
window buffers, its host threads and output arrays (`pools.Pools`), its device slots, and
the cache mapped in place (`mapped.CacheMap`). Making them again for every epoch costs
memory the kernel zeroes and threads that wait for the GIL (`pools.Pools`)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from . import mapped
from .device import Slots
from .mapped import CacheMap
from .pools import Pools
from .schedule import Config

#: A host window buffer: the stored values ``(rows * T, D)``, and a float8_e4m3 cache's scales ``(rows * T,)``.
WindowBuffer = tuple[npt.NDArray[Any], npt.NDArray[np.float32] | None]


class Spares:
    """A loader's buffers, threads, device slots and mapping, lent to one epoch at a time (under a lock:
    an epoch may end on any thread)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.lock = threading.Lock()
        self.buffers: list[WindowBuffer] = []
        #: The threads of the last host epoch, for the next.
        self.pools: Pools | None = None
        self.slots: Slots | None = None
        #: The cache mapped in place (made once; `cache_map`).
        self.map: CacheMap | None = None
        self.map_possible = mapped.available(cfg.shards)

    def cache_map(self) -> CacheMap | None:
        """The cache mapped in place for the host path (made once), or None where windows are
        read into buffers: another system than Linux, a remote cache whose blocks are not all
        in the block cache (yet), or a map that could not be made (`mapped`)."""
        with self.lock:
            if self.map is None and self.map_possible:
                try:
                    # None: a remote cache not all in the block cache yet, tried again next epoch
                    self.map = mapped.cache_map(self.cfg.shards, scales=self.cfg.float8)
                except (OSError, AttributeError, ValueError):
                    self.map_possible = False
            return self.map

    def take_buffers(self, n: int, rows: int) -> list[WindowBuffer]:
        """``n`` window buffers of ``rows`` ``(T, D)`` slices (stored values, and a float8_e4m3
        cache's scales beside them), reused from the last epoch where they fit."""
        cfg = self.cfg
        shape = (rows * cfg.tokens, cfg.d_model)
        with self.lock:
            spare, self.buffers = self.buffers, []
        buffers = [b for b in spare if b[0].shape == shape]
        while len(buffers) < n:
            scales = np.empty(shape[0], dtype=np.float32) if cfg.float8 else None
            buffers.append((np.empty(shape, dtype=cfg.numpy_dtype), scales))
        return buffers[:n]

    def give_buffers(self, buffers: list[WindowBuffer]) -> None:
        with self.lock:
            self.buffers = buffers

    def take_pools(self) -> Pools:
        """The threads and output arrays of a host epoch: the last epoch's, where this process made
        them, else new ones (`pools.Pools`: making them for every epoch cost milliseconds)."""
        with self.lock:
            pools, self.pools = self.pools, None
        if pools is not None and not pools.fits(self.cfg):
            pools.shutdown(wait=False)
            pools = None
        return pools or Pools(self.cfg)

    def give_pools(self, pools: Pools) -> None:
        """Keep an epoch's threads and outputs (once it has stopped) for the next; a second set is let go."""
        with self.lock:
            keep = self.pools is None and pools.fits(self.cfg)
            spare, self.pools = (None, pools) if keep else (pools, self.pools)
        if spare is not None:
            spare.shutdown(wait=False)

    def take_slots(self, device: Any, n: int, rows: int) -> Slots:
        """``n`` device slots of ``rows`` ``(T, D)`` slices on ``device``: the last epoch's where they fit."""
        with self.lock:
            slots, self.slots = self.slots, None
        if slots is None or not slots.fits(device, n, rows):
            del slots  # free the old device memory before allocating the new
            slots = Slots(device, n, rows, self.cfg)
        return slots

    def give_slots(self, slots: Slots) -> None:
        with self.lock:
            self.slots = slots

    def clear(self) -> None:
        """Let go of everything: the buffers and slots freed, the threads stopped, the cache
        unmapped once no batch is being gathered from it."""
        with self.lock:
            self.buffers = []
            self.slots = None
            self.map = self.cfg.mapped = None
            pools, self.pools = self.pools, None
        if pools is not None:
            pools.shutdown()
