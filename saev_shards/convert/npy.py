"""A plain numpy ``.npy`` of shape ``(N, L, T, D)``, memory-mapped (never loaded whole).

Layers are ``0..L-1`` unless ``--layers`` names them; every token position is valid (no
``lengths`` column), ``--max-tokens`` keeps the first positions. A ``.npy`` carries no
checksum: its identity in the cache's ``data`` is its path, size and modification time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConvertError
from . import files
from .base import Chunk, Options, Report, SourcePlan, pick_layers, stat_identity

KIND = "npy"
_MAGIC = b"\x93NUMPY"


def detect(path: Path) -> bool:
    """A regular file starting with the ``.npy`` magic string."""
    try:
        with files.open_file(path) as f:
            return f.read(len(_MAGIC)) == _MAGIC
    except (OSError, ConvertError):
        return False


@dataclasses.dataclass
class NpySource:
    plan: SourcePlan
    array: np.memmap[Any, Any]

    def chunks(self, start: int, report: Report) -> Iterator[Chunk]:
        tokens = self.plan.tokens
        step = self.plan.chunk_examples
        dropped = self.array.shape[2] - tokens
        per_example = self.array[0].nbytes if len(self.array) else 0
        for a in range(start, self.plan.n_examples, step):
            b = min(self.plan.n_examples, a + step)
            # A C-ordered copy of just this chunk: the memmap is read once, sequentially. (A
            # file cut short since it was mapped raises SIGBUS; it is checked when opened.)
            block = np.ascontiguousarray(self.array[a:b, :, :tokens])
            if dropped > 0:
                report.count(
                    f"token positions beyond --max-tokens {tokens} dropped", dropped * (b - a) * block.shape[1]
                )
            yield Chunk(block, {}, {}, source_nbytes=(b - a) * per_example)


def open_source(path: Path, options: Options, scan: Callable[[int, int], None] | None = None) -> NpySource:
    files.open_file(path, "a .npy").close()  # a regular file: numpy opens it itself
    # The header is capped (numpy's max_header_size) and the memory map checks the file holds
    # what the header declares: nothing is allocated for the data. numpy raises several kinds
    # for a broken header (ValueError, OverflowError, EOFError, tokenize's TokenError...).
    with files.library_errors(path, ".npy of numbers"):
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    if array.ndim != 4:
        raise ConvertError(
            f"{path}: expected shape (N, L, T, D) = (examples, layers, tokens, d_model), found {array.shape}"
            + ("; add a layer axis first (np.expand_dims(a, 1))" if array.ndim == 3 else "")
            + (
                "; for token vectors (n_tokens, d_model), save them as examples of one layer: "
                "a.reshape(n_examples, 1, T, d_model) when every example has T tokens, else "
                "a[:, None, None, :] (one token per example)"
                if array.ndim == 2
                else ""
            )
        )
    if array.dtype.kind != "f":
        raise ConvertError(f"{path}: expected floating-point activations, found dtype {array.dtype}")
    n, n_layers, tokens_src, d_model = (int(v) for v in array.shape)
    layers = pick_layers(None, n_layers, options, f"axis 1 of {path.name}")
    tokens = min(tokens_src, options.max_tokens) if options.max_tokens is not None else tokens_src
    if tokens < 1:
        raise ConvertError(f"{path}: the token axis is empty (shape {array.shape})")
    layout = [
        f"axes (N, L, T, D) = {array.shape} {array.dtype}"
        + (" (Fortran order: each chunk is copied to C order)" if array.flags.f_contiguous and n_layers > 1 else ""),
        f"layers {list(layers)}" + (" (--layers)" if options.layers is not None else " (positions on axis 1)"),
        f"tokens: T={tokens}" + (f" (first {tokens} of {tokens_src}, --max-tokens)" if tokens < tokens_src else ""),
    ]
    plan = SourcePlan(
        kind=KIND,
        path=path,
        family=options.family or "unknown",
        ckpt=options.ckpt or "unknown",
        dataset=str(path),
        layers=layers,
        tokens=tokens,
        cls_token=options.cls_token,
        d_model=d_model,
        n_examples=n,
        source={
            "path": str(path),
            "shape": [n, n_layers, tokens_src, d_model],
            "dtype": array.dtype.str,
            "identity": stat_identity([path], path),
        },
        columns={},
        text=(),
        source_nbytes=int(array.nbytes),
        checksums="none: a .npy carries no checksum",
        layout=tuple(layout),
    )
    return NpySource(plan, array)
