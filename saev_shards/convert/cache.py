"""A cache of this library or of saev's code, in any dialect (protocol.md sections 1-9): ``--to saev`` and back.

The source is opened as any cache is (`saev_shards.open`: metadata, manifest and file
sizes checked); every file with a recorded checksum is hashed before its data is used,
one shard at a time, so memory stays bounded by one chunk. What the target keeps:

* ``--to saev`` (protocol 2.1 as saev's code writes it): activations widened to float32,
  labels; columns, text and statistics are dropped and reported. ``data`` must be a string
  there (saev stores base64 of a pickle): a string is kept, an object is encoded as
  ``base64(pickle.dumps(data, protocol=4))`` of its plain JSON values (lists, dicts,
  strings, numbers), which saev's ``pickle.loads`` turns back into the same object. A
  family outside saev's list needs ``--family``. ``pixel_agg`` is the source's (saev's
  code), else "majority", as saev writes it when there are no labels to aggregate.
* ``--to 3.1`` (or ``3.0``): everything the source holds; the stored dtype stays the source's
  unless ``--dtype`` says otherwise (3.0 has no float8_e4m3: float16 then). A float8_e4m3
  source's values and scales are copied as they are into a float8_e4m3 cache, and
  dequantized (float32, exact) for any other dtype, ``--to saev`` included; a dequantized
  cache's ``data`` is ``{"dequantized_from": {"cache": <source hash>, "dtype":
  "float8_e4m3"}, "source_data": <the source's data>}``, so it never takes the name of the
  cache the float8_e4m3 one was made from. A 2.1 cache's fields that 3.0 has no key for are kept in
  ``data`` as ``{"saev": {"data", "pixel_agg", "protocol", "dialect"}}``, so converting
  that 3.0 cache back ``--to saev`` gives the original metadata.json, name and bytes.
  A cache of saev's earlier formats (protocol.md 9.5) keeps its whole metadata.json there,
  ``{"saev": {"dialect", "metadata"}}``; ``--to saev`` writes it as today's protocol 2.1
  (its ``data`` and ``pixel_agg`` kept, ``seed`` dropped), the same cache from the source
  itself or from its converted copy.

The shard budget stays the source's unless ``--patches-per-shard`` is given.
"""

from __future__ import annotations

import base64
import dataclasses
import itertools
import json
import pickle
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from ..codecs.dtypes import to_float32
from ..errors import ConvertError, ConvertOptionError, ProtocolWarning, ShardsError, SourceChecksumError
from ..fileio import hash_file
from ..protocol import is_cache_name
from ..protocol.common import (
    FLOAT8,
    MANIFEST_FILE,
    METADATA_FILE,
    PROTOCOL,
    PROTOCOL_32,
    SAEV_CODE_PROTOCOLS,
    V3_PROTOCOLS,
    shard_name,
)
from ..protocol.metadata import Metadata
from ..protocol.saev_code import DEFAULT_PIXEL_AGG, SAEV_FAMILIES
from ..protocol.v3 import canonical_json
from ..reader import Shards
from ..reader import open as open_cache
from .base import Chunk, Options, Report, SourcePlan

KIND = "cache"
#: The key of a 3.0 cache's ``data`` that keeps a 2.1 cache's fields 3.0 has no key for.
SAEV_KEY = "saev"
#: The key of the ``data`` of a cache holding a float8_e4m3 cache's dequantized values: the
#: source's hash and dtype (its own ``data`` goes under ``source_data``).
DEQUANTIZED_KEY = "dequantized_from"
_SAEV_DIALECTS = ("saev", "saev-64")


def detect(path: Path) -> bool:
    """A folder named by a cache hash (64 or saev's 8 hex digits) holding metadata.json and
    shards.json, or metadata.json and acts000000.bin (saev's formats before 1.0.0 had no shards.json)."""
    return (
        path.is_dir()
        and is_cache_name(path.name)
        and (path / METADATA_FILE).is_file()
        and ((path / MANIFEST_FILE).is_file() or (path / shard_name(0)).is_file())
    )


