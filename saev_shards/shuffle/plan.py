"""A shuffle's plan: the output cache's metadata, the chunks, the buckets, and the memory they take.

Everything here is arithmetic on the source's metadata (plus one sequential pass over its
``lengths`` column), so a plan is cheap to make and `describe` can show it before any
data is read. The memory model counts every large buffer either pass holds at once; a
test measures the peak RSS of real runs against it.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ShuffleError
from ..protocol.common import DTYPES, FLOAT8, LABELS_DTYPE, PROTOCOL, SCALES_DTYPE
from ..protocol.metadata import Metadata
from ..reader import Shards
from ..selection import Selection, SelectionSpec, parse_selection
from ..store.roots import SHUFFLE_PREFIX as WORK_PREFIX
from ..writer import DIRECT_BLOCK, DIRECT_IN_FLIGHT
from .options import ShuffleOptions, default_memory
from .order import MAX_BUCKETS
from .scratch import REGION_ALIGN, Field, RowLayout
from .source import SourceReader, per_token_columns

#: Activations per `ShardWriter.write` call in the write pass: large enough that a call's
#: fixed cost is noise, small enough that the batches in flight are a small part of the budget.
WRITE_BATCH_BYTES = 8 << 20
#: Batches in flight in the write pass: one being gathered, these queued, one being written.
WRITE_QUEUE = 2
#: Allowance for everything not modelled (small arrays, interpreter, thread stacks).
SLACK = 16 << 20
#: A bucket's size is binomial; the plan keeps the mean this many standard deviations
#: below the largest bucket the budget holds, so no bucket exceeds it in practice.
BUCKET_SIGMAS = 6
#: Each pass is cut into at least this many steps where the sizes below allow (chunks in the
#: scatter pass, buckets in the write pass): a pass overlaps each step's reads with the step
#: before's writes, but not its first step's reads nor its last step's writes: a 3.6 GB cache cut
#: into the 7 chunks and 4 buckets a 1 GiB budget allows took 2.67 x one read plus one write of
#: the output, into 32 and 16 2.34 (docs/shuffle.md; 2.0 is the floor).
MIN_CHUNKS = 32
MIN_BUCKETS = 16
#: ... with no chunk smaller than this (bytes read; a run is fsynced and sealed per chunk) and no
#: piece (what the write pass reads per request) smaller than `MIN_PIECE` on average.
MIN_CHUNK_BYTES = 16 << 20
MIN_PIECE = 1 << 20
#: Names of the per-row columns of a shuffled cache (protocol.md section 2.4, informative).
SOURCE_EXAMPLE = "source_example"
SOURCE_TOKEN = "source_token"  # noqa: S105 (a column name, not a password)
#: Names the ``data.shuffle.order`` key gives the order (`order` module): a new order gets a new name.
ORDER_NAME = "splitmix64-sort"


@dataclasses.dataclass(frozen=True, eq=False)
class ShufflePlan:
    """Everything a shuffle of ``source`` into ``output`` does, decided before any data is read."""

    source: Shards
    selection: Selection
    output: Metadata
    #: Where the output is published (``root / output.hash``).
    root: Path
    #: The scratch folder of runs (``.shuffle-<output hash>``).
    work: Path
    seed: int
    #: Bytes each process may hold (the budget divided by `workers`).
    memory_bytes: int
    workers: int
    examples_per_chunk: int
    #: Ordinal of the first chosen token of each chunk, then the total.
    chunk_first: tuple[int, ...]
    n_buckets: int
    #: The most rows one bucket may hold within `memory_bytes` in the write pass.
    bucket_rows: int
    #: Rows per `ShardWriter.write` call in the write pass.
    batch_rows: int
    layout: RowLayout
    #: Per-token source columns carried into the output, by name.
    columns: tuple[str, ...]
    allow_nonfinite: bool

    @property
    def n_tokens(self) -> int:
        return self.chunk_first[-1]

    @property
    def n_chunks(self) -> int:
        return len(self.chunk_first) - 1

    @property
    def path(self) -> Path:
        """Where the shuffled cache is (or will be) published."""
        return self.root / self.output.hash

    def chunk_range(self, chunk: int) -> tuple[int, int]:
        """Source examples ``[start, stop)`` of chunk ``chunk``."""
        start = chunk * self.examples_per_chunk
        return start, min(self.source.n_examples, start + self.examples_per_chunk)

    @property
    def scratch_nbytes(self) -> int:
        """Bytes of all runs (an upper bound: every piece padded as if full)."""
        pad = self.n_chunks * self.n_buckets * len(self.layout.fields) * REGION_ALIGN
        return self.n_tokens * self.layout.row_nbytes + pad

    @property
    def piece_nbytes(self) -> int:
        """Mean bytes of one piece: what the write pass reads per request."""
        return self.n_tokens * self.layout.row_nbytes // max(1, self.n_chunks * self.n_buckets)

    def to_json(self) -> dict[str, Any]:
        """What runs are cut for; runs made under another plan are discarded (`plan.json`)."""
        return {
            "version": 1,
            "source": self.source.metadata.hash,
            "output": self.output.hash,
            "seed": self.seed,
            "selection": self.selection.to_json(),
            "examples_per_chunk": self.examples_per_chunk,
            "n_chunks": self.n_chunks,
            "n_tokens": self.n_tokens,
            "n_buckets": self.n_buckets,
            "rows": self.layout.to_json(),
        }

    def describe(self) -> list[str]:
        """A few lines for people: sizes, passes, memory and scratch space."""
        md = self.output
        acts = md.nbytes + md.scales_nbytes
        mib = 1 << 20
        return [
            f"source    {self.source.path} ({self.source.n_examples:,} examples)",
            f"select    layers {list(self.selection.layers)}, {self.selection.tokens} tokens"
            + (", padding skipped (lengths column)" if self.selection.has_lengths else ""),
            f"output    {self.path}",
            f"          {md.n_examples:,} tokens x {md.n_layers} layers x {md.d_model} {md.dtype}: "
            f"{acts / 1e9:.2f} GB in {md.n_shards} shards, seed {self.seed}",
            f"passes    scatter {self.n_chunks} chunks of {self.examples_per_chunk:,} examples into "
            f"{self.n_buckets} buckets, then write the buckets in order ({self.workers} process"
            + ("es" if self.workers > 1 else "")
            + ")",
            f"memory    {self.memory_bytes * self.workers / mib:,.0f} MiB budget; reads of "
            f"~{self.piece_nbytes / mib:.1f} MiB in the write pass",
            f"scratch   {self.scratch_nbytes / 1e9:.2f} GB in {self.work}",
        ]


def output_metadata(
    source: Shards,
    selection: Selection,
    seed: int,
    n_tokens: int,
    dtype: str,
    patches_per_shard: int,
    dropped: dict[str, int] | None = None,
) -> Metadata:
    """The shuffled cache's metadata: one token per example, the chosen layers, the provenance in
    ``data`` (with the token masks, what they dropped: positions per chosen layer, by mask)."""
    md = source.metadata
    shuffle: dict[str, Any] = {"source": md.hash, **selection.to_json(), "seed": seed, "order": ORDER_NAME}
    if dropped:
        shuffle["dropped"] = dict(dropped)
    return Metadata(
        family=md.family,
        ckpt=md.ckpt,
        layers=selection.layers,
        patches_per_ex=1,
        cls_token=False,
        d_model=md.d_model,
        n_examples=n_tokens,
        patches_per_shard=patches_per_shard,
        data={
            "shuffle": shuffle,
            "source_data": md.data,
        },
        dataset=md.dataset,
        dtype=dtype,
        protocol=PROTOCOL,
        # What each chosen slot holds, where the source says (protocol 3.2, which Metadata then picks).
        sites=None if md.sites is None else tuple(md.sites[md.layer_index(v)] for v in selection.layers),
    )


def row_layout(source: Shards, selection: Selection, dtype: str, columns: tuple[str, ...]) -> RowLayout:
    """Fields of a run row: activations ``(L, D)`` (float8_e4m3 as their bytes, with their scales
    ``(L,)``), sort key, source example and token, label, columns."""
    md = source.metadata
    carried = per_token_columns(source)
    n_layers = len(selection.layers)
    if dtype == FLOAT8:
        acts = [Field("acts", np.dtype("|u1"), (n_layers, md.d_model)), Field("scales", SCALES_DTYPE, (n_layers,))]
    else:
        acts = [Field("acts", DTYPES[dtype], (n_layers, md.d_model))]
    fields = [
        *acts,
        Field("key", np.dtype("<u8")),
        Field(SOURCE_EXAMPLE, np.dtype("<i8")),
        Field(SOURCE_TOKEN, np.dtype("<i4")),
    ]
    fields += [Field(f"column.{name}", carried[name]) for name in columns]
    if source.manifest.labels is not None:
        fields.append(Field("label", LABELS_DTYPE))
    return RowLayout(tuple(fields))


def writer_overhead(md: Metadata) -> int:
    """Bytes `ShardWriter` holds for O_DIRECT staging: its rotating blocks, when a shard is at least one block."""
    if md.n_shards and md.shard_nbytes(0) >= DIRECT_BLOCK:
        return (DIRECT_IN_FLIGHT + 1) * DIRECT_BLOCK
    return 0


@dataclasses.dataclass(frozen=True)
class _Memory:
    """The memory model of both passes for one process (bytes; see `make_plan`)."""

    per_process: int
    #: Rows per `ShardWriter.write` call in the write pass.
    batch_rows: int
    #: What the write pass holds besides its buckets.
    fixed_write: int
    #: What one row of a bucket costs in the write pass.
    per_bucket_row: int
    #: What one source example of a chunk costs in the scatter pass.
    per_example: int
    slack: int


def _memory(
    source: Shards,
    selection: Selection,
    options: ShuffleOptions,
    dtype: str,
    layout: RowLayout,
    reader: SourceReader,
    columns: tuple[str, ...],
) -> _Memory:
    """Every large buffer either pass holds at once, per process (a test measures real runs against it)."""
    md = source.metadata
    per_process = _budget(options) // int(options.workers)
    slack = min(SLACK, per_process // 8)
    row = layout.row_nbytes
    acts_row = layout.fields[0].row_nbytes
    # Batches of the write pass: WRITE_BATCH_BYTES of activations, less under a small budget.
    batch_rows = max(1, min(WRITE_BATCH_BYTES, per_process // 32) // acts_row)
    # The write pass holds two buckets (one loading, one being written) and their sort
    # order, the batches in flight, and the writer's own O_DIRECT buffers.
    fixed_write = (WRITE_QUEUE + 2) * batch_rows * row + slack
    per_bucket_row = 2 * row + 16  # rows of two buckets, plus argsort's indices and its work space
    # The scatter pass holds, per example of a chunk: two read buffers (one loading), the
    # rows beside the activations, two run buffers (one being written) and the index
    # arithmetic (about 72 bytes per chosen token, 8 more per chosen layer).
    side = (
        8
        + md.patches_per_ex
        + md.tokens_per_ex * sum(np.dtype(source.manifest.columns[c].dtype).itemsize for c in columns)
    )
    # A cast goes through float32: the picked values, their float32 copy and the cast result
    # (and a float8_e4m3 source's scales, or the scales of quantized output).
    cast = 0
    if dtype != source.dtype:
        cast = len(selection.layers) * (md.d_model * (md.itemsize + 4 + DTYPES[dtype].itemsize) + 8)
    per_token = 2 * row + 72 + 8 * len(selection.layers) + cast
    per_example = (
        2 * (reader.example_nbytes + reader.scales_nbytes)
        + 2 * side
        + md.tokens_per_ex
        + selection.per_example * per_token
    )
    return _Memory(per_process, batch_rows, fixed_write, per_bucket_row, per_example, slack)


def _check_columns(source: Shards) -> tuple[str, ...]:
    """The per-token columns carried into the output; `ShuffleError` for one named like the output's own."""
    columns = tuple(per_token_columns(source))
    for name in columns:
        if name in (SOURCE_EXAMPLE, SOURCE_TOKEN):
            raise ShuffleError(
                f"{source.path}: its per-token column {name!r} would clash with the shuffled cache's own column"
            )
    return columns


