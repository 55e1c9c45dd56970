"""The records of a pickle shard, checked: a shard's layers (``layer_<idx>`` keys), each record's
activation ``(seq_len, hidden)`` and ``sample_idx``, and which ``metadata`` fields become
columns (one number per record) or text (`Fields`, decided from the first shard).
"""

from __future__ import annotations

import dataclasses
import numbers
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import ConvertError
from ..protocol.jsonfile import is_int, short_repr, type_name
from .base import Report, field_name

_LAYER_KEY = re.compile(r"layer_(-?\d+)", re.ASCII)  # int() would take any script's digits
#: Record keys with a meaning; others are reported as not carried over.
KNOWN_KEYS = frozenset(["sample_idx", "activation", "shape", "text_preview", "metadata"])


@dataclasses.dataclass(frozen=True)
class Fields:
    """Per-example streams decided from the first shard: numeric metadata -> columns, the rest -> text."""

    numeric: Mapping[str, tuple[str, np.dtype[Any]]]  # column name -> (metadata key, dtype)
    text: Mapping[str, str]  # text field name -> metadata key
    text_preview: bool


def layers_of(shard: Mapping[str, Any], where: Path) -> dict[int, list[Any]]:
    out: dict[int, list[Any]] = {}
    keys: dict[int, str] = {}
    for key, records in shard.items():
        m = _LAYER_KEY.fullmatch(key) if isinstance(key, str) else None
        if m is None:
            raise ConvertError(f"{where}: expected keys like 'layer_15', found {short_repr(key)}")
        # Digits counted before int(), which refuses strings of over 4,300 characters with a
        # ValueError of its own (leading zeros included); no number of 20 digits fits 64 bits.
        digits = m.group(1).lstrip("-").lstrip("0") or "0"
        layer = (-1 if m.group(1).startswith("-") else 1) * int(digits) if len(digits) <= 19 else 2**63
        if not -(2**63) <= layer < 2**63:
            raise ConvertError(f"{where}: {short_repr(key)}: the layer number does not fit 64 bits")
        if layer in keys:  # layer_1 and layer_01: one would silently replace the other
            raise ConvertError(f"{where}: keys {keys[layer]!r} and {key!r} name the same layer {layer}")
        if not isinstance(records, list):
            raise ConvertError(f"{where}: {key}: expected a list of records, found {type_name(records)}")
        keys[layer] = key
        out[layer] = records
    return dict(sorted(out.items()))


def activation(record: Any, where: str) -> npt.NDArray[Any]:
    if not isinstance(record, dict) or "activation" not in record:
        raise ConvertError(f"{where}: expected a record with an 'activation', found {type_name(record)}")
    act = record["activation"]
    if not isinstance(act, np.ndarray) or act.ndim != 2 or act.dtype.kind != "f":
        shape = getattr(act, "shape", None)
        raise ConvertError(
            f"{where}: expected 'activation' as a float array (seq_len, hidden), found "
            f"{type_name(act)} {getattr(act, 'dtype', '')} {shape if shape is not None else ''}".rstrip()
        )
    shape = record.get("shape")
    if shape is not None:
        if not (
            isinstance(shape, (list, tuple, np.ndarray))
            and len(shape) == 2
            and all(is_int(v, numpy_ok=True) for v in shape)
        ):
            raise ConvertError(
                f"{where}: expected 'shape' as two integers (seq_len, hidden), found {short_repr(shape)}"
            )
        if tuple(int(v) for v in shape) != act.shape:  # a truncated record: fewer rows than it says
            raise ConvertError(
                f"{where}: 'shape' says {tuple(int(v) for v in shape)} but the activation is {act.shape}"
            )
    return act


def seq_lens(records: list[Any], layer: int, where: Path) -> list[int]:
    return [activation(r, f"{where}: layer_{layer}[{j}]").shape[0] for j, r in enumerate(records)]


