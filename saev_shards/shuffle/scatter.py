"""The scatter pass: cut the source's chosen tokens into runs of bucket-sorted pieces.

For each chunk of source examples: read it (one large ``pread`` per shard touched, or one
per chosen ``(example, layer)`` slice when few layers of large slices are chosen), list its
chosen tokens in source order, give each its sort key and bucket (`order`), group the rows
by bucket with one stable counting sort, gather every row's activations at the chosen
layers (one vectorised ``take`` per piece) and its source example, token, label and
per-token columns, then write the run front to back and seal it with its record. One
thread reads the next chunk and another writes the previous run while a chunk is gathered;
a third seals the runs written (fsync, then the record) while the next ones are written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from ..codecs import dtypes, float8
from ..errors import NonFiniteError, ShuffleError
from ..fileio import BlockHasher
from ..protocol.float8 import FLOAT8_DTYPE
from .order import bucket_of, sort_keys
from .plan import SOURCE_EXAMPLE, SOURCE_TOKEN, ShufflePlan
from .scratch import Buffers, RunRecord, run_file, sync_run, write_record, write_run_data
from .source import SourceReader

#: Label a [CLS] token gets in the shuffled cache (labels.bin has no CLS column; the loaders' CLS_LABEL).
CLS_LABEL = 255


@dataclasses.dataclass
class _Chunk:
    """One chunk as read: its examples, activations and the rows beside them."""

    chunk: int
    start: int
    stop: int
    acts: npt.NDArray[Any]  # (n, rows, T, D) in the source dtype
    scales: npt.NDArray[np.float32] | None  # (n, rows, T): a float8_e4m3 source's
    lengths: npt.NDArray[np.int64] | None
    labels: npt.NDArray[np.uint8] | None
    columns: dict[str, npt.NDArray[Any]]


def scatter(
    plan: ShufflePlan,
    chunks: Sequence[int],
    on_rows: Callable[[int], None],
    after_run: Callable[[int], None],
    durable: bool,
    buffers: Buffers | None = None,
) -> None:
    """Write the runs of ``chunks``; ``on_rows(n)`` after each run, ``after_run(chunk)`` once it is sealed.

    ``buffers``: where the read and run buffers are carved from (the write pass reuses
    them); None: a mapping of this call's own."""
    if not chunks:
        return
    reader = SourceReader(plan.source, plan.selection)
    most_examples = max(plan.chunk_range(c)[1] - plan.chunk_range(c)[0] for c in chunks)
    most_rows = max(plan.chunk_first[c + 1] - plan.chunk_first[c] for c in chunks)
    # Anonymous memory takes none until touched: a short last chunk costs less.
    read_nbytes = max(1, most_examples * reader.example_nbytes)
    run_nbytes = plan.layout.piece_nbytes(most_rows) + plan.n_buckets * len(plan.layout.fields) * 64
    own = buffers is None
    carved = Buffers() if buffers is None else buffers
    views = carved.carve([read_nbytes, read_nbytes, run_nbytes, run_nbytes])
    read_buffers = [np.frombuffer(v, np.uint8) for v in views[:2]]
    run_buffers = views[2:]
    reads = ThreadPoolExecutor(1, "saev-shuffle-read")
    writes = ThreadPoolExecutor(1, "saev-shuffle-write")
    seals = ThreadPoolExecutor(1, "saev-shuffle-seal")
    pending: list[Future[Future[None]]] = []  # runs being written, newest last: each gives its sealing
    sealing: list[Future[None]] = []
    failed = True
    try:
        next_read = reads.submit(_read, reader, plan, chunks[0], read_buffers[0])
        for i in range(len(chunks)):
            data = next_read.result()
            if i + 1 < len(chunks):
                next_read = reads.submit(_read, reader, plan, chunks[i + 1], read_buffers[(i + 1) % 2])
            if len(pending) >= 2:
                sealing.append(pending.pop(0).result())  # the run buffer we are about to fill is written
            while sealing and sealing[0].done():
                sealing.pop(0).result()  # a run that failed to seal stops the pass
            buffer = run_buffers[i % 2]
            record = _gather(plan, reader, data, buffer)
            pending.append(writes.submit(_write, plan, record, buffer, durable, seals, on_rows, after_run))
        sealing += [fut.result() for fut in pending]
        for seal in sealing:
            seal.result()
        failed = False
    finally:
        for fut in pending:  # never unmap a buffer a write is still using
            with contextlib.suppress(BaseException):
                fut.result()
        # A read may block on a slow or hung filesystem: after an error or Ctrl-C it is not
        # waited for (its buffer stays referenced by the thread; the command ends anyway).
        reads.shutdown(wait=not failed, cancel_futures=True)
        writes.shutdown(wait=True, cancel_futures=True)
        seals.shutdown(wait=True)  # every written run is sealed or removed: its descriptor closed
        if own:
            carved.close()


