"""SAELens activation caches: the Hugging Face ``datasets`` folder its cache runner saves.

SAELens' ``CacheActivationsRunner`` saves (``Dataset.save_to_disk``) one
``Array2D((context_size, d_in))`` column per hook, named by the hook
(``blocks.5.hook_resid_post``), and ``token_ids``, a fixed-length list of ``context_size``
int32 per row; ``dataset_info.json`` and ``state.json`` describe the ``data-*.arrow`` files.

Each row becomes an example of ``context_size`` tokens (or ``--max-tokens``), each hook a
layer numbered by the integer in its name (or ``--layers``, in column order), ``token_ids``
a column, other numeric columns columns and string columns text. Rows are read straight
from the memory-mapped Arrow tables, one chunk at a time.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import ConvertError, ConvertOptionError
from ..optional import require
from ..protocol.jsonfile import is_int, short_repr
from . import files
from .base import Chunk, Options, Report, SourcePlan, column_dtype, field_name, plain, stat_identity

KIND = "saelens"
_INFO = "dataset_info.json"
_STATE = "state.json"
_LAYER_IN_HOOK = re.compile(r"(?:^|\.)(?:blocks|layers?|h)\.(\d+)(?:\.|$)")
_ANY_INT = re.compile(r"(\d+)")


def _features(path: Path) -> dict[str, Any] | None:
    info = files.read_json(path / _INFO, "the dataset's features")
    features = info.get("features") if isinstance(info, dict) else None
    return features if isinstance(features, dict) else None


def detect(path: Path) -> bool:
    """A ``save_to_disk`` folder (dataset_info.json, state.json) with at least one Array2D column."""
    if not (files.is_dir(path) and files.is_file(path / _STATE)):
        return False
    try:
        features = _features(path)
    except ConvertError:
        return False
    return features is not None and any(isinstance(f, dict) and f.get("_type") == "Array2D" for f in features.values())


def _hook_shape(path: Path, hook: str, feature: dict[str, Any]) -> tuple[int, int]:
    """``(context_size, d_in)`` of a hook's Array2D feature, checked before anything is allocated."""
    shape = feature.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(is_int(v) and 1 <= v < 2**31 for v in shape)):
        raise ConvertError(
            f"{path / _INFO}: features.{hook}.shape: expected two positive integers (context_size, d_in), "
            f"found {short_repr(shape)}"
        )
    return int(shape[0]), int(shape[1])


def _float_dtype(path: Path, hook: str, feature: dict[str, Any]) -> np.dtype[Any]:
    name = feature.get("dtype", "float32")
    try:
        dtype = np.dtype(name) if isinstance(name, str) and len(name) <= 32 else None
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind != "f":
        raise ConvertError(f"{path}: hook {hook}: expected floating-point activations, found {short_repr(name)}")
    return dtype


def layer_of(hook: str) -> int | None:
    """The layer number in a hook name: ``blocks.5.hook_resid_post`` -> 5; None if it has none."""
    m = _LAYER_IN_HOOK.search(hook) or _ANY_INT.search(hook)
    return int(m.group(1)) if m else None


def _numpy(column: Any, rows: int, tail: tuple[int, ...]) -> npt.NDArray[Any]:
    """A pyarrow (extension or list) column slice as a numpy array ``(rows, *tail)``, without Python loops."""
    import pyarrow as pa

    pieces = []
    for chunk in column.chunks:
        arr = chunk.storage if isinstance(chunk, pa.ExtensionArray) else chunk
        while pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type) or pa.types.is_fixed_size_list(arr.type):
            arr = arr.flatten()
        pieces.append(arr.to_numpy(zero_copy_only=False))
    flat = np.concatenate(pieces) if len(pieces) != 1 else pieces[0]
    return flat.reshape(rows, *tail)