@dataclasses.dataclass
class CacheSource:
    plan: SourcePlan
    shards: Shards

    def chunks(self, start: int, report: Report) -> Iterator[Chunk]:
        shards, md = self.shards, self.shards.metadata
        manifest = shards.manifest
        for name, nbytes, digest in manifest.other_files():
            _verify(shards.path / name, nbytes, digest)
        texts = {name: itertools.islice(shards.text(name), start, None) for name in self.plan.text}
        step = self.plan.chunk_examples
        eps = md.examples_per_shard
        for k in range(start // eps if eps else 0, shards.n_shards):
            shard = manifest.shards[k]
            _verify(shards.path / shard.name, shard.nbytes, shard.xxh3_128)
            first, end = max(start, k * eps), k * eps + shard.n_examples
            for a in range(first, end, step):
                b = min(end, a + step)
                raw = shards.read_range_raw(a, b)
                acts = to_float32(raw, md.dtype) if md.dtype == "bfloat16" else raw
                scales = shards.read_range_scales(a, b) if md.dtype == FLOAT8 else None
                columns = {name: np.array(col[a:b]) for name, col in shards.columns.items()}
                text = {name: list(itertools.islice(it, b - a)) for name, it in texts.items()}
                labels = None if shards.labels is None else np.array(shards.labels[a:b])
                nbytes = (b - a) * (md.example_nbytes + (0 if scales is None else scales[0].nbytes))
                yield Chunk(acts, columns, text, labels, source_nbytes=nbytes, scales=scales)


def _verify(path: Path, nbytes: int, digest: str | None) -> None:
    """Hash ``path`` before its data is used (sizes were checked when the cache was opened)."""
    if digest is None:
        return
    size, found = hash_file(path, regular_only=True)
    if size != nbytes or found != digest:
        raise SourceChecksumError(
            f"{path}: expected {nbytes} bytes with xxh3_128 {digest}, found {size} bytes with {found} "
            "(the file changed or was damaged since the cache was written); nothing was converted from it"
        )


def open_source(path: Path, options: Options, scan: Callable[[int, int], None] | None = None) -> CacheSource:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProtocolWarning)  # the dialect is printed in the layout lines
        try:
            shards = open_cache(path)
        except ShardsError as err:
            raise ConvertError(f"{path}: not a cache that opens: {err}") from None
    md = shards.metadata
    if options.layers is not None and tuple(options.layers) != md.layers:
        raise ConvertOptionError(f"--layers: a cache keeps its layers {list(md.layers)}; found {list(options.layers)}")
    if options.max_tokens is not None or options.cls_token:
        raise ConvertOptionError(
            "--max-tokens and --cls-token do not apply to a cache: its tokens are kept as they are"
        )
    manifest = shards.manifest
    digests = all(d is not None for _, _, d in manifest.files())
    unchecked = (
        f"none recorded ({md.rules.summary}): sizes and the name checked, values copied as they are"
        if md.rules.history
        else "none recorded (protocol 2.1 without checksums.json): sizes checked"
    )
    plan = SourcePlan(
        kind=KIND,
        path=path,
        family=options.family or md.family,
        ckpt=options.ckpt or md.ckpt,
        dataset=md.dataset,
        layers=md.layers,
        tokens=md.tokens_per_ex,
        cls_token=md.cls_token,
        d_model=md.d_model,
        n_examples=md.n_examples,
        source={"hash": md.hash},
        columns={name: (np.dtype(c.dtype), tuple(c.shape[1:])) for name, c in manifest.columns.items()},
        text=tuple(manifest.text),
        source_nbytes=sum(n for _, n, _ in manifest.files()),
        checksums="xxh3_128 of every file, verified before its data is used" if digests else unchecked,
        layout=(f"{md.rules.summary}, {md.dtype}, shape {md.shape}, layers {list(md.layers)}",),
        labels=manifest.labels is not None,
        cache=md,
    )
    return CacheSource(plan, shards)


