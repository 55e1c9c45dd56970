"""Pickle shards (the pickle.gz activation shard format): ``metadata.json`` + ``shard_NNNN.pkl.gz`` (or ``.pkl``).

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
import hashlib
import itertools
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import ConvertError, ConvertOptionError, SourceNotFoundError
from ..protocol.jsonfile import is_int, short_repr, type_name
from . import files, safe_pickle
from .base import (
    MEMORY_HINT,
    Chunk,
    Options,
    Report,
    SourcePlan,
    parse_checksum,
    plain,
    read_verified,
    stat_identity,
)
from .pickle_records import (
    KNOWN_KEYS,
    Fields,
    activation,
    column_value,
    fields_of,
    layers_of,
    metadata_of,
    sample_index,
    seq_lens,
)

KIND = "pickle"
INDEX = "metadata.json"
_SHARD_NAME = re.compile(r"shard_\d+\.pkl(\.gz)?")
_GZIP_MAGIC = b"\x1f\x8b"


def detect(path: Path) -> bool:
    """A folder with ``metadata.json`` listing ``shards`` and at least one ``shard_*.pkl[.gz]`` file."""
    if not (files.is_dir(path) and files.is_file(path / INDEX)):
        return False
    try:
        if not any(_SHARD_NAME.fullmatch(p.name) for p in path.iterdir()):
            return False
        index = files.read_json(path / INDEX)
    except (OSError, ConvertError):
        return False
    return isinstance(index, dict) and isinstance(index.get("shards"), list)


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """One entry of ``metadata.json``'s ``shards``, checked."""

    path: Path
    num_samples: int | None
    size: int | None
    checksum: tuple[str, str] | None

    @property
    def nbytes(self) -> int:
        """The file's size (for the progress line): ``size_bytes``, else what the file has now."""
        if self.size is not None:
            return self.size
        try:
            return self.path.stat().st_size
        except OSError:
            return 0


def _parse_index(path: Path) -> tuple[dict[str, Any], list[ShardInfo]]:
    where = path / INDEX
    try:
        index = files.read_json(where, "the pickle shards' index of the shards")
    except SourceNotFoundError:
        raise SourceNotFoundError(f"{where}: missing (the pickle shards' index of the shards)") from None
    if not isinstance(index, dict) or not isinstance(index.get("shards"), list):
        raise ConvertError(f"{where}: expected an object with a 'shards' list, found {type_name(index)}")
    shards = []
    names: dict[str, int] = {}
    for i, entry in enumerate(index["shards"]):
        at = f"{where}: shards[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("filename"), str):
            raise ConvertError(f"{at}: expected an object with a 'filename', found {short_repr(entry)}")
        name = entry["filename"]
        if not name or "/" in name or "\\" in name or "\0" in name or name in (".", "..") or len(name) > 255:
            raise ConvertError(f"{at}: expected a file name inside {path}, found {short_repr(name)}")
        if name in names:
            raise ConvertError(f"{at}: {short_repr(name)} is listed twice (also shards[{names[name]}])")
        names[name] = i
        num = entry.get("num_samples")
        size = entry.get("size_bytes")
        for key, value in (("num_samples", num), ("size_bytes", size)):
            if value is not None and not (is_int(value) and 0 <= value < 2**62):
                raise ConvertError(f"{at}: {key} must be a non-negative integer, found {short_repr(value)}")
        shards.append(ShardInfo(path / name, num, size, parse_checksum(entry.get("checksum"), at)))
    if not shards:
        raise ConvertError(f"{where}: the 'shards' list is empty: nothing to convert")
    return index, shards


def load_shard(info: ShardInfo, max_bytes: int) -> dict[str, Any]:
    """Shard ``info`` as a dict, after its size and checksum are verified; unpickled safely,
    its file and its pickle each at most ``max_bytes`` (`Options.shard_bytes`)."""
    data = read_verified(info.path, info.checksum, info.size, max_bytes)
    if data[:2] == _GZIP_MAGIC:
        # One call into zlib per member: it releases the GIL for all of it (a streaming
        # GzipFile makes thousands of small calls), so the read-ahead thread decompresses
        # while the main thread converts. Memory: one shard's pickle bytes, capped.
        data = files.gunzip(data, max_bytes, info.path, hint=MEMORY_HINT)
    try:
        shard = safe_pickle.load(data, info.path, max_bytes=max_bytes)
    except MemoryError:
        raise ConvertError(f"{info.path}: not enough memory to unpickle it{MEMORY_HINT}") from None
    del data
    if not isinstance(shard, dict) or not shard:
        raise ConvertError(f"{info.path}: expected a dict of layer_<idx> -> records, found {type_name(shard)}")
    return shard


def loaded(shards: list[ShardInfo], max_bytes: int) -> Iterator[tuple[ShardInfo, dict[str, Any]]]:
    """``(info, shard)`` in order, the next shard verified and unpickled in a thread meanwhile.

    zlib, hashlib and the copies in unpickling release the GIL for large buffers, so reading
    shard k+1 overlaps converting and writing shard k (at most two shards in memory). The
    thread is never waited for after an error or Ctrl-C (`files.read_ahead`).
    """
    return files.read_ahead(lambda info: load_shard(info, max_bytes), shards)