def sample_index(record: dict[str, Any], where: str) -> int:
    """A record's ``sample_idx``: an integer of 64 bits (an integral float is taken; a fractional one
    is an error, never truncated)."""
    value: Any = record.get("sample_idx")
    if isinstance(value, (float, np.floating)) and float(value).is_integer() and abs(float(value)) < 2**53:
        value = int(value)
    if not (is_int(value, numpy_ok=True) and -(2**63) <= int(value) < 2**63):
        raise ConvertError(f"{where}: expected 'sample_idx' as an integer of 64 bits, found {short_repr(value)}")
    return int(value)


def metadata_of(record: dict[Any, Any], where: str) -> dict[Any, Any]:
    meta = record.get("metadata")
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise ConvertError(f"{where}: expected 'metadata' as a dict, found {type_name(meta)}")
    return meta


def _is_number(v: Any) -> bool:
    return isinstance(v, (numbers.Real, np.number, np.bool_)) and not isinstance(v, (complex, np.complexfloating))


def _fits_int64(v: Any) -> bool:
    return not isinstance(v, (numbers.Integral, np.integer)) or -(2**63) <= int(v) < 2**63


def fields_of(shard: Mapping[int, list[Any]], report: Report, where: Path) -> Fields:
    """Columns and text fields from the first shard's records (first layer)."""
    layer, records = next(iter(shard.items()))
    keys: dict[str, list[Any]] = {}
    for j, r in enumerate(records):
        at = f"{where}: layer_{layer}[{j}]"
        if not isinstance(r, dict):
            raise ConvertError(f"{at}: expected a record (a dict), found {type_name(r)}")
        for k, v in metadata_of(r, at).items():
            if not isinstance(k, str):
                report.count(f"metadata values under keys that are not strings ({type_name(k)}) not carried over")
                continue
            keys.setdefault(k, []).append(v)
    numeric: dict[str, tuple[str, np.dtype[Any]]] = {}
    text: dict[str, str] = {}
    taken = {"sample_idx", "lengths", "true_lengths"}
    for key, values in keys.items():
        name = field_name(key)
        if name is None or name in taken:
            report.note(f"metadata field {short_repr(key)} not carried over (no usable column name)")
            continue
        bools = [isinstance(v, (bool, np.bool_)) for v in values]
        dt: np.dtype[Any] | None = None
        if len(values) != len(records) or not all(_is_number(v) and _fits_int64(v) for v in values):
            dt = None  # not one number per record: text
        elif all(bools):
            dt = np.dtype("|b1")
        elif any(bools):
            dt = None  # bools among numbers: kept as they are, as text
        elif all(isinstance(v, (numbers.Integral, np.integer)) for v in values):
            dt = np.dtype("<i8")
        else:
            dt = np.dtype("<f8")
        if dt is not None:
            numeric[name] = (key, dt)
        else:
            text[name] = key
        taken.add(name)
    preview = any("text_preview" in r for r in records)
    if preview and "text_preview" in text:
        report.note("metadata field 'text_preview' not carried over (the record's own text_preview is kept)")
        del text["text_preview"]
    extra = sorted({short_repr(k) for r in records for k in r if k not in KNOWN_KEYS})
    for k in extra:
        report.note(f"record key {k} not carried over (the pickle-shards format does not define it)")
    return Fields(numeric, text, preview)


def column_value(value: Any, dt: np.dtype[Any], key: str, where: str) -> Any:
    """``value`` as it goes into a column of ``dt`` (decided from the first shard); a value the
    column cannot hold exactly (a fraction in an integer column, a number in a bool column,
    an integer beyond 64 bits) is an error, never rounded."""
    is_bool = isinstance(value, (bool, np.bool_))
    ok = _is_number(value) and (
        (dt.kind == "b" and is_bool)
        or (dt.kind == "i" and not is_bool and isinstance(value, (numbers.Integral, np.integer)) and _fits_int64(value))
        or (dt.kind == "f" and not is_bool and _fits_int64(value))
    )
    if not ok:
        kind = {"b": "a bool", "i": "an integer of 64 bits", "f": "a number"}[dt.kind]
        raise ConvertError(
            f"{where}: expected {kind} for metadata field {short_repr(key)} (as in the first shard), "
            f"found {short_repr(value)}"
        )
    return bool(value) if dt.kind == "b" else value