def _count_chunks(reader: SourceReader, n_source: int, examples_per_chunk: int) -> tuple[list[int], dict[str, int]]:
    """Ordinal of each chunk's first chosen token (then the total), and what the token masks dropped."""
    first = [0]
    dropped: dict[str, int] = {}
    for start in range(0, n_source, examples_per_chunk):
        count, taken = reader.count_and_dropped(start, min(n_source, start + examples_per_chunk))
        first.append(first[-1] + count)
        for name, k in taken.items():
            dropped[name] = dropped.get(name, 0) + k
    return first, dropped


def make_plan(
    source: Shards,
    root: Path,
    spec: SelectionSpec = SelectionSpec(),  # noqa: B008 (frozen: one shared default is safe)
    options: ShuffleOptions = ShuffleOptions(),  # noqa: B008
    *,
    progress: bool | None = False,
) -> ShufflePlan:
    """Check the selection and the options against the source and size the passes; raises `ShuffleError`.

    ``options.n_buckets`` and ``options.examples_per_chunk`` override the sizing; the output
    does not depend on them. ``progress``: a bar while a norm filter is computed.
    """
    selection = parse_selection(source, spec, ShuffleError, progress=progress)
    dtype = source.dtype if options.dtype is None else str(options.dtype)
    md = source.metadata
    patches_per_shard = md.patches_per_shard if options.patches_per_shard is None else int(options.patches_per_shard)
    if patches_per_shard < len(selection.layers):
        raise ShuffleError(
            f"patches_per_shard: expected at least {len(selection.layers)} (one token at every chosen layer), "
            f"found {patches_per_shard}"
        )
    columns = _check_columns(source)
    layout = row_layout(source, selection, dtype, columns)
    reader = SourceReader(source, selection)
    mem = _memory(source, selection, options, dtype, layout, reader, columns)
    seed, n_buckets = int(options.seed), options.n_buckets
    # Chunks first (their token counts give the total), then the buckets from the total.
    n_source = source.n_examples
    bound = output_metadata(source, selection, seed, n_source * selection.per_example, dtype, patches_per_shard)
    most_buckets = n_buckets or max(
        MIN_BUCKETS, _n_buckets(bound, mem.per_process, mem.fixed_write, mem.per_bucket_row)[0]
    )
    fixed_scatter = 2 * most_buckets * len(layout.fields) * REGION_ALIGN + mem.slack
    room = mem.per_process - fixed_scatter
    if room < mem.per_example:
        raise ShuffleError(
            f"memory: {_mib(_budget(options))} is too small for this source: one example needs "
            f"{_mib(mem.per_example + fixed_scatter)} in the scatter pass"
            + (f" per process ({options.workers} processes)" if options.workers > 1 else "")
        )
    # As large as the budget allows, but small enough that the pass is cut into MIN_CHUNKS steps.
    steps = max(-(-n_source // MIN_CHUNKS), -(-MIN_CHUNK_BYTES // max(1, reader.example_nbytes)))
    examples_per_chunk = options.examples_per_chunk or max(1, min(n_source, room // mem.per_example, steps))
    first, dropped = _count_chunks(reader, n_source, examples_per_chunk)
    output = output_metadata(source, selection, seed, first[-1], dtype, patches_per_shard, dropped)
    sized_buckets, bucket_rows = _n_buckets(output, mem.per_process, mem.fixed_write, mem.per_bucket_row)
    # As few as the budget allows, but MIN_BUCKETS where the pieces stay MIN_PIECE on average.
    n_pieces = first[-1] * layout.row_nbytes // MIN_PIECE
    pipelined = min(MIN_BUCKETS, n_pieces // max(1, len(first) - 1))
    base = Path(options.work_dir) if options.work_dir is not None else Path(root)
    return ShufflePlan(
        source=source,
        selection=selection,
        output=output,
        root=Path(root),
        work=base / f"{WORK_PREFIX}{output.hash}",
        seed=seed,
        memory_bytes=mem.per_process,
        workers=int(options.workers),
        examples_per_chunk=int(examples_per_chunk),
        chunk_first=tuple(first),
        n_buckets=n_buckets or max(sized_buckets, pipelined),
        bucket_rows=bucket_rows,
        batch_rows=mem.batch_rows,
        layout=layout,
        columns=columns,
        allow_nonfinite=bool(options.allow_nonfinite),
    )


def _n_buckets(output: Metadata, per_process: int, fixed_write: int, per_bucket_row: int) -> tuple[int, int]:
    """``(K, most rows per bucket)`` for the write pass of ``output`` within ``per_process`` bytes."""
    room = per_process - fixed_write - writer_overhead(output)
    bucket_rows = room // per_bucket_row
    if bucket_rows < 1:
        raise ShuffleError(
            f"memory: {_mib(per_process)} per process is too small: the write pass needs "
            f"{_mib(fixed_write + writer_overhead(output) + per_bucket_row)} for its buffers and one bucket row"
        )
    n_tokens = output.n_examples
    mean = bucket_rows - BUCKET_SIGMAS * math.sqrt(bucket_rows) - 1
    n_buckets = 1 if n_tokens <= bucket_rows else -(-n_tokens // max(1, int(mean)))
    if n_buckets > MAX_BUCKETS:
        raise ShuffleError(f"memory: {_mib(per_process)} per process needs more than {MAX_BUCKETS} buckets; raise it")
    return n_buckets, int(bucket_rows)


def _budget(options: ShuffleOptions) -> int:
    """The memory all processes together may hold: the options', else `default_memory`."""
    return default_memory() if options.memory_bytes is None else int(options.memory_bytes)


def _mib(n: int) -> str:
    """A byte count for messages: MiB when large, exact bytes when small."""
    return f"{n / (1 << 20):,.0f} MiB" if n >= 10 << 20 else f"{n:,} bytes"
