"""Zarr activation logs (the zarr activation logger's format), read with the ``zarr`` library (zarr v2 or v3 stores).

Layouts: one store ``activations.zarr/`` (or the folder holding it), or a run folder with
``shards/shard-XXXX.zarr`` (+ ``manifest.json``), read shard after shard in number order,
each shard's own arrays giving its sample count. In a store, the arrays live under
``arrays/`` (or at the top): either ``prompt_activations`` ``(N, L, P_max, H)`` and/or
``response_activations`` ``(N, L, R_max, H)`` with ``prompt_len``/``response_len``, or
``activations`` ``(N, L, T_max, H)`` with ``seq_len``.

Prompt and response become ONE cache whose examples are the sequences the model saw:
example ``i``'s tokens are its ``prompt_len[i]`` prompt tokens, then its
``response_len[i]`` response tokens, then zeros; ``T = P_max + R_max`` (or
``--max-tokens``), ``lengths = prompt_len + response_len``, and the columns
``prompt_len`` and ``response_len`` say where the response starts. Padding stored between
the two parts is dropped (counted when it is not zero). Every other per-sample numeric
array becomes a column, ``sample_key`` and other byte or string arrays become text
fields, and each ``text/*.jsonl`` and ``meta/*.jsonl`` file becomes a text field holding
each line's JSON object, placed by its ``"i"`` (else by line number).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import ConvertError, JSONFileError
from ..optional import require
from ..protocol.jsonfile import is_int, short_repr, strict_json_loads
from . import files
from .base import (
    Chunk,
    Options,
    Report,
    SourcePlan,
    column_dtype,
    field_name,
    pick_layers,
    plain,
    stat_identity,
)
from .zarr_store import (
    METADATA_NAMES,
    Part,
    Store,
    check_chunks,
    check_codecs,
    check_held,
    find_stores,
    open_arrays,
    schema,
)

KIND = "zarr"


def detect(path: Path) -> bool:
    """A zarr group (or a folder with ``activations.zarr`` or ``shards/shard-XXXX.zarr``) with activation arrays."""
    if not path.is_dir():
        return False
    _, stores = find_stores(path)
    if not stores:
        return False
    first = stores[0]
    names = ("prompt_activations", "response_activations", "activations")
    return any((first / "arrays" / n).is_dir() or (first / n).is_dir() for n in names)


def _text_files(store: Path) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for folder in ("text", "meta"):
        for p in sorted((store / folder).glob("*.jsonl")) if (store / folder).is_dir() else []:
            name = field_name(p.stem)
            if name is None:
                continue
            if name in out:
                name = field_name(f"{folder}_{p.stem}")
            if name is not None and name not in out:
                out[name] = p
    return out


def _line_index(path: Path, n: int, offset: int) -> npt.NDArray[np.int64]:
    """Byte offset of each sample's line (-1: no line): placed by ``"i"`` when lines have it
    (then every line must: an integer, not a fraction, never guessed), else by line number."""
    starts: list[int] = []
    keys: list[int] = []
    placed: bool | None = None  # whether lines carry "i" (decided by the first line)
    pos = 0
    number = 0
    with files.open_lines(path, "a text file of the store") as f:
        while line := files.read_line(f, path, number + 1):
            number += 1
            if line.strip():
                obj = _json_line(line, path, number)
                has_i = isinstance(obj, dict) and "i" in obj
                if placed is None:
                    placed = has_i
                elif has_i != placed:
                    raise ConvertError(
                        f"{path}: line {number} {'has' if has_i else 'has no'} 'i' where line {starts and 1} "
                        f"{'does not' if has_i else 'does'}: samples cannot be placed"
                    )
                if placed:
                    i = obj["i"]
                    if not (is_int(i) and -(2**63) <= i < 2**63):
                        raise ConvertError(f"{path}: line {number}: expected 'i' as an integer, found {short_repr(i)}")
                    keys.append(i)
                starts.append(pos)
                if len(starts) > n:
                    raise ConvertError(f"{path}: expected at most {n} lines (one per sample), found more")
            pos += len(line)
    index = np.full(n, -1, np.int64)
    if placed:
        ids = np.asarray(keys, np.int64)
        if ids.min() >= 0 and ids.max() < n:
            pass  # local indices
        elif ids.min() >= offset and ids.max() < offset + n:
            ids = ids - offset  # global indices of a sharded run
        else:
            raise ConvertError(f"{path}: expected 'i' values in [0, {n}), found {int(ids.min())}..{int(ids.max())}")
        if len(np.unique(ids)) != len(ids):
            raise ConvertError(f"{path}: repeated 'i' values")
        index[ids] = starts
    else:
        index[: len(starts)] = starts
    return index


def _json_line(line: bytes, path: Path, number: int) -> Any:
    """One line of a JSON Lines file, parsed by the strict loader of caches (it becomes cache text)."""
    try:
        return strict_json_loads(line.strip())
    except JSONFileError as err:
        raise ConvertError(f"{path}: line {number}: {err}") from None


@dataclasses.dataclass
class ZarrSource:
    plan: SourcePlan
    stores: list[Store]
    parts: list[Part]
    columns: dict[str, str]  # column name -> array name
    text_arrays: dict[str, str]  # text field -> byte/string array name
    text_files: list[dict[str, Path]]  # per store: text field -> jsonl file

    def chunks(self, start: int, report: Report) -> Iterator[Chunk]:
        for k, store in enumerate(self.stores):
            if store.offset + store.n <= start:
                continue
            indexes = {name: _line_index(p, store.n, store.offset) for name, p in self.text_files[k].items()}
            for name, index in indexes.items():
                report.count(f"samples without a line in {name}.jsonl (stored as null)", int((index < 0).sum()))
            for name in self.plan.text:
                if name not in self.text_arrays and name not in indexes:
                    report.count(f"samples without a {name} text file in their shard (stored as null)", store.n)
            step = self.plan.chunk_examples
            for a in range(max(0, start - store.offset), store.n, step):
                b = min(store.n, a + step)
                with _reading(store.path):
                    chunk = self._chunk(store, a, b, indexes, k, report)
                yield chunk

    def _chunk(
        self, store: Store, a: int, b: int, indexes: dict[str, npt.NDArray[np.int64]], k: int, report: Report
    ) -> Chunk:
        tokens = self.plan.tokens
        count = b - a
        blocks = [store.arrays[p.activations][a:b] for p in self.parts]
        lens = []
        for p in self.parts:
            if p.lengths is None:
                lens.append(np.full(count, p.max_len, np.int64))
                continue
            raw = np.asarray(store.arrays[p.lengths][a:b]).astype(np.int64)
            over = raw > p.max_len
            if over.any():
                report.count(f"{p.lengths} values above their array's {p.max_len} positions (capped)", int(over.sum()))
            if (raw < 0).any():
                raise ConvertError(f"{store.path}: {p.lengths}[{a}:{b}] holds negative lengths")
            lens.append(np.minimum(raw, p.max_len))
        dtype = np.result_type(*(blk.dtype for blk in blocks))
        n_layers, d_model = self.plan.layers, self.plan.d_model
        acts = np.zeros((count, len(n_layers), tokens, d_model), dtype)
        total = np.zeros(count, np.int64)
        for j in range(count):
            pos = 0
            for p, block, length in zip(self.parts, blocks, lens, strict=True):
                n = int(length[j])
                keep = max(0, min(n, tokens - pos))
                if keep:
                    acts[j, :, pos : pos + keep] = block[j, :, :keep]
                if n < p.max_len and np.any(block[j, :, n:]):
                    report.count(f"samples with nonzero values in {p.name} padding (dropped)")
                pos += n
            total[j] = pos
        lengths = np.minimum(total, tokens).astype(np.int32)
        cut = total > tokens
        if cut.any():
            report.count(f"samples longer than T={tokens} truncated", int(cut.sum()))
            report.count("token positions dropped by that truncation", int((total - lengths).sum()))
        columns: dict[str, npt.NDArray[Any]] = {"lengths": lengths, "true_lengths": total.astype(np.int32)}
        for p, length in zip(self.parts, lens, strict=True):
            if p.lengths is not None:
                columns[p.lengths] = length.astype(self.plan.columns[p.lengths][0])
        for name, array in self.columns.items():
            columns[name] = np.asarray(store.arrays[array][a:b]).astype(self.plan.columns[name][0])
        text: dict[str, list[Any]] = {}
        for name, array in self.text_arrays.items():
            values = np.asarray(store.arrays[array][a:b])
            text[name] = [_decode(v) for v in values.tolist()]
        for name in self.plan.text:
            if name in self.text_arrays:
                continue
            index = indexes.get(name)
            text[name] = _lines(self.text_files[k].get(name), index, a, b)
        nbytes = sum(int(blk.nbytes) for blk in blocks)
        return Chunk(acts, columns, text, source_nbytes=nbytes)


def _decode(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.rstrip(b"\x00").decode("utf-8", "replace")
    return plain(value)


def _lines(path: Path | None, index: npt.NDArray[np.int64] | None, a: int, b: int) -> list[Any]:
    if path is None or index is None:
        return [None] * (b - a)
    out: list[Any] = []
    with files.open_lines(path, "a text file of the store") as f:
        for off in index[a:b].tolist():
            if off < 0:
                out.append(None)
                continue
            f.seek(off)
            out.append(_json_line(files.read_line(f, path, 0), path, 0))
    return out


def _reading(where: Path) -> contextlib.AbstractContextManager[None]:
    return files.library_errors(where, "zarr store")


def open_source(path: Path, options: Options, scan: Callable[[int, int], None] | None = None) -> ZarrSource:
    zarr = require("zarr", "convert", "converting zarr activation logs")
    with warnings.catch_warnings(), _reading(path):
        # The logger keeps text/ and meta/ folders (JSON Lines) inside the store, on purpose.
        warnings.filterwarnings("ignore", message=".*not recognized as a component of a Zarr hierarchy")
        return _open(zarr, path, options)


def _open(zarr: Any, path: Path, options: Options) -> ZarrSource:
    layout, paths = find_stores(path)
    if not paths:
        raise ConvertError(f"{path}: expected a zarr group, activations.zarr/ or shards/shard-XXXX.zarr")
    stores, parts, attrs = _open_stores(zarr, paths, options)
    n_layers, d_model = _check_shapes(stores, parts)
    fields = _per_sample(stores, parts, options)
    text_files = [_text_files(s.path) for s in stores]
    text_names = list(fields.text_arrays)
    for found_files in text_files:
        text_names += [n for n in found_files if n not in text_names]
    total = sum(p.max_len for p in parts)
    tokens = min(total, options.max_tokens) if options.max_tokens is not None else total
    found_layers = _attrs_layers(attrs, n_layers, options, paths[0])
    layers = pick_layers(found_layers, n_layers, options, "the store")
    n_examples = sum(s.n for s in stores)
    notes = [
        *fields.notes,
        *(f"no {p.name}_len array: every {p.name} position is taken as valid" for p in parts if p.lengths is None),
    ]
    named = " (--layers)" if options.layers else " (attrs)" if found_layers else " (positions)"
    mapping = [
        *_parts_lines(parts, total, tokens),
        f"layers {list(layers)}{named}",
        f"one store, {n_examples:,} samples"
        if layout == "store"
        else f"sharded: {len(stores)} stores, {n_examples:,} samples",
    ]
    cols_shown = [c for c in fields.types if c not in ("lengths", "true_lengths")]
    if cols_shown:
        mapping.append("columns: " + ", ".join(cols_shown))
    if text_names:
        mapping.append("text: " + ", ".join(text_names))
    plan = SourcePlan(
        kind=KIND,
        path=path,
        family=options.family or str(attrs.get("model_family") or attrs.get("family") or "unknown"),
        ckpt=options.ckpt or str(attrs.get("model_id") or attrs.get("model") or "unknown"),
        dataset=str(attrs.get("dataset") or attrs.get("dataset_name") or path),
        layers=layers,
        tokens=tokens,
        cls_token=options.cls_token,
        d_model=d_model,
        n_examples=n_examples,
        source=_description(path, layout, stores, parts, attrs, fields),
        columns=fields.types,
        text=tuple(text_names),
        source_nbytes=sum(int(s.arrays[p.activations].nbytes) for s in stores for p in parts),
        checksums="none: zarr stores carry no checksums",
        layout=tuple(mapping),
        notes=tuple(notes),
    )
    return ZarrSource(plan, stores, parts, fields.columns, fields.text_arrays, text_files)


def _open_stores(zarr: Any, paths: list[Path], options: Options) -> tuple[list[Store], list[Part], dict[str, Any]]:
    """Every store opened and checked (the same arrays as the first, one row per sample, chunks that
    fit the memory allowed and that hold what they declare); the parts and the first store's attrs."""
    stores: list[Store] = []
    parts: list[Part] | None = None
    attrs: dict[str, Any] = {}
    offset = 0
    for store_path in paths:
        # zarr opens the files itself: everything in the store must be a regular file first.
        files.check_tree(store_path, "in a zarr store", {name: files.MAX_JSON_BYTES for name in METADATA_NAMES})
        arrays, group = open_arrays(zarr, store_path)
        these = schema(arrays, store_path)
        if parts is None:
            parts = these
            attrs = plain(dict(group.attrs))
        elif [(p.name, p.max_len, p.lengths is not None) for p in these] != [
            (p.name, p.max_len, p.lengths is not None) for p in parts
        ]:
            raise ConvertError(f"{store_path}: its arrays differ from the first shard's ({paths[0]})")
        n = int(arrays[these[0].activations].shape[0])
        for p in these:
            for name in (p.activations, p.lengths):
                if name is not None and int(arrays[name].shape[0]) != n:
                    raise ConvertError(f"{store_path}: {name} holds {arrays[name].shape[0]} samples, expected {n}")
                if name is not None:
                    check_chunks(arrays[name], name, store_path, options.memory // 2)
                    check_codecs(store_path, name, arrays[name], options.memory // 2)
            if p.lengths is not None and (
                len(arrays[p.lengths].shape) != 1 or arrays[p.lengths].dtype.kind not in "iu"
            ):
                raise ConvertError(
                    f"{store_path}: {p.lengths}: expected integers of shape (N,), found "
                    f"{arrays[p.lengths].shape} {arrays[p.lengths].dtype}"
                )
        store = Store(store_path, arrays, n, offset)
        check_held(store, these, arrays)
        stores.append(store)
        offset += n
    assert parts is not None
    return stores, parts, attrs


def _check_shapes(stores: list[Store], parts: list[Part]) -> tuple[int, int]:
    """``(L, H)``, the same for every part of every store (float activations ``(N, L, T, H)``)."""
    shape = stores[0].arrays[parts[0].activations].shape
    n_layers, d_model = int(shape[1]), int(shape[3])
    for p in parts:
        for s in stores:
            sh = s.arrays[p.activations].shape
            if int(sh[1]) != n_layers or int(sh[3]) != d_model or s.arrays[p.activations].dtype.kind != "f":
                raise ConvertError(
                    f"{s.path}: expected {p.activations} as float (N, {n_layers}, T, {d_model}), "
                    f"found {sh} {s.arrays[p.activations].dtype}"
                )
    return n_layers, d_model


@dataclasses.dataclass(frozen=True)
class _Fields:
    """The per-sample arrays carried over: columns and text arrays by field name, each column's
    type, the arrays the parts use, and notes on what is not carried over."""

    columns: dict[str, str]  # column -> array name
    text_arrays: dict[str, str]  # text field -> byte/string array name
    types: dict[str, tuple[np.dtype[Any], tuple[int, ...]]]
    used: set[str]
    notes: list[str]


def _per_sample(stores: list[Store], parts: list[Part], options: Options) -> _Fields:
    """The first store's other per-sample arrays as columns (numeric) or text (bytes, strings),
    checked to be alike in every store."""
    first = stores[0].arrays
    notes: list[str] = []
    columns: dict[str, str] = {}
    text_arrays: dict[str, str] = {}
    types: dict[str, tuple[np.dtype[Any], tuple[int, ...]]] = {
        "lengths": (np.dtype("<i4"), ()),
        "true_lengths": (np.dtype("<i4"), ()),
    }
    used = {p.activations for p in parts} | {p.lengths for p in parts if p.lengths}
    for p in parts:
        if p.lengths is not None:
            types[p.lengths] = (column_dtype(np.dtype(first[p.lengths].dtype)) or np.dtype("<i4"), ())
    for array_name in sorted(set(first.array_keys()) - used):
        arr = first[array_name]
        name = field_name(array_name)
        dt: np.dtype[Any] | None = np.dtype(arr.dtype) if isinstance(arr.dtype, np.dtype) else None
        col = column_dtype(dt) if dt is not None else None
        if name is None or name in types or len(arr.shape) == 0 or int(arr.shape[0]) != stores[0].n:
            notes.append(f"array {array_name!r} {arr.shape} not carried over (not one value per sample)")
        elif col is not None:
            columns[name] = array_name
            types[name] = (col, tuple(int(v) for v in arr.shape[1:]))
        elif dt is not None and dt.kind in "SU" and len(arr.shape) == 1:
            text_arrays[name] = array_name
        else:
            notes.append(f"array {array_name!r} of dtype {arr.dtype} not carried over (not numeric or text)")
    for s in stores:
        missing = [a for a in [*columns.values(), *text_arrays.values()] if a not in set(s.arrays.array_keys())]
        if missing:
            raise ConvertError(f"{s.path}: missing the per-sample arrays {missing} that the first shard has")
        for a in [*columns.values(), *text_arrays.values()]:
            arr, want = s.arrays[a], first[a]
            if tuple(arr.shape) != (s.n, *want.shape[1:]) or np.dtype(arr.dtype) != np.dtype(want.dtype):
                raise ConvertError(
                    f"{s.path}: {a}: expected {np.dtype(want.dtype)} of shape {(s.n, *want.shape[1:])} "
                    f"(one value per sample, as in {stores[0].path}), found {np.dtype(arr.dtype)} {arr.shape}"
                )
            check_chunks(arr, a, s.path, options.memory // 2)
            check_codecs(s.path, a, arr, options.memory // 2)
    return _Fields(columns, text_arrays, types, used, notes)


def _attrs_layers(attrs: dict[str, Any], n_layers: int, options: Options, where: Path) -> list[Any] | None:
    """The layer numbers the store's attrs give, when they are ``L`` distinct 64-bit integers;
    None when absent, or when malformed and ``--layers`` gives them (an error otherwise)."""
    found = attrs.get("layers")
    if found is None or (
        isinstance(found, list)
        and len(found) == n_layers
        and all(is_int(v) and -(2**63) <= v < 2**63 for v in found)
        and len(set(found)) == n_layers
    ):
        return found
    if options.layers is None:  # never numbered by position instead without a word
        raise ConvertError(
            f"{where}: attrs layers: expected {n_layers} distinct integers of 64 bits (one per layer), "
            f"found {short_repr(found)}; give the layer numbers with --layers"
        )
    return None


def _parts_lines(parts: list[Part], total: int, tokens: int) -> list[str]:
    """How the parts become an example's tokens, in words."""
    if [p.name for p in parts] == ["prompt", "response"]:
        return [
            "prompt and response: ONE cache; each example is its prompt tokens then its response tokens, "
            f"then zeros (T = P_max {parts[0].max_len} + R_max {parts[1].max_len} = {total}"
            + (f", cut to {tokens} by --max-tokens" if tokens < total else "")
            + "); lengths = prompt_len + response_len; the response starts at prompt_len",
        ]
    return [
        f"tokens: {', '.join(p.activations for p in parts)} (T = {tokens})"
        + "".join(f"; valid positions from {p.lengths}" for p in parts if p.lengths)
    ]


def _description(
    path: Path, layout: str, stores: list[Store], parts: list[Part], attrs: dict[str, Any], fields: _Fields
) -> dict[str, Any]:
    """What the cache's metadata records of the source (its identity: configuration, manifest digest, files)."""
    first = stores[0].path
    config_file = first / "meta" / "config.json"
    config = plain(files.read_json(config_file, "the store's configuration")) if os.path.lexists(config_file) else None
    manifest = path / "manifest.json"
    manifest_bytes = (
        files.read_bytes(manifest, files.MAX_JSON_BYTES, "the run's manifest") if os.path.lexists(manifest) else None
    )
    identity_files: list[Path] = []
    for s in stores:
        folder = s.path / "arrays" if (s.path / "arrays").is_dir() else s.path
        # sorted: the order of a set's strings varies from process to process, the hash must not
        names = [*sorted(fields.used), *fields.columns.values(), *fields.text_arrays.values()]
        identity_files.extend(folder / name for name in names)
        identity_files += list(_text_files(s.path).values())
    return {
        "path": str(path),
        "layout": layout,
        "stores": [str(s.path.relative_to(path)) if s.path != path else "." for s in stores],
        "parts": [{"name": p.name, "array": p.activations, "lengths": p.lengths, "max_len": p.max_len} for p in parts],
        "attrs": attrs,
        "config": config,
        "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest() if manifest_bytes is not None else None,
        "identity": stat_identity([p for p in identity_files if p.exists()], path),
    }