def _read(reader: SourceReader, plan: ShufflePlan, chunk: int, buffer: npt.NDArray[np.uint8]) -> _Chunk:
    start, stop = plan.chunk_range(chunk)
    return _Chunk(
        chunk=chunk,
        start=start,
        stop=stop,
        acts=reader.acts(start, stop, buffer),
        scales=reader.scales(start, stop),
        lengths=reader.lengths(start, stop),
        labels=reader.labels(start, stop),
        columns={name: reader.column(name, start, stop) for name in plan.columns},
    )


def _gather(plan: ShufflePlan, reader: SourceReader, data: _Chunk, buffer: Any) -> RunRecord:
    """Fill ``buffer`` with chunk ``data``'s run; its record (digests are added when it is written)."""
    n_examples = data.stop - data.start
    mask = reader.mask(data.lengths, n_examples, data.start)
    ex_local, tokens = np.nonzero(mask)  # source order: example, then token position
    n_rows = len(ex_local)
    first = plan.chunk_first[data.chunk]
    if n_rows != plan.chunk_first[data.chunk + 1] - first:
        raise ShuffleError(
            f"{plan.source.path}: examples [{data.start}, {data.stop}) hold {n_rows} chosen tokens, the plan counted "
            f"{plan.chunk_first[data.chunk + 1] - first} (was the source changed?)"
        )
    keys = sort_keys(plan.seed, np.arange(first, first + n_rows, dtype=np.int64))
    buckets = bucket_of(keys, plan.n_buckets)
    if plan.n_buckets > 1:
        # A stable sort keeps source order within each bucket; numpy radix-sorts 16-bit keys.
        small = buckets.astype(np.uint16) if plan.n_buckets <= 1 << 16 else buckets
        order = np.argsort(small, kind="stable")
        ex_local, tokens, keys = ex_local[order], tokens[order], keys[order]
        del order, small
    counts = np.bincount(buckets, minlength=plan.n_buckets).astype(np.int64)
    del buckets
    bounds = np.concatenate([[0], np.cumsum(counts)])
    offsets = plan.layout.piece_offsets(counts)

    md = plan.source.metadata
    n_rows_read = data.acts.shape[1]
    layer_rows = reader.layer_rows
    # Index of every chosen (token, layer) vector in the chunk viewed as (n * rows * T, D).
    vectors = (ex_local[:, None] * n_rows_read + layer_rows[None, :]) * md.tokens_per_ex + tokens[:, None]
    source_vectors = data.acts.reshape(-1, md.d_model)
    source_scales = None if data.scales is None else data.scales.reshape(-1)
    row_values = _row_values(plan, data, ex_local, tokens, keys)
    out_dtype = plan.output.dtype
    whole = np.frombuffer(buffer, dtype=np.uint8, count=int(offsets[-1])) if offsets[-1] else None
    for k in range(plan.n_buckets):
        a, b = int(bounds[k]), int(bounds[k + 1])
        if a == b:
            continue
        assert whole is not None
        targets = {}
        for field, offset, nbytes in plan.layout.regions(b - a):
            region = whole[int(offsets[k]) + offset : int(offsets[k]) + offset + nbytes]
            targets[field.name] = region.view(field.dtype).reshape(b - a, *field.shape)
        for name, target in targets.items():
            if name == "acts":
                out_scales = targets.get("scales")
                _gather_acts(
                    source_vectors, source_scales, vectors[a:b], target, out_scales, plan.source.dtype, out_dtype
                )
                stored = target if out_scales is None else target.view(FLOAT8_DTYPE)
                if not plan.allow_nonfinite and dtypes.nonfinite_mask_any(stored, out_dtype):
                    raise _nonfinite(plan, stored, row_values[SOURCE_EXAMPLE][a:b])
            elif name != "scales":  # written with the activations
                target[...] = row_values[name][a:b]
    return RunRecord(
        chunk=data.chunk,
        start=data.start,
        stop=data.stop,
        counts=tuple(int(n) for n in counts),
        digests=(),
        nbytes=int(offsets[-1]),
    )


def _row_values(
    plan: ShufflePlan,
    data: _Chunk,
    ex_local: npt.NDArray[np.int64],
    tokens: npt.NDArray[np.int64],
    keys: npt.NDArray[np.uint64],
) -> dict[str, npt.NDArray[Any]]:
    """Every non-activation field of the chunk's rows, in run order."""
    values: dict[str, npt.NDArray[Any]] = {
        "key": keys,
        SOURCE_EXAMPLE: ex_local + data.start,
        SOURCE_TOKEN: tokens.astype(np.int32),
    }
    for name, column in data.columns.items():
        values[f"column.{name}"] = column[ex_local, tokens]
    if data.labels is not None:
        cls = int(plan.source.metadata.cls_token)
        labels = np.full(len(ex_local), CLS_LABEL, dtype=np.uint8)
        content = tokens >= cls
        labels[content] = data.labels[ex_local[content], tokens[content] - cls]
        values["label"] = labels
    return values