@dataclasses.dataclass
class SaelensSource:
    plan: SourcePlan
    table: Any  # pyarrow Table (memory-mapped)
    hooks: list[str]
    context_size: int
    columns: dict[str, tuple[str, tuple[int, ...]]]  # column name -> (dataset column, tail shape)
    text_columns: dict[str, str]

    def chunks(self, start: int, report: Report) -> Iterator[Chunk]:
        tokens = self.plan.tokens
        d_model = self.plan.d_model
        step = self.plan.chunk_examples
        dropped = self.context_size - tokens
        for a in range(start, self.plan.n_examples, step):
            b = min(self.plan.n_examples, a + step)
            with files.library_errors(self.plan.path, "datasets folder"):
                chunk = self._chunk(a, b, tokens, d_model, dropped, report)
            yield chunk

    def _chunk(self, a: int, b: int, tokens: int, d_model: int, dropped: int, report: Report) -> Chunk:
        part = self.table.slice(a, b - a)
        acts: npt.NDArray[Any] | None = None
        for li, hook in enumerate(self.hooks):
            # A zero-copy view of the memory-mapped Arrow buffer, copied once into place.
            values = _numpy(part.column(hook), b - a, (self.context_size, d_model))[:, :tokens]
            if acts is None:
                acts = np.empty((b - a, len(self.hooks), tokens, d_model), values.dtype)  # (B, L, T, D)
            acts[:, li] = values
        assert acts is not None
        if dropped > 0:
            report.count(f"token positions beyond --max-tokens {tokens} dropped", dropped * (b - a) * len(self.hooks))
        columns: dict[str, npt.NDArray[Any]] = {}
        for name, (col, tail) in self.columns.items():
            values = _numpy(part.column(col), b - a, tail)
            if name == "token_ids":
                values = values[:, :tokens]
            columns[name] = np.ascontiguousarray(values, dtype=self.plan.columns[name][0])
        text = {name: [plain(v) for v in part.column(col).to_pylist()] for name, col in self.text_columns.items()}
        return Chunk(acts, columns, text, source_nbytes=int(acts.nbytes))


def _check_held(path: Path, table: Any, hook: str, declared: int) -> None:
    """Refuse a column (a hook's, or another numeric one) that holds fewer bytes than its rows
    and shape declare (the Arrow buffers' own sizes; nothing is read), before anything is
    allocated for it."""
    try:
        held = int(table.column(hook).nbytes)
    except KeyError:
        raise ConvertError(f"{path}: features list {short_repr(hook)}, the Arrow tables have no such column") from None
    if held < declared:
        raise ConvertError(
            f"{path}: column {short_repr(hook)}: its rows and shape declare {declared:,} bytes, the Arrow files "
            f"hold {held:,}: the folder declares more than it holds; nothing was written"
        )


#: Most values one row of a column may hold (a tail shape beyond it is not carried over).
_MAX_ROW_VALUES = 1 << 24


def _shape_of(feature: Any, depth: int = 0) -> tuple[str, tuple[int, ...]] | None:
    """``(value dtype, tail shape)`` of a numeric feature (Value, fixed-length List/Sequence, ArrayND);
    None for anything else, a shape that is not small non-negative integers included."""
    if not isinstance(feature, dict) or depth > 8:
        return None
    kind = feature.get("_type")
    dtype = feature.get("dtype")
    out: tuple[str, tuple[int, ...]] | None = None
    if kind == "Value" and isinstance(dtype, str):
        out = dtype, ()
    elif kind in ("List", "Sequence") and is_int(feature.get("length")) and 0 <= feature["length"] < 2**31:
        inner = _shape_of(feature.get("feature"), depth + 1)
        if inner is not None:
            out = inner[0], (feature["length"], *inner[1])
    elif isinstance(kind, str) and kind.startswith("Array") and isinstance(dtype, str):
        shape = feature.get("shape")
        if isinstance(shape, list) and len(shape) <= 8 and all(is_int(v) and 0 <= v < 2**31 for v in shape):
            out = dtype, tuple(int(v) for v in shape)
    if out is None or math.prod(out[1]) > _MAX_ROW_VALUES or len(out[0]) > 32:
        return None
    return out


