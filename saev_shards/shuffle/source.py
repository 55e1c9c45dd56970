"""What a shuffle reads from its source: the chosen tokens, and the rows beside them.

Everything is read with ``pread`` into buffers the caller owns, never through memmaps:
pages a memmap touches stay resident and would count against the memory budget
(``labels.bin`` of an ImageNet cache alone is 250 MB).
"""

from __future__ import annotations

import dataclasses
import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import ShuffleError
from ..fileio import pread_exact
from ..protocol.jsonfile import is_int
from ..reader import Shards

#: Token choices: the patches (content tokens), the [CLS] token, or both.
TOKEN_CHOICES = ("content", "cls", "all")
#: Bytes of one (example, layer) slice from which chosen layers are read slice by slice
#: rather than as whole examples (the loaders' rule: smaller slices cost a request each).
MIN_SLICE_READ = 128 << 10
#: Requests in flight when the shuffle reads the source and its runs (the loaders' default):
#: the development machine's disk serves 1.3-1.5 x more than with one at a time.
READ_THREADS = 4
#: Examples per step when a per-example column is scanned (bounds the scan's memory).
SCAN_EXAMPLES = 1 << 16


@dataclasses.dataclass(frozen=True)
class Selection:
    """Which tokens of the source a shuffle takes: layers (values, in source order) and token kind.

    Padding (positions ``>= lengths[i]`` when the source has a ``lengths`` column) is
    always skipped: it holds zeros, not activations.
    """

    layers: tuple[int, ...]
    tokens: str
    #: Positions of `layers` in the source's ``metadata.layers`` (ascending).
    layer_positions: tuple[int, ...]
    #: Token positions chosen in every example before padding is removed (ascending).
    positions: tuple[int, ...]
    #: Whether the source has a ``lengths`` column (chosen positions then vary per example).
    has_lengths: bool

    @property
    def per_example(self) -> int:
        """Chosen tokens of an example without padding."""
        return len(self.positions)

    def to_json(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "tokens": self.tokens, "skip_padding": True}


def parse_selection(shards: Shards, layers: object, tokens: object) -> Selection:
    """Check ``layers`` (None, a layer value or a sequence of values) and ``tokens`` against the source."""
    md = shards.metadata
    recorded = md.layers
    if layers is None:
        chosen: tuple[object, ...] = tuple(recorded)
    elif is_int(layers, numpy_ok=True):
        chosen = (layers,)
    elif isinstance(layers, (list, tuple)):
        chosen = tuple(layers)
    else:
        raise ShuffleError(f"layers: expected None, a layer value or a list of them, found {layers!r}")
    if not chosen:
        raise ShuffleError(f"layers: expected at least one of the recorded layers {list(recorded)}, found none")
    values = []
    for layer in chosen:
        # (spelled out, not `is_int`: mypy narrows `layer` to an integer only from isinstance)
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or int(layer) not in recorded:
            raise ShuffleError(f"layers: expected values among the recorded layers {list(recorded)}, found {layer!r}")
        values.append(int(layer))
    if len(set(values)) != len(values):
        raise ShuffleError(f"layers: expected distinct values, found {values}")
    if tokens not in TOKEN_CHOICES:
        raise ShuffleError(f"tokens: expected one of {list(TOKEN_CHOICES)}, found {tokens!r}")
    if tokens == "cls" and not md.cls_token:
        raise ShuffleError(f"tokens='cls': expected a source with a CLS token, found cls_token=false at {shards.path}")
    positions_of_layers = tuple(sorted(recorded.index(v) for v in values))
    cls = int(md.cls_token)
    if tokens == "content":
        positions = tuple(range(cls, md.tokens_per_ex))
    elif tokens == "cls":
        positions = (0,)
    else:
        positions = tuple(range(md.tokens_per_ex))
    return Selection(
        layers=tuple(recorded[p] for p in positions_of_layers),
        tokens=str(tokens),
        layer_positions=positions_of_layers,
        positions=positions,
        has_lengths="lengths" in shards.manifest.columns,
    )


def per_token_columns(shards: Shards) -> dict[str, np.dtype[Any]]:
    """Source columns with one value per token position (shape ``(n_examples, T)``), by name.

    Their value at each chosen token is carried into the shuffled cache (``token_ids``).
    """
    md = shards.metadata
    return {
        name: np.dtype(entry.dtype)
        for name, entry in sorted(shards.manifest.columns.items())
        if tuple(entry.shape) == (md.n_examples, md.tokens_per_ex)
    }