def check_saev_family(family: str, cls_token: bool) -> None:
    """`ConvertOptionError` unless saev's loader accepts ``family``, saying which to pick.

    saev knows vision families only; a language model's cache (``bert``, ``gpt2``, ...) has
    none of its own, so the message says that and names the family whose token layout
    matches the cache's: ``clip`` with a [CLS] token first, ``siglip`` without one.
    """
    if family in SAEV_FAMILIES:
        return
    pick, layout = ("clip", "a [CLS] token first") if cls_token else ("siglip", "no [CLS] token")
    raise ConvertOptionError(
        f"--family: saev knows only vision model families ({', '.join(SAEV_FAMILIES)}), and this cache's "
        f"family {family!r} is not one of them (a language model's cache never is); saev's loaders need one "
        f"only as a label with a token layout, so name the one whose layout matches this cache, {layout}: "
        f"--family {pick} (the activations are written unchanged)"
    )


def saev_data(data: Any) -> str:
    """``data`` as saev stores it: a string is kept; anything else is base64 of its pickle."""
    if isinstance(data, str):
        return data
    return base64.b64encode(pickle.dumps(data, protocol=4)).decode("ascii")


def _kept_fields(data: Any) -> dict[str, Any] | None:
    """The 2.1 fields a converted 3.0 cache keeps in ``data["saev"]``, if it has them (for a
    cache of saev's earlier formats, those of its metadata.json kept there: `history_fields`)."""
    if not isinstance(data, dict) or set(data) != {SAEV_KEY}:
        return None
    kept = data[SAEV_KEY]
    if isinstance(kept, dict) and set(kept) == {"dialect", "metadata"}:
        return _history_kept(kept["dialect"], kept["metadata"])
    if not isinstance(kept, dict) or set(kept) != {"data", "pixel_agg", "protocol", "dialect"}:
        return None
    return kept


def history_fields(src: Metadata) -> dict[str, Any]:
    """What a cache converted from one of saev's earlier formats keeps in ``data["saev"]``:
    the dialect and metadata.json's object as it was (its own keys, ``seed``, ``data``)."""
    return {"dialect": src.dialect, "metadata": src.to_dict()}


def _history_kept(dialect: Any, metadata: Any) -> dict[str, Any] | None:
    """The fields ``--to saev`` takes from an earlier format's metadata.json kept in ``data``:
    its ``data`` and ``pixel_agg``, written as today's protocol 2.1 (saev reads no earlier one)."""
    if not isinstance(dialect, str) or not isinstance(metadata, dict) or "data" not in metadata:
        return None
    # Objects with their keys sorted, as a converted copy's metadata.json holds them: the
    # pickle, and so the cache, is the same from the source and from the copy.
    data = json.loads(canonical_json(metadata["data"]))
    return {"data": data, "pixel_agg": metadata.get("pixel_agg"), "protocol": "2.1", "dialect": "saev"}