def _gather_acts(
    source: npt.NDArray[Any],
    source_scales: npt.NDArray[np.float32] | None,
    vectors: npt.NDArray[np.int64],
    out: npt.NDArray[Any],
    out_scales: npt.NDArray[np.float32] | None,
    stored: str,
    wanted: str,
) -> None:
    """``out[i, l] = source[vectors[i, l]]``, cast from ``stored`` to ``wanted``. A float8_e4m3
    source comes with its ``source_scales`` (one per vector), float8_e4m3 output goes to
    ``out`` (its bytes) and ``out_scales``: copied as they are from a float8_e4m3 source,
    quantized by the rule from any other."""
    flat = vectors.reshape(-1)
    rows = out.reshape(-1, out.shape[-1])
    if stored == wanted:
        # mode="clip" skips numpy's buffered bounds check (3x faster); the indices are in range by construction.
        np.take(source.view(rows.dtype), flat, axis=0, out=rows, mode="clip")
        if out_scales is not None and source_scales is not None:
            np.take(source_scales, flat, out=out_scales.reshape(-1), mode="clip")
        return
    picked = np.take(source, flat, axis=0, mode="clip")
    picked_scales = None if source_scales is None else np.take(source_scales, flat, mode="clip")
    wide = dtypes.to_float32(picked, stored, picked_scales)
    if out_scales is not None:  # quantized by the rule, vector by vector
        values, scales = float8.quantize(wide)
        rows[...] = values.view(np.uint8)
        out_scales.reshape(-1)[...] = scales
        return
    cast, _ = dtypes.to_stored(wide, wanted)
    rows[...] = cast


def _nonfinite(plan: ShufflePlan, acts: npt.NDArray[Any], source_examples: npt.NDArray[np.int64]) -> NonFiniteError:
    bad_rows = dtypes.nonfinite_elements(acts, plan.output.dtype).reshape(len(acts), -1).any(axis=1)
    examples = np.unique(source_examples[bad_rows]).tolist()
    shown = ", ".join(map(str, examples[:10])) + (", ..." if len(examples) > 10 else "")
    return NonFiniteError(
        f"{plan.source.path}: {int(bad_rows.sum())} chosen tokens of source examples {shown} are not finite "
        f"in {plan.output.dtype}; pass allow_nonfinite=True (--allow-nonfinite) to store them"
    )


def _write(
    plan: ShufflePlan,
    record: RunRecord,
    buffer: Any,
    durable: bool,
    seals: ThreadPoolExecutor,
    on_rows: Callable[[int], None],
    after_run: Callable[[int], None],
) -> Future[None]:
    """Hash each piece (its regions' bytes, padding excluded) and write the run; return its
    sealing (`_seal`), started in ``seals``, so that the buffer is free while the run is fsynced."""
    offsets = plan.layout.piece_offsets(record.counts)
    view = memoryview(buffer)
    try:
        digests = []
        for k, n in enumerate(record.counts):
            h = BlockHasher()
            for _, offset, nbytes in plan.layout.regions(n):
                start = int(offsets[k]) + offset
                h.update(view[start : start + nbytes])
            digests.append(h.hexdigest())
        path = plan.work / run_file(record.chunk)
        fd = write_run_data(path, view[: record.nbytes])
    finally:
        view.release()
    record = dataclasses.replace(record, digests=tuple(digests))
    return seals.submit(_seal, plan, record, fd, durable, on_rows, after_run)


def _seal(
    plan: ShufflePlan,
    record: RunRecord,
    fd: int,
    durable: bool,
    on_rows: Callable[[int], None],
    after_run: Callable[[int], None],
) -> None:
    """Make the run written through ``fd`` durable, then seal it with its record.

    An fsync waits for the disk's cache (tens of milliseconds per run here): done here, in a
    thread of its own, it overlaps the next run's writes instead of holding them up. A run
    whose fsync or record fails is removed: every run left in the folder is sealed. After
    an error elsewhere the runs already written are still sealed (or removed), in order."""
    path = plan.work / run_file(record.chunk)
    sync_run(path, fd, record.nbytes, durable)
    try:
        write_record(plan.work, record, durable)
    except BaseException:  # a run without its record would only hold space (a full disk, often)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    on_rows(sum(record.counts))
    after_run(record.chunk)