class SourceReader:
    """Reads examples ``[start, stop)`` of the source: chosen layers, labels, lengths, columns."""

    def __init__(self, shards: Shards, selection: Selection) -> None:
        md = shards.metadata
        self.shards = shards
        self.selection = selection
        self.n_layers = len(selection.layer_positions)
        self.tokens_per_ex = md.tokens_per_ex
        self.d_model = md.d_model
        self.dtype = shards.numpy_dtype
        slice_nbytes = md.tokens_per_ex * md.d_model * md.itemsize
        #: Whole examples are read when every layer is chosen or slices are small.
        self.whole = self.n_layers == md.n_layers or slice_nbytes < MIN_SLICE_READ
        self.layer_positions = np.array(selection.layer_positions, dtype=np.int64)
        #: Bytes of one example as held in a read buffer.
        self.example_nbytes = (md.n_layers if self.whole else self.n_layers) * slice_nbytes

    def acts(self, start: int, stop: int, buffer: npt.NDArray[np.uint8]) -> npt.NDArray[Any]:
        """Examples ``[start, stop)`` as ``(n, rows, T, D)`` in ``buffer`` (all layers when
        read whole, else the chosen ones); `layer_rows` says which rows are the chosen layers."""
        n = stop - start
        rows = self.shards.metadata.n_layers if self.whole else self.n_layers
        out = buffer[: n * self.example_nbytes].view(self.dtype).reshape(n, rows, self.tokens_per_ex, self.d_model)
        # READ_THREADS parts read at once: this kind of disk serves more with several requests in flight.
        bounds = np.linspace(0, n, min(n, READ_THREADS) + 1).astype(np.int64).tolist()
        parts = list(itertools.pairwise(bounds))

        def read(part: tuple[int, int]) -> None:
            a, b = part
            if self.whole:
                self.shards.read_range(start + a, start + b, out[a:b])
            else:
                self._read_slices(start + a, start + b, out[a:b])

        with ThreadPoolExecutor(max(1, len(parts)), "saev-shuffle-source") as pool:
            list(pool.map(read, parts))
        return out

    def _read_slices(self, start: int, stop: int, out: npt.NDArray[Any]) -> None:
        """One ``pread`` per chosen ``(example, layer)`` slice, through descriptors of our own
        (`Shards.read_example` keeps its last output buffer referenced, which would pin a
        whole read buffer beyond the scatter pass)."""
        layers = self.shards.metadata.layers
        files = self.shards.files  # local descriptors, or a remote cache's verified reads
        fds: dict[int, int] = {}
        try:
            for j in range(stop - start):
                for r, position in enumerate(self.layer_positions.tolist()):
                    shard, offset = self.shards.locate(start + j, layers[position], 0)
                    fd = fds.get(shard)
                    if fd is None:
                        fd = fds[shard] = files.open(self.shards.manifest.shards[shard].name)
                    pread_exact(fd, out[j, r].reshape(-1).view(np.uint8).data, offset, files.preadv)
        finally:
            for fd in fds.values():
                files.close(fd)

    @property
    def layer_rows(self) -> npt.NDArray[np.int64]:
        """Rows of a read buffer's example that hold the chosen layers, in order."""
        return self.layer_positions if self.whole else np.arange(self.n_layers, dtype=np.int64)

    def _array(self, name: str, dtype: np.dtype[Any], tail: tuple[int, ...], start: int, stop: int) -> npt.NDArray[Any]:
        row = int(np.prod(tail, dtype=np.int64)) * dtype.itemsize
        out = np.empty((stop - start, *tail), dtype)
        if out.nbytes:
            files = self.shards.files
            fd = files.open(name)
            try:
                pread_exact(fd, out.reshape(-1).view(np.uint8).data, start * row, files.preadv)
            finally:
                files.close(fd)
        return out

    def lengths(self, start: int, stop: int) -> npt.NDArray[np.int64] | None:
        """The ``lengths`` column of examples ``[start, stop)`` (int64), or None without one."""
        entry = self.shards.manifest.columns.get("lengths")
        if entry is None:
            return None
        return self._array(entry.name, np.dtype(entry.dtype), (), start, stop).astype(np.int64)

    def labels(self, start: int, stop: int) -> npt.NDArray[np.uint8] | None:
        """``labels.bin`` rows ``(n, patches_per_ex)`` of examples ``[start, stop)``, or None."""
        entry = self.shards.manifest.labels
        if entry is None:
            return None
        return self._array(entry.name, np.dtype(np.uint8), (self.shards.metadata.patches_per_ex,), start, stop)

    def column(self, name: str, start: int, stop: int) -> npt.NDArray[Any]:
        """Per-token column ``name`` ``(n, T)`` of examples ``[start, stop)``."""
        entry = self.shards.manifest.columns[name]
        return self._array(entry.name, np.dtype(entry.dtype), (self.tokens_per_ex,), start, stop)

    def mask(self, lengths: npt.NDArray[np.int64] | None, n: int) -> npt.NDArray[np.bool_]:
        """``(n, T)``: the chosen positions of each example (padding removed)."""
        base = np.zeros(self.tokens_per_ex, dtype=bool)
        base[list(self.selection.positions)] = True
        if lengths is None:
            return np.broadcast_to(base, (n, self.tokens_per_ex))
        return base & (np.arange(self.tokens_per_ex) < lengths[:, None])

    def count(self, start: int, stop: int) -> int:
        """Chosen tokens of examples ``[start, stop)`` (one layer), reading only ``lengths``."""
        if not self.selection.has_lengths:
            return (stop - start) * self.selection.per_example
        positions = np.array(self.selection.positions, dtype=np.int64)
        total = 0
        for a in range(start, stop, SCAN_EXAMPLES):
            lengths = self.lengths(a, min(stop, a + SCAN_EXAMPLES))
            assert lengths is not None
            total += int(np.searchsorted(positions, lengths, side="left").sum())
        return total
