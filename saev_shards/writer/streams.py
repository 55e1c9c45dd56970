"""The writer's I/O side: streams cut at shard boundaries into part files, and the thread
that writes them.

Every stream (activations, labels, numeric columns, text) goes through one loop,
`Parts.write`: a batch is cut where shards end, each piece appended to the stream's open
part file (`_Cursor`, hashing as it goes), and a part that is complete is closed and
noted. A float8_e4m3 cache's scales are cut with their activations, into the shard's scale
file. When every stream has completed shard ``k``, its part record (``part<06d>.json``)
seals it. Files published as written (shards and scale files) are digested per block too
in protocol 3.1, for blocks.json. Everything here runs in the writer's I/O thread
(`Pipeline`), in the order the caller submitted it.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from ..errors import WriterBusyError
from ..fileio import IO_CHUNK, BlockHasher, fault_point, naming_disk_full, try_flock, write_file_atomic
from ..protocol.metadata import Metadata
from ..protocol.staging import SCALES, part_file, part_record
from . import direct
from .stats import StatsPass

#: Streams whose part files are published as they are written (not joined by finalize).
PUBLISHED_AS_WRITTEN = ("acts", SCALES)

_RESUME_NOTE = "; the shards sealed so far are kept: free some space and resume (ShardWriter(..., resume=True))"


class StreamSpec:
    """What one stream writes per example: dtype and per-example shape (text: none)."""

    def __init__(self, key: str, dtype: np.dtype[Any] | None, tail: tuple[int, ...]) -> None:
        self.key = key
        self.dtype = dtype
        self.tail = tail

    @property
    def is_text(self) -> bool:
        return self.key.startswith("text.")

    def to_json(self) -> dict[str, Any]:
        if self.is_text:
            return {}
        assert self.dtype is not None
        return {"dtype": self.dtype.str, "shape": list(self.tail)}

    def part_info(self, n_examples: int) -> dict[str, Any]:
        """What the part record says about a complete part besides its size and digest."""
        if self.key in PUBLISHED_AS_WRITTEN:
            return {}
        return {"n_lines": n_examples} if self.is_text else self.to_json()


def _byte_view(data: bytes | npt.NDArray[Any]) -> memoryview:
    """The raw bytes of ``data`` as a flat memoryview (also for empty and 0-d arrays)."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
    return memoryview(data)


class _Cursor:
    """A stream's open part file: the shard it is in, examples written, digests so far (per
    ``block_size`` bytes too, when given)."""

    def __init__(self, path: Path, k: int, expected_nbytes: int | None, block_size: int | None = None) -> None:
        self.path = path
        self.k = k
        self.count = 0
        self.nbytes = 0
        self.expected_nbytes = expected_nbytes  # None for text, whose size is known only at the end
        self.hasher = BlockHasher(block_size)
        is_shard = path.name.startswith("acts")
        # O_DIRECT only pays for files of at least one block; small files stay buffered.
        with naming_disk_full(path, expected_nbytes, _RESUME_NOTE):
            self.file = direct.SequentialFile(path, direct=is_shard and (expected_nbytes or 0) >= direct.DIRECT_BLOCK)
        if is_shard and not try_flock(self.file.fileno()):
            self.file.abandon()
            raise WriterBusyError(f"{path} is being written by another process")

    def write(self, data: bytes | npt.NDArray[Any]) -> None:
        view = _byte_view(data)
        needed, at_least = self._needed(view.nbytes)
        with naming_disk_full(self.path, needed, _RESUME_NOTE, at_least=at_least):
            self.file.write(view)
        self.hasher.update(view)
        self.nbytes += view.nbytes

    def close(self, durable: bool) -> None:
        needed, at_least = self._needed(0)
        with naming_disk_full(self.path, needed, _RESUME_NOTE, at_least=at_least):
            self.file.close(durable)

    def _needed(self, pending: int) -> tuple[int, bool]:
        """``(bytes, is_lower_bound)`` this file needs: its size, or (text) what it has so far."""
        if self.expected_nbytes is not None:
            return self.expected_nbytes, False
        return self.nbytes + pending, True


