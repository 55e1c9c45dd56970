"""Pickle shards (seed 001): ``metadata.json`` + ``shard_NNNN.pkl.gz`` (or ``.pkl``).

Each shard is a dict ``layer_<idx>`` -> list of records ``{sample_idx, activation (seq_len,
hidden) float32, shape, text_preview, metadata{token_count, dataset_idx, machine_id, ...}}``,
the same samples in the same order under every layer. How it maps (docs/convert.md):

* layers from the keys, in ascending order; examples in index order, then list order;
* every example padded with zeros to the longest ``seq_len`` (or cut to ``--max-tokens``):
  ``lengths`` holds the stored positions and ``true_lengths`` the source's ``seq_len``;
* ``sample_idx`` and every numeric ``metadata`` field become columns (bool, int64 or
  float64); other ``metadata`` fields and ``text_preview`` become text fields;
* before a shard is used, its bytes are checked against ``size_bytes`` and the
  ``checksum`` (``sha256:...``) in ``metadata.json``, and it is unpickled by
  `safe_pickle.load`, which refuses everything but arrays and plain containers.

Memory: two shards (the one being converted and the next, read ahead) plus one chunk.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import itertools
import json
import numbers
import re
import zlib
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import ConvertError, ConvertOptionError, SourceNotFoundError
from . import safe_pickle
from .base import Chunk, Options, Plan, Report, field_name, parse_checksum, plain, read_verified, stat_identity

KIND = "pickle"
INDEX = "metadata.json"
_LAYER_KEY = re.compile(r"layer_(-?\d+)")
_SHARD_NAME = re.compile(r"shard_\d+\.pkl(\.gz)?")
_GZIP_MAGIC = b"\x1f\x8b"
#: Record keys with a meaning; others are reported as not carried over.
_KNOWN_KEYS = frozenset(["sample_idx", "activation", "shape", "text_preview", "metadata"])


def detect(path: Path) -> bool:
    """A folder with ``metadata.json`` listing ``shards`` and at least one ``shard_*.pkl[.gz]`` file."""
    if not (path / INDEX).is_file():
        return False
    if not any(_SHARD_NAME.fullmatch(p.name) for p in path.iterdir()):
        return False
    try:
        index = json.loads((path / INDEX).read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(index, dict) and isinstance(index.get("shards"), list)


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """One entry of ``metadata.json``'s ``shards``, checked."""

    path: Path
    num_samples: int | None
    size: int | None
    checksum: tuple[str, str] | None


@dataclasses.dataclass(frozen=True)
class Fields:
    """Per-example streams decided from the first shard: numeric metadata -> columns, the rest -> text."""

    numeric: Mapping[str, tuple[str, np.dtype[Any]]]  # column name -> (metadata key, dtype)
    text: Mapping[str, str]  # text field name -> metadata key
    text_preview: bool