def open_source(path: Path, options: Options, scan: Callable[[int, int], None] | None = None) -> SaelensSource:
    datasets = require("datasets", "convert", "converting SAELens caches")
    features = _features(path) or {}
    # datasets opens (and memory-maps) the files itself: everything must be a regular file first.
    files.check_tree(path, "in a datasets folder", {_INFO: files.MAX_JSON_BYTES, _STATE: files.MAX_JSON_BYTES})
    with files.library_errors(path, "datasets folder"):
        ds = datasets.load_from_disk(str(path))
        # pyarrow maps the IPC files without checking their buffers: a damaged offset or
        # length would read out of bounds (a crash, not an error). Full validation checks
        # every offset and length against its buffer (the activations are not read).
        ds.data.table.validate(full=True)
    if not isinstance(ds, datasets.Dataset):
        raise ConvertError(f"{path}: expected one Dataset (save_to_disk of a Dataset), found {type(ds).__name__}")
    hooks = [name for name, f in features.items() if isinstance(f, dict) and f.get("_type") == "Array2D"]
    if not hooks:
        raise ConvertError(f"{path / _INFO}: no Array2D feature: no hook's activations to convert")
    shapes = {_hook_shape(path, h, features[h]) for h in hooks}
    if len(shapes) != 1:
        raise ConvertError(f"{path}: the hooks {hooks} have different shapes {sorted(shapes)}; convert them separately")
    context_size, d_model = shapes.pop()
    for h in hooks:
        dtype = _float_dtype(path, h, features[h])
        _check_held(path, ds.data, h, len(ds) * context_size * d_model * dtype.itemsize)
    layers = _layers(path, hooks, options)
    tokens = min(context_size, options.max_tokens) if options.max_tokens is not None else context_size
    columns, col_types, text_columns, notes = _columns(path, ds, features, hooks, (context_size, tokens))
    cfg_file = path / "cache_activations_runner_cfg.json"
    has_cfg = os.path.lexists(cfg_file)
    cfg = plain(files.read_json(cfg_file, "the cache runner's configuration")) if has_cfg else None
    state = files.read_json(path / _STATE, "the dataset's state")
    arrow = sorted(path.glob("*.arrow"))
    layout = [
        f"hooks {hooks} -> layers {list(layers)}"
        + (" (--layers)" if options.layers is not None else " (from the hook names)"),
        f"rows -> examples of T={tokens} tokens"
        + (
            f" (first {tokens} of context_size {context_size}, --max-tokens)"
            if tokens < context_size
            else " (context_size)"
        ),
    ]
    if col_types:
        layout.append("columns: " + ", ".join(col_types))
    if text_columns:
        layout.append("text: " + ", ".join(text_columns))
    model = cfg.get("model_name") if isinstance(cfg, dict) else None
    plan = SourcePlan(
        kind=KIND,
        path=path,
        family=options.family or "unknown",
        ckpt=options.ckpt or str(model or "unknown"),
        dataset=str((cfg or {}).get("dataset_path") or path) if isinstance(cfg, dict) else str(path),
        layers=layers,
        tokens=tokens,
        cls_token=options.cls_token,
        d_model=d_model,
        n_examples=len(ds),
        source={
            "path": str(path),
            "features": plain(features),
            "fingerprint": state.get("_fingerprint") if isinstance(state, dict) else None,
            "runner_config": cfg,
            "identity": stat_identity(arrow, path),
        },
        columns=col_types,
        text=tuple(text_columns),
        source_nbytes=sum(p.stat().st_size for p in arrow),
        checksums="none: a datasets folder carries no checksums",
        layout=tuple(layout),
        notes=tuple(notes),
    )
    return SaelensSource(plan, ds.data, hooks, context_size, columns, text_columns)


def _layers(path: Path, hooks: list[str], options: Options) -> tuple[int, ...]:
    """The layer number of each hook: ``--layers``, else from the hook names."""
    if options.layers is not None:
        if len(options.layers) != len(hooks):
            raise ConvertOptionError(
                f"--layers: expected {len(hooks)} layer numbers (one per hook: {hooks}), found {list(options.layers)}"
            )
        return options.layers
    parsed = [layer_of(h) for h in hooks]
    if any(v is None for v in parsed) or len(set(parsed)) != len(parsed):
        raise ConvertOptionError(
            f"{path}: cannot number the layers from the hook names {hooks} (found {parsed}); give them with --layers"
        )
    return tuple(int(v) for v in parsed if v is not None)


def _columns(
    path: Path, ds: Any, features: dict[str, Any], hooks: list[str], sizes: tuple[int, int]
) -> tuple[
    dict[str, tuple[str, tuple[int, ...]]], dict[str, tuple[np.dtype[Any], tuple[int, ...]]], dict[str, str], list[str]
]:
    """The features other than the hooks: numeric ones as columns (name -> feature and shape, and
    the cache's column types), strings as text, and notes on the rest. ``sizes``: the context
    size and the tokens kept (a ``token_ids`` column of one id per position is cut as they are)."""
    context_size, tokens = sizes
    columns: dict[str, tuple[str, tuple[int, ...]]] = {}
    col_types: dict[str, tuple[np.dtype[Any], tuple[int, ...]]] = {}
    text_columns: dict[str, str] = {}
    notes = []
    for col, feature in features.items():
        if col in hooks:
            continue
        name = field_name(col)
        shape = _shape_of(feature)
        if name is not None and shape is not None and shape[0] in ("string", "large_string") and not shape[1]:
            text_columns[name] = col
            continue
        dt = None
        if shape is not None:
            try:
                dt = column_dtype(np.dtype(shape[0]))
            except (TypeError, ValueError):
                dt = None
        if name is None or shape is None or dt is None or name in col_types:
            notes.append(
                f"column {col!r} ({feature.get('_type') if isinstance(feature, dict) else feature}) not carried over"
            )
            continue
        _check_held(path, ds.data, col, len(ds) * math.prod(shape[1]) * np.dtype(shape[0]).itemsize)
        tail = shape[1]
        if name == "token_ids" and tail == (context_size,):
            tail = (tokens,)
        columns[name] = (col, shape[1])
        col_types[name] = (dt, tail)
    return columns, col_types, text_columns, notes
