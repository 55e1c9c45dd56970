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
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import ConvertError, ConvertOptionError
from ..optional import require
from .base import Chunk, Options, Plan, Report, column_dtype, field_name, plain, stat_identity

KIND = "saelens"
_INFO = "dataset_info.json"
_STATE = "state.json"
_LAYER_IN_HOOK = re.compile(r"(?:^|\.)(?:blocks|layers?|h)\.(\d+)(?:\.|$)")
_ANY_INT = re.compile(r"(\d+)")


def _features(path: Path) -> dict[str, Any] | None:
    try:
        info = json.loads((path / _INFO).read_bytes())
    except (OSError, ValueError):
        return None
    features = info.get("features") if isinstance(info, dict) else None
    return features if isinstance(features, dict) else None


def detect(path: Path) -> bool:
    """A ``save_to_disk`` folder (dataset_info.json, state.json) with at least one Array2D column."""
    if not (path.is_dir() and (path / _STATE).is_file()):
        return False
    features = _features(path)
    return features is not None and any(isinstance(f, dict) and f.get("_type") == "Array2D" for f in features.values())


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
    plan: Plan
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
                report.count(
                    f"token positions beyond --max-tokens {tokens} dropped", dropped * (b - a) * len(self.hooks)
                )
            columns: dict[str, npt.NDArray[Any]] = {}
            for name, (col, tail) in self.columns.items():
                values = _numpy(part.column(col), b - a, tail)
                if name == "token_ids":
                    values = values[:, :tokens]
                columns[name] = np.ascontiguousarray(values, dtype=self.plan.columns[name][0])
            text = {name: [plain(v) for v in part.column(col).to_pylist()] for name, col in self.text_columns.items()}
            yield Chunk(acts, columns, text, source_nbytes=int(acts.nbytes))


def _shape_of(feature: Any) -> tuple[str, tuple[int, ...]] | None:
    """``(value dtype, tail shape)`` of a numeric feature (Value, fixed-length List/Sequence, ArrayND)."""
    if not isinstance(feature, dict):
        return None
    kind = feature.get("_type")
    if kind == "Value":
        return str(feature.get("dtype")), ()
    if kind in ("List", "Sequence") and isinstance(feature.get("length"), int) and feature["length"] >= 0:
        inner = _shape_of(feature.get("feature"))
        if inner is not None:
            return inner[0], (feature["length"], *inner[1])
    if isinstance(kind, str) and kind.startswith("Array") and isinstance(feature.get("shape"), list):
        return str(feature.get("dtype")), tuple(int(v) for v in feature["shape"])
    return None


def open_source(path: Path, options: Options, scan: Callable[[int, int], None] | None = None) -> SaelensSource:
    datasets = require("datasets", "convert", "converting SAELens caches")
    features = _features(path) or {}
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as err:  # datasets raises many kinds for a broken folder
        raise ConvertError(f"{path}: not a readable datasets folder ({type(err).__name__}: {err})") from None
    if not isinstance(ds, datasets.Dataset):
        raise ConvertError(f"{path}: expected one Dataset (save_to_disk of a Dataset), found {type(ds).__name__}")
    hooks = [name for name, f in features.items() if isinstance(f, dict) and f.get("_type") == "Array2D"]
    shapes = {tuple(features[h]["shape"]) for h in hooks}
    if len(shapes) != 1:
        raise ConvertError(f"{path}: the hooks {hooks} have different shapes {sorted(shapes)}; convert them separately")
    context_size, d_model = (int(v) for v in shapes.pop())
    for h in hooks:
        if np.dtype(features[h].get("dtype", "float32")).kind != "f":
            raise ConvertError(
                f"{path}: hook {h}: expected floating-point activations, found {features[h].get('dtype')}"
            )
    if options.layers is not None:
        if len(options.layers) != len(hooks):
            raise ConvertOptionError(
                f"--layers: expected {len(hooks)} layer numbers (one per hook: {hooks}), found {list(options.layers)}"
            )
        layers = options.layers
    else:
        parsed = [layer_of(h) for h in hooks]
        if any(v is None for v in parsed) or len(set(parsed)) != len(parsed):
            raise ConvertOptionError(
                f"{path}: cannot number the layers from the hook names {hooks} (found {parsed}); "
                "give them with --layers"
            )
        layers = tuple(int(v) for v in parsed if v is not None)
    tokens = min(context_size, options.max_tokens) if options.max_tokens is not None else context_size
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
            except TypeError:
                dt = None
        if name is None or shape is None or dt is None or name in col_types:
            notes.append(
                f"column {col!r} ({feature.get('_type') if isinstance(feature, dict) else feature}) not carried over"
            )
            continue
        tail = shape[1]
        if name == "token_ids" and tail == (context_size,):
            tail = (tokens,)
        columns[name] = (col, shape[1])
        col_types[name] = (dt, tail)
    cfg_file = path / "cache_activations_runner_cfg.json"
    cfg = plain(json.loads(cfg_file.read_bytes())) if cfg_file.is_file() else None
    state = json.loads((path / _STATE).read_bytes())
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
    plan = Plan(
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