@dataclasses.dataclass
class PickleSource:
    plan: SourcePlan
    shards: list[ShardInfo]
    fields: Fields
    #: The most a shard may expand to (`Options.shard_bytes`).
    shard_bytes: int
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
            stream = itertools.chain([(todo[0], head)], loaded(todo[1:], self.shard_bytes))
        else:
            stream = loaded(todo, self.shard_bytes)
        del head
        for info, shard in stream:
            layered = layers_of(shard, info.path)
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
        known_keys = {key for key, _ in self.fields.numeric.values()} | set(self.fields.text.values())
        for j in range(a, b):
            head = lists[0][j]
            where = f"{info.path}: layer_{self.plan.layers[0]}[{j}]"
            if not isinstance(head, dict) or "sample_idx" not in head:
                raise ConvertError(f"{where}: expected a record with a 'sample_idx', found {type_name(head)}")
            sid = sample_index(head, where)
            seq_len = -1
            for li, records in enumerate(lists):
                rec = records[j]
                at = f"{info.path}: layer_{self.plan.layers[li]}[{j}]"
                act = activation(rec, at)
                if li and sample_index(rec, at) != sid:
                    raise ConvertError(
                        f"{at}: expected sample_idx {sid} as under layer_{self.plan.layers[0]}, "
                        f"found {short_repr(rec.get('sample_idx'))}"
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
                for k in rec:
                    if k not in KNOWN_KEYS:
                        report.count(f"values under record key {short_repr(k)} not carried over (not in the format)")
            true_lengths[j - a] = seq_len
            sample_idx[j - a] = sid
            meta = metadata_of(head, where)
            for name, (key, dt) in self.fields.numeric.items():
                numeric[name][j - a] = column_value(meta.get(key), dt, key, where)
            for name, key in self.fields.text.items():
                text[name].append(plain(meta.get(key)))
            for k in meta:
                if k not in known_keys:  # no column or text field to go to (decided from the first shard)
                    report.count(f"values of metadata field {short_repr(k)} not carried over")
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
        return Chunk(acts, columns, text, source_nbytes=info.nbytes * (b - a) // max(1, len(lists[0])))


def open_source(path: Path, options: Options, scan: Callable[[int, int], None] | None = None) -> PickleSource:
    """Read the index and the first shard (all shards when T must be found: no ``--max-tokens``)."""
    if options.layers is not None:
        raise ConvertOptionError("--layers: pickle shards name their layers (layer_15, ...); leave --layers out")
    index, shards = _parse_index(path)
    first_shard = load_shard(shards[0], options.shard_bytes)
    first = layers_of(first_shard, shards[0].path)
    layers = tuple(first)
    first_records = next(iter(first.values()))
    if not first_records:
        raise ConvertError(f"{shards[0].path}: the first shard holds no records")
    d_model = activation(first_records[0], f"{shards[0].path}: layer_{layers[0]}[0]").shape[1]
    report = Report()
    fields = fields_of(first, report, shards[0].path)
    shards, longest = _count(shards, first_records, layers[0], options, scan)
    n_examples = sum(s.num_samples or 0 for s in shards)
    tokens = options.max_tokens if options.max_tokens is not None else longest
    found = index.get("extraction_config")
    config: dict[str, Any] = found if isinstance(found, dict) else {}
    verified = sum(s.checksum is not None for s in shards)
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
    plan = SourcePlan(
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
        source=_description(path, index, shards, config),
        columns=columns,
        text=tuple(text_fields),
        source_nbytes=sum(size for _, size, _ in stat_identity([s.path for s in shards], path)),
        checksums=(
            f"{verified} of {len(shards)} shards carry a checksum; each is verified before it is used"
            if verified
            else "none recorded in metadata.json: shards are not verified"
        ),
        layout=tuple(layout),
        notes=tuple(report.notes),
    )
    return PickleSource(plan, shards, fields, options.shard_bytes, first_shard)


def _count(
    shards: list[ShardInfo],
    first_records: list[Any],
    layer: int,
    options: Options,
    scan: Callable[[int, int], None] | None,
) -> tuple[list[ShardInfo], int]:
    """The shards with their record counts, and the longest sequence (of the first shard only when
    ``--max-tokens`` is given and the index counts every shard's records)."""
    longest = max(seq_lens(first_records, layer, shards[0].path))
    if options.max_tokens is not None and all(s.num_samples is not None for s in shards):
        if shards[0].num_samples != len(first_records):
            raise ConvertError(
                f"{shards[0].path}: expected {shards[0].num_samples} records (num_samples in {INDEX}), "
                f"found {len(first_records)}"
            )
        return shards, longest
    # T is the longest sequence of all shards (and counts not in the index are needed
    # to resume): one pass over the rest, shard by shard, before anything is written.
    counted = [len(first_records)]
    for k, (info, shard) in enumerate(loaded(shards[1:], options.shard_bytes), start=1):
        if scan is not None:
            scan(k, len(shards))
        layered = layers_of(shard, info.path)
        records = next(iter(layered.values()))
        longest = max([longest, *seq_lens(records, next(iter(layered)), info.path)])
        counted.append(len(records))
    return [dataclasses.replace(s, num_samples=c) for s, c in zip(shards, counted, strict=True)], longest


def _description(path: Path, index: dict[str, Any], shards: list[ShardInfo], config: dict[str, Any]) -> dict[str, Any]:
    """What the cache's metadata records of the source (its identity: the index's digest, and the
    files' sizes and times when some shard carries no checksum)."""
    identity: Any = {"index_sha256": hashlib.sha256(files.read_bytes(path / INDEX, files.MAX_JSON_BYTES)).hexdigest()}
    if sum(s.checksum is not None for s in shards) != len(shards):
        identity["files"] = stat_identity([s.path for s in shards], path)
    return {
        "path": str(path),
        "version": plain(index.get("version")),
        "created_at": plain(index.get("created_at")),
        "extraction_config": plain(config),
        "distributed_config": plain(index.get("distributed_config")),
        "shards": len(shards),
        "identity": identity,
    }
