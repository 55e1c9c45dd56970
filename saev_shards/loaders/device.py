"""The device-side shuffle: whole windows go to the device, the permutation and gather run there.

The CPU only reads spans into reusable page-locked *host* slots (no per-row work) and
computes each window's index, exactly as the host path does; then, on a side stream, the
window and its index are copied into device slots in a few large transfers. Each batch is
one ``index_select`` (plus two small copies of its metadata) issued on the consumer's
current stream, so batches come out on the device, in the same order as the host path's.

Synchronisation, all by events (no host waits on the training loop's path):

* the consumer's stream waits for a window's ``uploaded`` event before its first gather;
* a device slot is reused (the side stream waits) only after the ``consumed`` event the
  consumer recorded after its last gather from the slot's previous window;
* a host slot is refilled (the read threads wait on the host) only after the upload
  that read it is done.

A float8_e4m3 cache crosses to the device as it is stored, one byte per value, with a
float32 scale per vector beside it: a batch is gathered from both, then dequantized on the
device (``float32(q) * s``, then the output dtype), so the host-to-device copy moves half
the bytes of a float16 cache. The scales were checked when they were read (`Shards.check_scales`:
a scale the rule cannot give is a `ScaleError` naming its shard and vector), and the range
check of float16 and bfloat16 (`DtypeRangeError`) is done on the host, from the largest scale
of each unit, computed when the window's index is uploaded: the device never syncs for it.

On the CPU (``device="cpu"``) the same code runs with plain tensors and synchronous
copies, and every stream and event operation below is skipped: tests compare its batches
with the host path's on any machine.

Device memory: ``n_slots`` (two, unless one batch spans more windows) window buffers of
``buffer_bytes`` plus one read block, and their index (8 bytes per vector for the gather,
25 per row for the metadata), allocated once per loader; plus the batches the caller holds.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from ..protocol.float8 import check_range
from .batch import Batch
from .plan import WindowIndex
from .schedule import Config, Epoch
from .tensors import as_numpy, pinned_empty, torch_dtype
from .windows import WindowLoader

if TYPE_CHECKING:
    import torch


class Slots:
    """The buffers of the device path, made once per loader and reused by every epoch.

    Per slot: a window on the host (pinned with CUDA) and its copy on the device,
    the gather index and the metadata, on both sides.
    """

    def __init__(self, device: torch.device, n_slots: int, rows: int, cfg: Config) -> None:
        import torch

        self.device = device
        self.n_slots = n_slots
        self.rows = rows  # (T, D) slices per window buffer
        cuda = device.type == "cuda"
        dtype = torch.uint8 if cfg.float8 else torch_dtype(cfg.stored)  # float8_e4m3 as its bytes
        vectors = rows * cfg.tokens  # every vector of a window; no window has more units
        per_unit = cfg.spans.layers_per_unit

        def host(shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
            return pinned_empty(shape, dt) if cuda else torch.empty(shape, dtype=dt)

        self.windows = [host((vectors, cfg.d_model), dtype) for _ in range(n_slots)]
        self.windows_np = [as_numpy(t, cfg.stored) for t in self.windows]
        self.acts = [torch.empty((vectors, cfg.d_model), dtype=dtype, device=device) for _ in range(n_slots)]
        # The gather index (flattened (units, L) when stacked) and the metadata
        # (examples, tokens, layers as int64 rows; labels as uint8).
        self.flat_host = [host((vectors * per_unit,), torch.int64) for _ in range(n_slots)]
        self.meta_host = [host((3, vectors), torch.int64) for _ in range(n_slots)]
        self.labels_host = [host((vectors,), torch.uint8) for _ in range(n_slots)]
        self.flat = [torch.empty((vectors * per_unit,), dtype=torch.int64, device=device) for _ in range(n_slots)]
        self.meta = [torch.empty((3, vectors), dtype=torch.int64, device=device) for _ in range(n_slots)]
        self.labels = [torch.empty((vectors,), dtype=torch.uint8, device=device) for _ in range(n_slots)]
        # float8_e4m3: a scale per vector, on both sides, and on the host each unit's largest
        # scale (the float16 range check needs no device sync).
        scaled = range(n_slots if cfg.float8 else 0)
        self.scales_host = [host((vectors,), torch.float32) for _ in scaled]
        self.scales_np = [t.numpy() for t in self.scales_host]
        self.scales = [torch.empty((vectors,), dtype=torch.float32, device=device) for _ in scaled]
        self.unit_max = [np.empty(vectors, np.float32) for _ in scaled]

    def fits(self, device: torch.device, n_slots: int, rows: int) -> bool:
        return self.device == device and self.n_slots >= n_slots and self.rows >= rows


class _Sync:
    """CUDA streams and events; on the CPU, nothing (copies there finish before they return)."""

    def __init__(self, device: torch.device) -> None:
        import torch

        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None  # type: ignore[no-untyped-call]

    def side_stream(self) -> contextlib.AbstractContextManager[Any]:
        import torch

        return torch.cuda.stream(self.side) if self.cuda else contextlib.nullcontext()

    def record_on_side(self) -> Any:
        """An event marking everything issued on the side stream so far (None on the CPU)."""
        import torch

        if not self.cuda:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.side)
        return event

    def record_on_current(self) -> Any:
        import torch

        if not self.cuda:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.side.device))  # type: ignore[union-attr]
        return event

    def side_waits(self, event: Any) -> None:
        if event is not None:
            self.side.wait_event(event)  # type: ignore[union-attr]

    def current_waits(self, event: Any) -> None:
        import torch

        if event is not None:
            torch.cuda.current_stream(self.side.device).wait_event(event)  # type: ignore[union-attr]

    def host_waits(self, event: Any) -> None:
        if event is not None:
            event.synchronize()  # releases the GIL while it waits

    def close(self) -> None:
        if self.side is not None:
            self.side.synchronize()


class _Loaded:
    """A window in its device slot, ready once ``uploaded`` has passed on the stream."""

    def __init__(self, slot: int, n_units: int, uploaded: Any) -> None:
        self.slot = slot
        self.n_units = n_units
        self.uploaded = uploaded
        self.waited = False


class DeviceRun:
    """One epoch with the shuffle on ``slots.device``. Iterate it; `close` stops and joins everything."""

    def __init__(self, cfg: Config, epoch: Epoch, slots: Slots) -> None:
        import torch

        self.cfg = cfg
        self.plan = epoch.plan
        self.schedule = epoch.schedule
        self.slots = slots
        self.sync = _Sync(slots.device)
        self.stop = threading.Event()
        self.n_slots = self.schedule.n_slots
        self.uploaded: list[Any] = [None] * self.n_slots  # last upload out of each host slot
        self.consumed: list[Any] = [None] * self.n_slots  # last gather from each device slot
        self.windows = WindowLoader(
            cfg,
            epoch,
            slots.windows_np[: self.n_slots],
            self.stop,
            ready_to_write=lambda slot: self.sync.host_waits(self.uploaded[slot]),
            finish=self._upload,
            scale_buffers=slots.scales_np[: self.n_slots],
        )
        self.layer_values = torch.from_numpy(cfg.layer_values.copy()).to(slots.device)
        self.closed = False

    def _upload(self, w: int, slot: int, index: WindowIndex) -> _Loaded:
        """Copy window ``w`` and its index into device slot ``slot`` (runs on a read thread)."""
        s, cfg = self.slots, self.cfg
        window = self.plan.windows[w]
        vectors = int(cfg.spans.rows[window.spans].sum()) * cfg.tokens
        n = len(index)
        flat = index.flat.reshape(-1)
        # The index into pinned host slots first (host copies of a few MB), then every copy at once.
        s.flat_host[slot][: len(flat)].numpy()[:] = flat
        meta = s.meta_host[slot].numpy()
        meta[0, :n] = index.examples
        meta[1, :n] = index.tokens
        if index.layers is not None:
            meta[2, :n] = index.layers
        if index.labels is not None:
            s.labels_host[slot][:n].numpy()[:] = index.labels
        if cfg.float8 and cfg.out_dtype != "float32":
            picked = np.take(s.scales_np[slot], index.flat, mode="clip").reshape(n, -1)
            np.fmax.reduce(picked, axis=1, out=s.unit_max[slot][:n])  # NaN scales (NaN vectors) skipped
        with self.sync.side_stream():
            self.sync.side_waits(self.consumed[slot])
            s.acts[slot][:vectors].copy_(s.windows[slot][:vectors], non_blocking=True)
            if cfg.float8:
                s.scales[slot][:vectors].copy_(s.scales_host[slot][:vectors], non_blocking=True)
            s.flat[slot][: len(flat)].copy_(s.flat_host[slot][: len(flat)], non_blocking=True)
            s.meta[slot][:, :n].copy_(s.meta_host[slot][:, :n], non_blocking=True)
            if index.labels is not None:
                s.labels[slot][:n].copy_(s.labels_host[slot][:n], non_blocking=True)
            event = self.sync.record_on_side()
        self.uploaded[slot] = event
        return _Loaded(slot, n, event)

    def __iter__(self) -> Iterator[Batch]:
        return self._consume()

    def _consume(self) -> Iterator[Batch]:
        sched = self.schedule
        n_chunks = len(sched)
        if n_chunks == 0:
            return
        self.last_window = int(sched.w_last[-1])
        self.loads: dict[int, Future[_Loaded]] = {}
        self.next_load = int(sched.w_first[0])
        self.release_below = self.next_load
        for c in range(n_chunks):
            if self._stopped():
                return
            self._pump()
            # After this chunk, the windows before the next chunk's first are done with.
            done_below = int(sched.w_first[c + 1]) if c + 1 < n_chunks else self.last_window + 1
            yield self._batch(int(sched.lo[c]), int(sched.hi[c]), done_below)

    def _pump(self) -> None:
        """Start loading every window whose slot is free."""
        while self.next_load <= self.last_window and self.next_load - self.n_slots < self.release_below:
            self.loads[self.next_load] = self.windows.submit(self.next_load)
            self.next_load += 1

    def _release(self, w: int) -> None:
        """Window ``w`` is done with once the gathers issued so far have run on this stream:
        its slot takes the window after next. Released as soon as its last gather is issued,
        before a batch that runs into the next window waits for that one to load, so that
        the reads never wait for it (docs/loaders.md, "Read-ahead")."""
        for done in [v for v in self.loads if v <= w]:
            self.consumed[self.loads.pop(done).result().slot] = self.sync.record_on_current()
        self.release_below = max(self.release_below, w + 1)
        self._pump()

    def _batch(self, lo: int, hi: int, done_below: int) -> Batch:
        import torch

        cfg, s, loads = self.cfg, self.slots, self.loads
        per_unit = cfg.spans.layers_per_unit
        acts, scales, meta, labels = [], [], [], []
        for w, a, b in self.plan.segments(lo, hi):
            loaded = loads[w].result()
            slot = loaded.slot
            if cfg.float8 and cfg.out_dtype != "float32":
                check_range(s.unit_max[slot][a:b], cfg.out_dtype)  # before anything of the batch is computed
            if not loaded.waited:
                self.sync.current_waits(loaded.uploaded)
                loaded.waited = True
            flat = s.flat[slot][a * per_unit : b * per_unit]
            acts.append(s.acts[slot].index_select(0, flat))
            if cfg.float8:
                scales.append(s.scales[slot].index_select(0, flat))
            meta.append(s.meta[slot][:, a:b].clone())
            if cfg.selection.has_labels:
                labels.append(s.labels[slot][a:b].clone())
            if w < done_below:
                self._release(w)
        x = acts[0] if len(acts) == 1 else torch.cat(acts)
        m = meta[0] if len(meta) == 1 else torch.cat(meta, dim=1)
        n = hi - lo
        if cfg.float8:  # on the device, after the gather: float32(q) * s, as the host path computes it
            scale = scales[0] if len(scales) == 1 else torch.cat(scales)
            x = x.view(torch.float8_e4m3fn).to(torch.float32).mul_(scale[:, None])
        if cfg.stack:
            x = x.view(n, *cfg.row_shape)
        if x.dtype != torch_dtype(cfg.out_dtype):
            x = x.to(torch_dtype(cfg.out_dtype))
        return Batch(
            acts=x,
            examples=m[0],
            tokens=m[1],
            layers=self.layer_values.expand(n, len(self.layer_values)) if cfg.stack else m[2],
            labels=(labels[0] if len(labels) == 1 else torch.cat(labels)) if labels else None,
        )

    def _stopped(self) -> bool:
        return self.closed

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.windows.close()
        self.sync.close()
        self.loads = {}

    def __del__(self) -> None:
        # Not contextlib.suppress: it may be gone at interpreter shutdown (`Shards.__del__`).
        try:  # noqa: SIM105
            self.close()
        except Exception:  # noqa: S110
            pass