class Parts:
    """The I/O thread's state: every stream's open part file, the parts complete per shard,
    and sealing. Only the I/O thread touches it (the caller, before the thread starts)."""

    def __init__(self, md: Metadata, staging: Path, keys: set[str], stats: StatsPass | None, durable: bool) -> None:
        self.md = md
        self.staging = staging
        self.durable = durable
        #: Streams declared so far, in operation order (declarations are operations too),
        #: so the I/O thread never reads a dict the caller is changing.
        self.keys = keys
        self.stats = stats
        self.cursors: dict[str, _Cursor] = {}
        self.done: dict[int, dict[str, dict[str, Any]]] = {}  # shard -> stream -> part info
        #: Protocol 3.1: the files published as written are digested per block of this size.
        self.block_size = md.rules.block_size
        #: A float8_e4m3 cache's scales: float32 ``(L, T)`` per example, sealed with the rest.
        self.scales_spec = StreamSpec(SCALES, np.dtype("<f4"), md.shard_shape[1:3])

    def write(
        self,
        spec: StreamSpec,
        batch: npt.NDArray[Any] | list[bytes],
        first: int,
        lengths: npt.NDArray[Any] | None,
        scales: npt.NDArray[Any] | None = None,
    ) -> None:
        """Append ``batch`` (examples ``first``, ``first + 1``, ... of stream ``spec``: an
        array, or text as one JSON line per example), cut at shard boundaries; a float8_e4m3
        cache's activations come with their ``scales`` ``(B, L, T)``, cut with them."""
        pos = 0
        while pos < len(batch):
            cur = self._cursor(spec, first + pos)
            room = self.md.shard_n_examples(cur.k) - cur.count
            piece = batch[pos : pos + room]
            if isinstance(piece, list):
                cur.write(b"".join(piece))
            else:
                cur.write(piece)
                scale_piece = None
                if scales is not None:
                    scale_piece = scales[pos : pos + room]
                    scale_cur = self._cursor(self.scales_spec, first + pos)
                    scale_cur.write(scale_piece)
                    scale_cur.count += len(scale_piece)
                    if scale_cur.count == self.md.shard_n_examples(scale_cur.k):
                        self._finish_part(self.scales_spec, scale_cur)
                if spec.key == "acts" and self.stats is not None:
                    self.stats.submit(cur.k, piece, None if lengths is None else lengths[pos : pos + room], scale_piece)
            cur.count += len(piece)
            pos += len(piece)
            if cur.count == self.md.shard_n_examples(cur.k):
                self._finish_part(spec, cur)

    def _cursor(self, spec: StreamSpec, example: int) -> _Cursor:
        cur = self.cursors.get(spec.key)
        if cur is None:
            k = example // self.md.examples_per_shard
            # Bytes of the complete part (for O_DIRECT and disk-full messages); None for text.
            expected = None
            if spec.key == "acts":
                expected = self.md.shard_nbytes(k)
            elif spec.dtype is not None:
                expected = self.md.shard_n_examples(k) * spec.dtype.itemsize * math.prod(spec.tail)
            blocks = self.block_size if spec.key in PUBLISHED_AS_WRITTEN else None
            cur = _Cursor(self.staging / part_file(k, spec.key), k, expected, blocks)
            self.cursors[spec.key] = cur
        return cur

    def _finish_part(self, spec: StreamSpec, cur: _Cursor) -> None:
        key = spec.key
        if key == "acts" and cur.expected_nbytes is not None and cur.nbytes < cur.expected_nbytes:
            # Protocol 2.1: saev memmaps every shard at full size; pad the last so it can read ours.
            pad = cur.expected_nbytes - cur.nbytes
            zeros = bytes(min(pad, IO_CHUNK))
            while pad:
                cur.write(zeros[: min(pad, IO_CHUNK)])
                pad -= min(pad, IO_CHUNK)
        # Only shard files are published as written, so only they need an fsync here. Part
        # files are joined into fresh files that finalize fsyncs, and a resumed writer
        # re-verifies every sealed part against its record, so losing an unsynced part or
        # record to a crash costs a rewrite, never a wrong cache.
        cur.close(self.durable and key in PUBLISHED_AS_WRITTEN)
        del self.cursors[key]
        fault_point("shard-written" if key == "acts" else "part-written", cur.k)
        info = {"nbytes": cur.nbytes, "xxh3_128": cur.hasher.hexdigest(), **spec.part_info(cur.count)}
        if key in PUBLISHED_AS_WRITTEN and self.block_size is not None:
            info["blocks"] = cur.hasher.block_hexdigests()
        self.done.setdefault(cur.k, {})[key] = info
        self._maybe_seal(cur.k)

    def _maybe_seal(self, k: int) -> None:
        done = self.done.get(k, {})
        if not all(key in done for key in self.keys):
            return
        stats = None
        if self.stats is not None:
            self.stats.wait_through(k)
            stats = self.stats.shards.get(k)
        record = {
            "shard": k,
            "n_examples": self.md.shard_n_examples(k),
            "acts": done["acts"],
            "scales": done.get(SCALES),
            "streams": {key: done[key] for key in sorted(self.keys) if key not in PUBLISHED_AS_WRITTEN},
            "stats": stats.to_json() if stats is not None else None,
        }
        record_path = self.staging / part_record(k)
        write_file_atomic(record_path, orjson.dumps(record), durable=False, note=_RESUME_NOTE)  # see _finish_part
        fault_point("record-written", k)

    def abandon(self) -> None:
        """Close every open part file without finishing it (a kill or an error)."""
        for cur in list(self.cursors.values()):
            cur.file.abandon()


class Pipeline:
    """Runs writer operations in order, in one background thread or inline."""

    def __init__(self, background: bool) -> None:
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        if background:
            self.queue: queue.Queue[tuple[Callable[..., None], tuple[Any, ...]] | None] = queue.Queue(maxsize=2)
            self.thread = threading.Thread(target=self._run, name="saev-shards-writer", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            if self.error is None:
                fn, args = item
                try:
                    fn(*args)
                except BaseException as err:
                    self.error = err

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        self.check()
        if self.thread is None:
            fn(*args)
        else:
            self.queue.put((fn, args))

    def drain(self) -> None:
        """Wait for every submitted operation; raise the first error if any."""
        if self.thread is not None:
            self.queue.put(None)
            self.thread.join()
            self.thread = None
        self.check()
