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

from .. import token_masks
from ..errors import ShuffleError
from ..fileio import pread_exact
from ..protocol.common import FLOAT8
from ..protocol.jsonfile import is_int
from ..reader import Shards, norms

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
    #: Token masks (as the loaders'): positions whose ``token_ids`` value is listed are left out ...
    exclude_token_ids: tuple[int, ...] = ()
    #: ... and those `saev_shards.reader.norms` drops above ``max_norm_multiple`` times the median norm.
    norm_filter: norms.NormFilter | None = dataclasses.field(default=None, compare=False)
    #: The source's recorded layers.
    recorded: tuple[int, ...] = ()

    @property
    def per_example(self) -> int:
        """Chosen tokens of an example without padding."""
        return len(self.positions)

    @property
    def varies(self) -> bool:
        """Whether the chosen positions differ from example to example."""
        return self.has_lengths or bool(self.exclude_token_ids) or self.norm_filter is not None

    def to_json(self) -> dict[str, Any]:
        """The selection as the output's metadata records it; the token masks only when set,
        so a shuffle without them keeps the metadata (and hash) it always had."""
        out: dict[str, Any] = {"layers": list(self.layers), "tokens": self.tokens, "skip_padding": True}
        if self.exclude_token_ids:
            out["exclude_token_ids"] = list(self.exclude_token_ids)
        if self.norm_filter is not None:
            out["max_norm_multiple"] = norms.to_json(self.norm_filter, self.all_layers)
        return out

    @property
    def all_layers(self) -> tuple[int, ...]:
        """The source's recorded layers (a norm filter's positions index them)."""
        return self.recorded


def parse_selection(
    shards: Shards,
    layers: object,
    tokens: object,
    exclude_token_ids: object = (),
    max_norm_multiple: object = None,
    progress: bool | None = False,
) -> Selection:
    """Check ``layers`` (None, a layer value or a sequence of values), ``tokens`` and the token
    masks against the source (a norm filter is computed here: `saev_shards.reader.norms`)."""
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
    excluded = tuple(token_masks.parse_exclude_token_ids(exclude_token_ids, ShuffleError).tolist())
    if excluded:
        if "token_ids" not in shards.manifest.columns:
            raise ShuffleError(
                f"exclude_token_ids: expected a source with a token_ids column (saev-shards dump records it), found "
                f"columns {sorted(shards.manifest.columns)} at {shards.path}"
            )
        problem = token_masks.token_ids_problem(shards)
        if problem is not None:
            raise ShuffleError(problem)
    multiple = norms.parse_multiple(max_norm_multiple, ShuffleError)
    return Selection(
        layers=tuple(recorded[p] for p in positions_of_layers),
        tokens=str(tokens),
        layer_positions=positions_of_layers,
        positions=positions,
        has_lengths="lengths" in shards.manifest.columns,
        exclude_token_ids=excluded,
        norm_filter=None
        if multiple is None
        else norms.norm_filter(shards, multiple, positions_of_layers, progress=progress),
        recorded=tuple(recorded),
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
        #: A float8_e4m3 source: bytes of one example's scales as read beside it (else 0).
        self.float8 = md.dtype == FLOAT8
        self.scales_nbytes = (md.n_layers if self.whole else self.n_layers) * md.tokens_per_ex * 4 if self.float8 else 0

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

    def scales(self, start: int, stop: int) -> npt.NDArray[np.float32] | None:
        """A float8_e4m3 source's scales of examples ``[start, stop)`` as ``(n, rows, T)``, rows as
        in `acts`; None for another dtype."""
        if not self.float8:
            return None
        if self.whole:
            return self.shards.read_range_scales(start, stop)
        md = self.shards.metadata
        out = np.empty((stop - start, self.n_layers, md.tokens_per_ex), np.float32)
        for j in range(stop - start):
            for r, position in enumerate(self.layer_positions.tolist()):
                self.shards.read_example_scales(start + j, position, out[j, r])
        return out

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

    def mask(self, lengths: npt.NDArray[np.int64] | None, n: int, start: int = 0) -> npt.NDArray[np.bool_]:
        """``(n, T)``: the chosen positions of examples ``[start, start + n)`` (padding and what
        the token masks drop removed)."""
        return self._masks(lengths, n, start)[0]

    def _masks(
        self, lengths: npt.NDArray[np.int64] | None, n: int, start: int
    ) -> tuple[npt.NDArray[np.bool_], dict[str, int]]:
        """The chosen positions, and how many positions each token mask took from the rest."""
        sel = self.selection
        base = np.zeros(self.tokens_per_ex, dtype=bool)
        base[list(sel.positions)] = True
        mask = np.broadcast_to(base, (n, self.tokens_per_ex))
        if lengths is not None:
            mask = base & (np.arange(self.tokens_per_ex) < lengths[:, None])
        taken: dict[str, int] = {}
        if sel.exclude_token_ids:
            hit = mask & np.isin(self.column("token_ids", start, start + n), sel.exclude_token_ids)
            taken["exclude_token_ids"] = int(hit.sum())
            mask = mask & ~hit
        if sel.norm_filter is not None:
            hit = mask & sel.norm_filter.dropped(np.arange(start, start + n, dtype=np.int64))
            taken["max_norm_multiple"] = int(hit.sum())
            mask = mask & ~hit
        return mask, taken

    def count(self, start: int, stop: int) -> int:
        """Chosen tokens of examples ``[start, stop)`` (one layer), reading only ``lengths``
        (and ``token_ids`` with `exclude_token_ids`)."""
        return self.count_and_dropped(start, stop)[0]

    def count_and_dropped(self, start: int, stop: int) -> tuple[int, dict[str, int]]:
        """`count`, and the positions each token mask dropped from examples ``[start, stop)``."""
        sel = self.selection
        if not sel.varies:
            return (stop - start) * sel.per_example, {}
        positions = np.array(sel.positions, dtype=np.int64)
        total = 0
        dropped: dict[str, int] = {}
        for a in range(start, stop, SCAN_EXAMPLES):
            b = min(stop, a + SCAN_EXAMPLES)
            lengths = self.lengths(a, b)
            if not (sel.exclude_token_ids or sel.norm_filter is not None):
                assert lengths is not None
                total += int(np.searchsorted(positions, lengths, side="left").sum())
                continue
            mask, taken = self._masks(lengths, b - a, a)
            total += int(mask.sum())
            for name, k in taken.items():
                dropped[name] = dropped.get(name, 0) + k
        return total, dropped