def _parse_index(path: Path) -> tuple[dict[str, Any], list[ShardInfo]]:
    where = path / INDEX
    try:
        index = json.loads(where.read_bytes())
    except FileNotFoundError:
        raise SourceNotFoundError(f"{where}: missing (seed 001's index of the shards)") from None
    except ValueError as err:
        raise ConvertError(f"{where}: not valid JSON ({err})") from None
    if not isinstance(index, dict) or not isinstance(index.get("shards"), list):
        raise ConvertError(f"{where}: expected an object with a 'shards' list, found {type(index).__name__}")
    shards = []
    for i, entry in enumerate(index["shards"]):
        at = f"{where}: shards[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("filename"), str):
            raise ConvertError(f"{at}: expected an object with a 'filename', found {entry!r:.100}")
        name = entry["filename"]
        if "/" in name or "\\" in name or name in (".", ".."):
            raise ConvertError(f"{at}: expected a file name inside {path}, found {name!r}")
        num = entry.get("num_samples")
        size = entry.get("size_bytes")
        for key, value in (("num_samples", num), ("size_bytes", size)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ConvertError(f"{at}: {key} must be a non-negative integer, found {value!r}")
        shards.append(ShardInfo(path / name, num, size, parse_checksum(entry.get("checksum"), at)))
    if not shards:
        raise ConvertError(f"{where}: the 'shards' list is empty: nothing to convert")
    return index, shards


def load_shard(info: ShardInfo) -> dict[str, Any]:
    """Shard ``info`` as a dict, after its size and checksum are verified; unpickled safely."""
    data = read_verified(info.path, info.checksum, info.size)
    if data[:2] == _GZIP_MAGIC:
        # One call into zlib for the whole shard: it releases the GIL for all of it (a
        # streaming GzipFile makes thousands of small calls), so the read-ahead thread
        # decompresses while the main thread converts. Memory: one shard's pickle bytes.
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as err:
            raise ConvertError(f"{info.path}: not a readable gzip file ({err})") from None
    shard = safe_pickle.load(data, info.path)
    if not isinstance(shard, dict) or not shard:
        raise ConvertError(f"{info.path}: expected a dict of layer_<idx> -> records, found {type(shard).__name__}")
    return shard


def loaded(shards: list[ShardInfo]) -> Iterator[tuple[ShardInfo, dict[str, Any]]]:
    """``(info, shard)`` in order, the next shard verified and unpickled in a thread meanwhile.

    zlib, hashlib and the copies in unpickling release the GIL for large buffers, so reading
    shard k+1 overlaps converting and writing shard k (at most two shards in memory).
    """
    if not shards:
        return
    with ThreadPoolExecutor(1, "saev-shards-convert-read") as pool:
        pending = pool.submit(load_shard, shards[0])
        for k, info in enumerate(shards):
            shard = pending.result()
            if k + 1 < len(shards):
                pending = pool.submit(load_shard, shards[k + 1])
            yield info, shard
            del shard


def _layers_of(shard: Mapping[str, Any], where: Path) -> dict[int, list[Any]]:
    out: dict[int, list[Any]] = {}
    for key, records in shard.items():
        m = _LAYER_KEY.fullmatch(str(key))
        if m is None:
            raise ConvertError(f"{where}: expected keys like 'layer_15', found {key!r}")
        if not isinstance(records, list):
            raise ConvertError(f"{where}: {key}: expected a list of records, found {type(records).__name__}")
        out[int(m.group(1))] = records
    return dict(sorted(out.items()))


def _activation(record: Any, where: str) -> npt.NDArray[Any]:
    if not isinstance(record, dict) or "activation" not in record:
        raise ConvertError(f"{where}: expected a record with an 'activation', found {type(record).__name__}")
    act = record["activation"]
    if not isinstance(act, np.ndarray) or act.ndim != 2 or act.dtype.kind != "f":
        shape = getattr(act, "shape", None)
        raise ConvertError(
            f"{where}: expected 'activation' as a float array (seq_len, hidden), found "
            f"{type(act).__name__} {getattr(act, 'dtype', '')} {shape if shape is not None else ''}".rstrip()
        )
    shape = record.get("shape")
    if shape is not None and tuple(shape) != act.shape:
        raise ConvertError(f"{where}: 'shape' says {tuple(shape)} but the activation is {act.shape}")
    return act


def _is_number(v: Any) -> bool:
    return isinstance(v, (numbers.Number, np.number, np.bool_)) and not isinstance(v, complex)


def _fields(shard: Mapping[int, list[Any]], report: Report) -> Fields:
    """Columns and text fields from the first shard's records (first layer)."""
    records = next(iter(shard.values()))
    keys: dict[str, list[Any]] = {}
    for r in records:
        meta = r.get("metadata") or {}
        if not isinstance(meta, dict):
            raise ConvertError(f"'metadata' must be a dict, found {type(meta).__name__}")
        for k, v in meta.items():
            keys.setdefault(str(k), []).append(v)
    numeric: dict[str, tuple[str, np.dtype[Any]]] = {}
    text: dict[str, str] = {}
    taken = {"sample_idx", "lengths", "true_lengths"}
    for key, values in keys.items():
        name = field_name(key)
        if name is None or name in taken:
            report.note(f"metadata field {key!r} not carried over (no usable column name)")
            continue
        if len(values) == len(records) and all(_is_number(v) for v in values):
            dt: np.dtype[Any]
            if all(isinstance(v, (bool, np.bool_)) for v in values):
                dt = np.dtype("|b1")
            elif all(isinstance(v, (numbers.Integral, np.integer)) for v in values):
                dt = np.dtype("<i8")
            else:
                dt = np.dtype("<f8")
            numeric[name] = (key, dt)
        else:
            text[name] = key
        taken.add(name)
    preview = any("text_preview" in r for r in records)
    if preview and "text_preview" in text:
        report.note("metadata field 'text_preview' not carried over (the record's own text_preview is kept)")
        del text["text_preview"]
    extra = sorted({k for r in records for k in r if k not in _KNOWN_KEYS})
    for k in extra:
        report.note(f"record key {k!r} not carried over (seed 001 does not define it)")
    return Fields(numeric, text, preview)


@dataclasses.dataclass
class PickleSource:
    plan: Plan
    shards: list[ShardInfo]
    fields: Fields
    #: The first shard, loaded while planning, handed to the first `chunks` call (not read twice).
    first: dict[str, Any] | None = None

    def chunks(self, start: int, report: Report) -> Iterator[Chunk]:
        tokens = self.plan.tokens
        first = 0
        todo = []
        for info in self.shards:
            if info.num_samples is not None and first + info.num_samples <= start:
                first += info.num_samples  # sealed in an earlier run: not read again
            else:
                todo.append(info)
        head, self.first = self.first, None
        stream: Iterator[tuple[ShardInfo, dict[str, Any]]]
        if head is not None and todo[:1] == self.shards[:1]:
            stream = itertools.chain([(todo[0], head)], loaded(todo[1:]))
        else:
            stream = loaded(todo)
        del head
        for info, shard in stream:
            layered = _layers_of(shard, info.path)
            if tuple(layered) != self.plan.layers:
                raise ConvertError(
                    f"{info.path}: expected layers {list(self.plan.layers)} as in the first shard, "
                    f"found {list(layered)}"
                )
            lists = list(layered.values())
            count = len(lists[0])
            if any(len(r) != count for r in lists) or (info.num_samples is not None and count != info.num_samples):
                counts = {f"layer_{k}": len(v) for k, v in layered.items()}
                raise ConvertError(
                    f"{info.path}: expected {info.num_samples if info.num_samples is not None else count} records "
                    f"under every layer (num_samples in {INDEX}), found {counts}"
                )
            skip = max(0, start - first)
            for a in range(skip, count, self.plan.chunk_examples):
                b = min(count, a + self.plan.chunk_examples)
                yield self._chunk(lists, a, b, info, report, tokens)
            first += count
        if first != self.plan.n_examples:
            raise ConvertError(f"{self.plan.path}: expected {self.plan.n_examples} examples in all, found {first}")

    def _chunk(self, lists: list[list[Any]], a: int, b: int, info: ShardInfo, report: Report, tokens: int) -> Chunk:
        n_layers, d_model = len(lists), self.plan.d_model
        acts = np.zeros((b - a, n_layers, tokens, d_model), np.float32)
        true_lengths = np.empty(b - a, np.int32)
        sample_idx = np.empty(b - a, np.int64)
        numeric = {name: np.empty(b - a, dt) for name, (_, dt) in self.fields.numeric.items()}
        text: dict[str, list[Any]] = {name: [] for name in self.fields.text}
        if self.fields.text_preview:
            text["text_preview"] = []
        for j in range(a, b):
            head = lists[0][j]
            where = f"{info.path}: layer_{self.plan.layers[0]}[{j}]"
            if not isinstance(head, dict) or "sample_idx" not in head:
                raise ConvertError(f"{where}: expected a record with a 'sample_idx'")
            sid = head["sample_idx"]
            seq_len = -1
            for li, records in enumerate(lists):
                rec = records[j]
                at = f"{info.path}: layer_{self.plan.layers[li]}[{j}]"
                act = _activation(rec, at)
                if rec.get("sample_idx") != sid:
                    raise ConvertError(
                        f"{at}: expected sample_idx {sid} as under layer_{self.plan.layers[0]}, "
                        f"found {rec.get('sample_idx')!r}"
                    )
                if act.shape[1] != d_model:
                    raise ConvertError(f"{at}: expected hidden size {d_model}, found {act.shape[1]}")
                if li == 0:
                    seq_len = act.shape[0]
                elif act.shape[0] != seq_len:
                    raise ConvertError(
                        f"{at}: expected seq_len {seq_len} as under the first layer, found {act.shape[0]}"
                    )
                keep = min(seq_len, tokens)
                acts[j - a, li, :keep] = act[:keep]
            true_lengths[j - a] = seq_len
            sample_idx[j - a] = int(sid)
            meta = head.get("metadata") or {}
            for name, (key, dt) in self.fields.numeric.items():
                value = meta.get(key)
                if value is None or not _is_number(value):
                    raise ConvertError(
                        f"{where}: expected a number for metadata field {key!r} (as in the first shard), "
                        f"found {value!r}"
                    )
                numeric[name][j - a] = value if dt.kind != "b" else bool(value)
            for name, key in self.fields.text.items():
                text[name].append(plain(meta.get(key)))
            if self.fields.text_preview:
                preview = head.get("text_preview")
                text["text_preview"].append(preview if isinstance(preview, str) else plain(preview))
        lengths = np.minimum(true_lengths, tokens).astype(np.int32)
        cut = true_lengths > tokens
        if cut.any():
            report.count(f"examples longer than T={tokens} truncated", int(cut.sum()))
            report.count("token positions dropped by that truncation", int((true_lengths - lengths).sum()))
        columns: dict[str, npt.NDArray[Any]] = {
            "lengths": lengths,
            "true_lengths": true_lengths,
            "sample_idx": sample_idx,
            **numeric,
        }
        return Chunk(acts, columns, text, source_nbytes=info.path.stat().st_size * (b - a) // max(1, len(lists[0])))


def open_source(path: Path, options: Options, scan: Callable[[int, int], None] | None = None) -> PickleSource:
    """Read the index and the first shard (all shards when T must be found: no ``--max-tokens``)."""
    if options.layers is not None:
        raise ConvertOptionError("--layers: pickle shards name their layers (layer_15, ...); leave --layers out")
    index, shards = _parse_index(path)
    first_shard = load_shard(shards[0])
    first = _layers_of(first_shard, shards[0].path)
    layers = tuple(first)
    first_records = next(iter(first.values()))
    if not first_records:
        raise ConvertError(f"{shards[0].path}: the first shard holds no records")
    d_model = _activation(first_records[0], f"{shards[0].path}: layer_{layers[0]}[0]").shape[1]
    report = Report()
    fields = _fields(first, report)
    longest = max(_activation(r, str(shards[0].path)).shape[0] for r in first_records)
    n_examples = len(first_records)
    counted = [len(first_records)]
    if options.max_tokens is None or any(s.num_samples is None for s in shards):
        # T is the longest sequence of all shards (and counts not in the index are needed
        # to resume): one pass over the rest, shard by shard, before anything is written.
        for k, (info, shard) in enumerate(loaded(shards[1:]), start=1):
            if scan is not None:
                scan(k, len(shards))
            layered = _layers_of(shard, info.path)
            records = next(iter(layered.values()))
            longest = max([longest, *(_activation(r, str(info.path)).shape[0] for r in records)])
            counted.append(len(records))
        n_examples = sum(counted)
        shards = [dataclasses.replace(s, num_samples=c) for s, c in zip(shards, counted, strict=True)]
    else:
        if shards[0].num_samples != len(first_records):
            raise ConvertError(
                f"{shards[0].path}: expected {shards[0].num_samples} records (num_samples in {INDEX}), "
                f"found {len(first_records)}"
            )
        n_examples = sum(s.num_samples or 0 for s in shards)
    tokens = options.max_tokens if options.max_tokens is not None else longest
    found = index.get("extraction_config")
    config: dict[str, Any] = found if isinstance(found, dict) else {}
    verified = sum(s.checksum is not None for s in shards)
    identity: Any
    if verified == len(shards):
        identity = {"index_sha256": hashlib.sha256((path / INDEX).read_bytes()).hexdigest()}
    else:
        identity = {
            "index_sha256": hashlib.sha256((path / INDEX).read_bytes()).hexdigest(),
            "files": stat_identity([s.path for s in shards], path),
        }
    source = {
        "path": str(path),
        "version": plain(index.get("version")),
        "created_at": plain(index.get("created_at")),
        "extraction_config": plain(config),
        "distributed_config": plain(index.get("distributed_config")),
        "shards": len(shards),
        "identity": identity,
    }
    layout = [
        f"layers {list(layers)} from the keys layer_<idx>; examples in index order",
        f"tokens: every example padded with zeros to T={tokens}"
        + (" (--max-tokens)" if options.max_tokens is not None else " (the longest seq_len)")
        + "; columns lengths (stored positions) and true_lengths (the source's seq_len)",
        "columns: sample_idx" + "".join(f", {n}" for n in fields.numeric),
    ]
    text_fields = list(fields.text) + (["text_preview"] if fields.text_preview else [])
    if text_fields:
        layout.append("text: " + ", ".join(text_fields))
    columns: dict[str, tuple[np.dtype[Any], tuple[int, ...]]] = {
        "lengths": (np.dtype("<i4"), ()),
        "true_lengths": (np.dtype("<i4"), ()),
        "sample_idx": (np.dtype("<i8"), ()),
        **{name: (dt, ()) for name, (_, dt) in fields.numeric.items()},
    }
    model = config.get("model_name")
    plan = Plan(
        kind=KIND,
        path=path,
        family=options.family or str(config.get("model_architecture") or "unknown"),
        ckpt=options.ckpt or str(model or "unknown"),
        dataset=str(config.get("dataset_name") or path),
        layers=layers,
        tokens=tokens,
        cls_token=options.cls_token,
        d_model=int(d_model),
        n_examples=n_examples,
        source=source,
        columns=columns,
        text=tuple(text_fields),
        source_nbytes=sum(s.path.stat().st_size for s in shards),
        checksums=(
            f"{verified} of {len(shards)} shards carry a checksum; each is verified before it is used"
            if verified
            else "none recorded in metadata.json: shards are not verified"
        ),
        layout=tuple(layout),
        notes=tuple(report.notes),
    )
    return PickleSource(plan, shards, fields, first_shard)