def target_metadata(plan: SourcePlan, src: Metadata, to_protocol: str, dtype: str | None, pps: int | None) -> Metadata:
    """The converted cache's metadata (module docstring). A cache that records sites (protocol
    3.2) keeps them, and so stays 3.2; no other target can say what its layer slots hold."""
    if src.sites is not None and to_protocol not in (PROTOCOL, PROTOCOL_32):
        target = "saev" if to_protocol in SAEV_CODE_PROTOCOLS else to_protocol
        raise ConvertOptionError(
            f"--to {target}: this cache records what each layer slot holds (sites: protocol {PROTOCOL_32}), "
            f"which protocol {to_protocol} cannot say; convert it to {PROTOCOL} (the default: it stays "
            f"{PROTOCOL_32}, with its sites)"
        )
    common: dict[str, Any] = dict(
        family=plan.family,
        ckpt=plan.ckpt,
        layers=src.layers,
        patches_per_ex=src.patches_per_ex,
        cls_token=src.cls_token,
        d_model=src.d_model,
        n_examples=src.n_examples,
        patches_per_shard=pps if pps is not None else src.patches_per_shard,
    )
    target_dtype = (dtype or src.dtype) if to_protocol in V3_PROTOCOLS else "float32"
    if src.dtype == FLOAT8 and target_dtype != FLOAT8:
        # Dequantized values are not the values the source's configuration was written from:
        # another configuration (and hash), so a float16 cache taken to float8_e4m3 and back
        # never takes the name of the original.
        dequantized = {DEQUANTIZED_KEY: {"cache": src.hash, "dtype": FLOAT8}, "source_data": src.data}
        if to_protocol in V3_PROTOCOLS:
            return Metadata(
                **common,
                data=dequantized,
                dataset=src.dataset,
                dtype=target_dtype,
                protocol=to_protocol,
                sites=src.sites,
            )
        check_saev_family(plan.family, src.cls_token)
        return Metadata(
            **common,
            data=saev_data(dequantized),
            dataset=str(PurePosixPath(src.dataset)),
            dtype="float32",
            protocol="2.1",
            pixel_agg=DEFAULT_PIXEL_AGG,
        )
    if to_protocol in V3_PROTOCOLS:
        data = src.data
        if src.rules.history:
            data = {SAEV_KEY: history_fields(src)}
        elif src.rules.legacy:
            data = {
                SAEV_KEY: {
                    "data": src.data,
                    "pixel_agg": src.pixel_agg,
                    "protocol": src.protocol,
                    "dialect": src.dialect,
                }
            }
        return Metadata(
            **common, data=data, dataset=src.dataset, dtype=target_dtype, protocol=to_protocol, sites=src.sites
        )
    check_saev_family(plan.family, src.cls_token)
    kept = _kept_fields(src.data) if not src.rules.legacy else None
    if src.rules.history:
        kept = _history_kept(src.dialect, src.to_dict())
    elif src.rules.legacy:
        kept = {"data": src.data, "pixel_agg": src.pixel_agg, "protocol": src.protocol, "dialect": src.dialect}
    data = saev_data(kept["data"] if kept is not None else src.data)
    pixel_agg = (kept or {}).get("pixel_agg") or DEFAULT_PIXEL_AGG
    protocol = kept["protocol"] if kept is not None and kept["protocol"] in SAEV_CODE_PROTOCOLS else "2.1"
    dialect = kept["dialect"] if kept is not None and kept["dialect"] in _SAEV_DIALECTS else "saev"
    return Metadata(
        **common,
        data=data,
        dataset=str(PurePosixPath(src.dataset)),
        dtype="float32",
        protocol=protocol,
        pixel_agg=pixel_agg,
        dialect=dialect,
    )


def target_notes(src: Metadata, md: Metadata, has_stats: bool) -> list[str]:
    """What a conversion from ``src`` to ``md`` changes, for the report."""
    notes = []
    if md.dtype == FLOAT8 and src.dtype != FLOAT8:
        notes.append(f"{src.dtype} activations quantized to float8_e4m3 (a float32 scale per vector)")
    if src.dtype == FLOAT8 and md.dtype != FLOAT8:
        notes.append(f"float8_e4m3 activations dequantized to {md.dtype} (data records the source cache)")
    elif md.rules.legacy and src.dtype != "float32":
        notes.append(f"{src.dtype} activations widened to float32 (saev reads float32 only)")
    if md.rules.legacy and not isinstance(src.data, str) and _kept_fields(src.data) is None:
        notes.append("data (an object) stored as base64 of its pickle, as saev stores its dataset config")
    if src.rules.history and not md.rules.legacy:
        notes.append(f"{src.rules.summary}: its metadata.json kept as it was in data['{SAEV_KEY}']")
    if src.rules.history and md.rules.legacy and src.seed is not None:
        notes.append(f"seed {src.seed} not carried over (saev's metadata has no seed since 1.0.0)")
    if md.rules.legacy and has_stats:
        notes.append("stats.json not carried over (saev has no room for statistics)")
    if md.dataset != src.dataset:
        notes.append(f"dataset {src.dataset!r} stored in its normal path form {md.dataset!r}")
    return notes
