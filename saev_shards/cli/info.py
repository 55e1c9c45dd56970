"""``saev-shards info``: a readable summary of one cache (its rows, or JSON)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import orjson

from .. import store
from ..humanize import human_bytes
from ..protocol.common import UNVERSIONED
from ._common import EXIT_OK, REF_HELP, add_roots, command, print_json, roots_arg, table


def cmd_info(args: argparse.Namespace) -> int:
    shards = store.open_cache(args.ref, roots=roots_arg(args))
    info = store.summary(shards)
    out = sys.stdout
    if args.json:
        print_json(info, out)
        return EXIT_OK
    n, layers, tokens, d = info["shape"]
    itemsize = shards.metadata.itemsize
    shard_list = shards.manifest.shards
    partial_last = shard_list and shard_list[-1].n_examples != info["examples_per_shard"]
    last = f" (last: {shard_list[-1].n_examples})" if partial_last else ""
    data = orjson.dumps(info["data"]).decode()
    saev = info["saev_format"]
    rows = [
        ("cache", info["hash"]),
        ("path", info["path"]),
        *(_saev_format_rows(info) if saev is not None else [("protocol", _protocol_row(info))]),
        *([("pixel_agg", info["pixel_agg"])] if info["pixel_agg"] is not None else []),
        ("model", f"{info['family']} {info['ckpt']}"),
        ("dataset", info["dataset"] or "-"),
        ("data", data if len(data) <= 100 else data[:97] + "..."),
        ("shape", f"({n}, {layers}, {tokens}, {d})  examples x layers x tokens x d_model"),
        ("dtype", _dtype_row(info, itemsize)),
        ("layers", str(info["layers"])),
        *([("sites", _sites_row(info))] if info["sites"] is not None else []),
        ("tokens", _tokens_row(info)),
        ("shards", f"{info['n_shards']} x {info['examples_per_shard']} examples{last}"),
        (
            "bytes",
            f"{info['nbytes']:,} bytes of activations ({human_bytes(info['nbytes'])}), "
            + (f"{human_bytes(info['scales_nbytes'])} of scales, " if info["scales_nbytes"] else "")
            + f"{human_bytes(info['disk_nbytes'])} on disk",
        ),
        ("checksums", _checksums_row(info)),
        *([("verify", f"checks {saev['verify_checks']}; cannot check {saev['verify_cannot']}")] if saev else []),
        *([("remote reads", _remote_row(info))] if info["url"] is not None else []),
        ("labels", "-" if info["labels"] is None else f"{info['labels']['dtype']} {tuple(info['labels']['shape'])}"),
        ("columns", ", ".join(f"{k} {c['dtype']} {tuple(c['shape'])}" for k, c in info["columns"].items()) or "-"),
        ("text", ", ".join(f"{k} ({t['n_lines']:,} lines)" for k, t in info["text"].items()) or "-"),
        ("stats", "-" if info["stats"] is None else _stats_row(info)),
    ]
    table(rows, out)
    if info["stats"] is not None:
        per_layer = [("layer", "tokens", "mean |x|", "mean |x|^2", "mean var", "non-finite")]
        per_layer += [
            (
                str(s["layer"]),
                f"{s['count']:,}",
                f"{s['norm_mean']:.4g}",
                f"{s['norm_sq_mean']:.4g}",
                f"{s['var_mean']:.4g}",
                f"{s['nonfinite']:,}",
            )
            for s in info["stats"]
        ]
        table(per_layer, out, indent="  ", right=range(1, 6))
    return EXIT_OK


def _saev_format_rows(info: dict[str, Any]) -> list[tuple[str, str]]:
    """One of saev's earlier formats: which, read in place, and what it does not record."""
    saev = info["saev_format"]
    protocol = "none (saev had not versioned its format yet)" if info["protocol"] == UNVERSIONED else info["protocol"]
    return [
        ("format", f"{saev['summary']}: one of saev's earlier formats, read in place (dialect {info['dialect']})"),
        ("protocol", protocol),
        ("lacks", "; ".join(saev["lacks"])),
        *([("seed", str(saev["seed"]))] if saev["seed"] is not None else []),
    ]


def _dtype_row(info: dict[str, Any], itemsize: int) -> str:
    if info["dtype"] != info["read_dtype"]:  # float8_e4m3
        return f"{info['dtype']} ({itemsize} byte per value, a float32 scale per vector; read as {info['read_dtype']})"
    return f"{info['dtype']} ({itemsize} bytes per value)"


def _checksums_row(info: dict[str, Any]) -> str:
    if not info["checksums"] and info["saev_format"] is not None:
        return "none recorded (saev recorded none then)"
    if not info["checksums"]:
        return "none recorded: verify checks sizes and the zero padding (protocol 2.1)"
    if info["block_size"] is not None:
        size = info["block_size"]
        block = f"{size >> 20} MiB" if size % (1 << 20) == 0 else f"{size >> 10} KiB"  # powers of two
        return f"xxh3_128 for every file and every {block} block of it (blocks.json)"
    return "xxh3_128 for every file"


def _remote_row(info: dict[str, Any]) -> str:
    if info["remote_verification"] == "per block":
        return "every block checked against its digest (blocks.json) before use"
    return (
        "checked per whole file (no blocks.json: a protocol 3.0 cache): the first read of a file "
        "downloads and checks all of it"
    )


def _sites_row(info: dict[str, Any]) -> str:
    """What each layer slot holds (protocol 3.2): ``0 encoder.layer.3.intermediate:input, 1 ...``."""
    return ", ".join(f"{layer} {site}" for layer, site in zip(info["layers"], info["sites"], strict=True))


def _protocol_row(info: dict[str, Any]) -> str:
    """``3.0`` for the protocol's own spelling; the dialect too where it is one of saev's."""
    if info["dialect"] == info["protocol"]:
        return str(info["protocol"])
    return f"{info['protocol']}, dialect {info['dialect']} ({info['dialect_summary']})"


def _tokens_row(info: dict[str, Any]) -> str:
    tokens, patches = info["tokens_per_ex"], info["patches_per_ex"]
    if info["cls_token"]:
        return f"{tokens} per example (CLS + {patches})"
    return f"{tokens} per example ({patches} patches, no CLS token)"


def _stats_row(info: dict[str, Any]) -> str:
    sidecar = not info["stats_file"].startswith(info["path"].rstrip("/") + "/")
    return "per layer, over stored tokens" + (f" (computed later: {info['stats_file']}):" if sidecar else ":")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], invoked: str | None) -> None:
    """Add ``info`` to the ``saev-shards`` parser."""
    p = command(
        sub,
        "info",
        "show a readable summary of a cache: shape, dtype, layers, tokens, shards, bytes, labels, columns, stats",
        "  saev-shards info 3f2a\n"
        "  saev-shards info /scratch/me/saev/shards/3f2a9c...   # a path works too\n"
        "  saev-shards info 3f2a --json | jq .n_examples\n",
        cmd_info,
    )
    p.add_argument("ref", help=REF_HELP)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    add_roots(p)
