"""What `saev-shards info` shows about a cache (`summary`): its metadata, files, statistics and
where it is stored, as plain JSON values, without reading a checksum."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import reader
from ..protocol.metadata import Metadata
from .sidecar import sidecar_location


def summary(shards: reader.Shards) -> dict[str, Any]:
    """Everything `saev-shards info` shows about a cache, as plain JSON values (no checksums read)."""
    md, man = shards.metadata, shards.manifest
    stats = shards.stats
    per_layer = None
    if stats is not None:
        per_layer = [
            {
                "layer": int(layer),
                "count": int(stats["count"][i]),
                "nonfinite": int(stats["nonfinite"][i]),
                "norm_mean": float(stats["norm_mean"][i]),
                "norm_sq_mean": float(stats["norm_sq_mean"][i]),
                "var_mean": float(np.mean(stats["var"][i])) if md.d_model else 0.0,
            }
            for i, layer in enumerate(stats["layers"])
        ]
    return {
        "hash": md.hash,
        "path": shards.location,
        # A remote cache: its URL, and how its reads are verified (per block with blocks.json,
        # else per whole file); None for a local cache.
        "url": shards.url,
        "remote_verification": _remote_verification(shards),
        "protocol": md.protocol,
        # How metadata.json is spelled: the protocol's own ("3.0") or one of saev's (protocol 2.1).
        "dialect": md.dialect,
        "dialect_summary": md.rules.summary,
        # One of saev's earlier formats (protocol.md 9.5): what it does not record, the rule its
        # name is the hash by, and what `verify` checks; None for the other dialects.
        "saev_format": _saev_format(md),
        "pixel_agg": md.pixel_agg,
        "family": md.family,
        "ckpt": md.ckpt,
        "dataset": md.dataset,
        "data": md.data,
        "shape": list(md.shape),
        "dtype": md.dtype,
        # float8_e4m3 values are read dequantized, as float16 unless another dtype is asked for.
        "read_dtype": shards.read_dtype,
        "layers": list(md.layers),
        # Protocol 3.2: what each layer slot holds, "module:input" or "module:output" (None: block outputs).
        "sites": None if md.sites is None else [str(site) for site in md.sites],
        "patches_per_ex": md.patches_per_ex,
        "cls_token": md.cls_token,
        "tokens_per_ex": md.tokens_per_ex,
        "d_model": md.d_model,
        "n_examples": md.n_examples,
        "patches_per_shard": md.patches_per_shard,
        "examples_per_shard": md.examples_per_shard,
        "n_shards": shards.n_shards,
        "nbytes": md.nbytes,
        "scales_nbytes": md.scales_nbytes,
        "disk_nbytes": shards.files.footprint(),
        "checksums": all(d is not None for _, _, d in man.files()),
        # Protocol 3.1: the bytes each digest of blocks.json covers (None without blocks.json).
        "block_size": shards.block_size,
        "shards": [
            {"name": s.name, "n_examples": s.n_examples, "nbytes": s.nbytes, "xxh3_128": s.xxh3_128} for s in man.shards
        ],
        "labels": None if man.labels is None else {"dtype": _dtype(man.labels.dtype), "shape": list(man.labels.shape)},
        "columns": {k: {"dtype": _dtype(c.dtype), "shape": list(c.shape)} for k, c in sorted(man.columns.items())},
        "text": {k: {"n_lines": t.n_lines} for k, t in sorted(man.text.items())},
        "stats": per_layer,
        # Where they come from: the cache's stats.json, or a sidecar written by `saev-shards stats`.
        "stats_file": None if stats is None else _stats_file(shards),
    }


def _saev_format(md: Metadata) -> dict[str, Any] | None:
    fmt = md.rules
    if not fmt.history:
        return None
    return {
        "summary": fmt.summary,
        "seed": md.seed,
        "lacks": list(fmt.lacks),
        "name_rule": fmt.name_rule(),
        "verify_checks": f"the file sizes, the name ({fmt.name_rule()}), the zero padding",
        "verify_cannot": "the values (saev recorded no checksums)",
    }


def _stats_file(shards: reader.Shards) -> str:
    entry = shards.manifest.stats
    return shards.files.where(entry.name) if entry is not None else sidecar_location(shards)


def _remote_verification(shards: reader.Shards) -> str | None:
    """How reads of a remote cache are checked: ``"per block"`` or ``"per file"``; None where
    reads are not checked (a local cache: `verify` checks it)."""
    files = shards.files
    if not files.verifies_reads:
        return None
    names = [name for name, _, _ in shards.manifest.blocked_files()]
    return "per block" if names and all(files.per_block(n) for n in names) else "per file"


def _dtype(spelling: str) -> str:
    return np.dtype(spelling).name  # "|u1" -> "uint8": the manifest's spelling is for machines
