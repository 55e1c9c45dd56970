"""Commands over caches: ``info``, ``ls``, ``verify``, ``report``, ``stats``, ``resolve``."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import orjson

from .. import store
from ..errors import CommandError
from ..humanize import human_age, human_bytes
from ..protocol.common import UNVERSIONED
from ._common import (
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_PROBLEM,
    EXIT_USAGE,
    REF_HELP,
    add_progress,
    add_roots,
    command,
    plural,
    print_json,
    progress_arg,
    roots_arg,
    table,
    warn,
)


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


# --------------------------------------------------------------------------------------
# ls


def _cache_table(
    entries: Sequence[Any], out: TextIO, problem: Callable[[Any], str], shards_from_metadata: bool = False
) -> None:
    """The caches of one root as `ls` shows them, one row each (local and remote roots alike);
    ``problem`` gives a broken cache's status text."""
    rows = [("HASH", "MODEL", "DTYPE", "SHAPE", "SHARDS", "SIZE", "STATUS")]
    for e in entries:
        md = e.metadata
        n_shards = e.n_shards
        if n_shards is None and shards_from_metadata and md:
            n_shards = md.n_shards
        rows.append(
            (
                e.hash[:12],
                f"{md.family}:{md.ckpt}" if md else "?",
                md.dtype if md else "?",
                f"({', '.join(map(str, md.shape))})" if md else "?",
                str(n_shards if n_shards is not None else "?"),
                human_bytes(e.nbytes),
                "ok" if e.ok else "BROKEN: " + problem(e),
            )
        )
    table(rows, out, indent="  ")


def _short_problem(entry: store.CacheEntry) -> str:
    """One line for a table cell: paths inside the cache are shown by file name."""
    text = entry.problem or ""
    text = text.replace(f"{entry.path}/", "").replace(f"{entry.path}: ", "")
    lines = [line.strip(" -") for line in text.splitlines() if line.strip()]
    if len(lines) > 1:  # "N problems" followed by grouped details: keep the count and the first
        return f"{lines[0]}, first: {lines[2] if len(lines) > 2 else lines[1]}"
    return lines[0] if lines else "?"


def cmd_ls(args: argparse.Namespace) -> int:
    remote = store.remote_roots(args.roots or None)
    code = EXIT_OK
    if remote:
        code = _ls_remote(remote, args.json)
        if args.roots and not store.local_roots(args.roots):
            return code
    roots = store.shards_roots(store.local_roots(args.roots or None))
    out = sys.stdout
    if remote and not args.json:
        out.write("\n")
    listing = []
    for root in roots:
        exists = root.path.is_dir()
        entries = store.list_caches(root.path) if exists else []
        unpublished = [u for u in store.unpublished(root.path) if u.kind != "lock"] if exists else []
        listing.append((root, exists, entries, unpublished))
        if any(not e.ok for e in entries):
            code = EXIT_PROBLEM
        if not exists and root.source == "argument":
            code = max(code, EXIT_NOT_FOUND)
    if args.json:
        print_json(
            [
                {
                    "root": str(root.path),
                    "source": root.source,
                    "exists": exists,
                    "caches": [_entry_json(e) for e in entries],
                    "unpublished": [
                        {
                            "path": str(u.path),
                            "kind": u.kind,
                            "nbytes": u.nbytes,
                            "age_s": round(u.age),
                            "live": u.live,
                            "resumable": u.resumable,
                            "sealed": u.sealed,
                            "n_shards": u.n_shards,
                        }
                        for u in unpublished
                    ],
                }
                for root, exists, entries, unpublished in listing
            ],
            out,
        )
        return code
    for i, (root, exists, entries, unpublished) in enumerate(listing):
        if i:
            out.write("\n")
        if not exists:
            out.write(f"{root.path} ({root.source}): no such directory\n")
            continue
        total = sum(e.nbytes for e in entries)
        broken = sum(not e.ok for e in entries)
        out.write(
            f"{root.path} ({root.source}): {plural(len(entries), 'cache')}, {human_bytes(total)}"
            + (f", {broken} broken" if broken else "")
            + "\n"
        )
        if entries:
            _cache_table(entries, out, _short_problem, shards_from_metadata=True)
        for u in unpublished:
            what = store.KIND_NAMES[u.kind]
            out.write(
                f"  unpublished (being written, or interrupted): {u.path.name}  "
                f"{what}, {human_bytes(u.nbytes)}, {human_age(u.age)} old, {u.state}\n"
            )
    return code


def _ls_remote(roots: list[str], as_json: bool) -> int:
    """``ls`` of remote roots: one listing each, every published cache opened (its JSON files)."""
    out = sys.stdout
    code = EXIT_OK
    found = []
    for root in roots:
        entries = store.list_remote(root)
        found.append((root, entries))
        if any(e.published and not e.ok for e in entries):
            code = EXIT_PROBLEM
    if as_json:
        print_json(
            [
                {
                    "root": root,
                    "caches": [
                        {
                            "hash": e.hash,
                            "url": e.url,
                            "ok": e.ok,
                            "published": e.published,
                            "problem": e.problem,
                            "nbytes": e.nbytes,
                            "n_shards": e.n_shards,
                            "shape": list(e.metadata.shape) if e.metadata else None,
                            "dtype": e.metadata.dtype if e.metadata else None,
                        }
                        for e in entries
                    ],
                }
                for root, entries in found
            ],
            out,
        )
        return code
    for i, (root, entries) in enumerate(found):
        if i:
            out.write("\n")
        published = [e for e in entries if e.published]
        total = sum(e.nbytes for e in published)
        out.write(f"{root}: {plural(len(published), 'cache')}, {human_bytes(total)}\n")
        if not entries:  # a bucket's top, or a folder above the shards root: say where the caches are
            below = store.nested_roots(root)
            if below:
                out.write(
                    "  no cache directly here; shards roots below it (a root is the folder that holds the "
                    "<HASH> folders):\n" + "".join(f"    saev-shards ls {url}\n" for url in below)
                )
        if published:
            _cache_table(published, out, lambda e: (e.problem or "?").splitlines()[0])
        for e in entries:
            if not e.published:
                out.write(
                    f"  unpublished (an upload in progress, or interrupted): {e.hash[:12]}  {human_bytes(e.nbytes)}, "
                    "no shards.json: `saev-shards push` again completes it\n"
                )
    return code


def _entry_json(e: store.CacheEntry) -> dict[str, Any]:
    md = e.metadata
    return {
        "hash": e.hash,
        "path": str(e.path),
        "ok": e.ok,
        "problem": e.problem,
        "nbytes": e.nbytes,
        "n_shards": e.n_shards,
        "protocol": md.protocol if md else None,
        "family": md.family if md else None,
        "ckpt": md.ckpt if md else None,
        "dtype": md.dtype if md else None,
        "shape": list(md.shape) if md else None,
        "layers": list(md.layers) if md else None,
    }


# --------------------------------------------------------------------------------------
# verify, resolve, stage


def cmd_report(args: argparse.Namespace) -> int:
    shards = store.open_cache(args.ref, roots=roots_arg(args))
    out = Path(args.out) if args.out else Path(f"report-{shards.metadata.hash[:12]}.png")
    if out.suffix.lower() not in (".png", ".html", ".htm"):
        raise CommandError(EXIT_USAGE, f"--out: expected a file ending in .png or .html, found {str(out)!r}")
    result = shards.report(out, progress=progress_arg(args))
    for layer in result.layers:
        listed = ", ".join(map(str, result.outliers[layer])) or "none"
        site = shards.metadata.site_of(layer)
        name = f"layer {layer}" + (f" ({site})" if site is not None else "")
        sys.stderr.write(f"{name}: median norm {result.median_norm(layer):.4g}; outlier dimensions: {listed}\n")
    if result.truncated is not None and result.lengths is not None:
        sys.stderr.write(
            f"truncated to T={result.tokens_per_ex}: {result.truncated} of {len(result.lengths)} examples\n"
        )
    sys.stdout.write(f"{out.absolute()}\n")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    shards = store.open_cache(args.ref, roots=roots_arg(args))
    files = shards.manifest.files()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nbytes = shards.verify(progress=progress_arg(args))
    for w in caught:
        warn(str(w.message))
    unchecked = any(digest is None for _, _, digest in files)
    checked = "sizes and zero padding only (no checksums recorded)" if unchecked else "sizes, xxh3_128 checksums"
    scales = "; every float8_e4m3 scale is one the scale rule gives" if shards.manifest.scales else ""
    sys.stdout.write(
        f"ok {shards.location}\n   {len(files)} files, {nbytes:,} bytes ({human_bytes(nbytes)}): "
        f"{checked} and the metadata hash match{scales}\n"
    )
    return EXIT_OK


def cmd_stats(args: argparse.Namespace) -> int:
    shards = store.open_cache(args.ref, roots=roots_arg(args))
    err = sys.stderr
    name = shards.path.name[:12]
    if shards.manifest.stats is not None:
        err.write(f"{name}: has statistics of its own (stats.json), nothing to compute\n")
        sys.stdout.write(f"{shards.files.where(shards.manifest.stats.name)}\n")
        return EXIT_OK
    path = store.sidecar_path(shards)
    where = store.sidecar.sidecar_location(shards)
    if path.exists() and not args.force:
        store.find_stats(shards)  # a damaged or stale sidecar is an error naming it
        err.write(f"{name}: statistics already computed and verified, nothing to do (--force computes again)\n")
        sys.stdout.write(f"{where}\n")
        return EXIT_OK
    stats = store.compute_stats(shards, progress=progress_arg(args))
    store.write_sidecar(shards, stats)
    tokens = sum(stats["count"])
    layers = plural(len(stats["layers"]), "layer")
    err.write(f"{name}: statistics of {tokens:,} tokens over {layers} written beside the cache\n")
    sys.stdout.write(f"{where}\n")
    return EXIT_OK


def cmd_resolve(args: argparse.Namespace) -> int:
    sys.stdout.write(f"{store.find_cache(args.ref, roots_arg(args))}\n")
    return EXIT_OK


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], invoked: str | None) -> None:
    """Add this module's commands to the ``saev-shards`` parser."""
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

    p = command(
        sub,
        "ls",
        "list the caches in the shards root(s) with key metadata and sizes (exit 1 if one is broken)",
        "  saev-shards ls\n  saev-shards ls /scratch/me/saev/shards $TMPDIR/saev/shards\n  saev-shards ls --json\n",
        cmd_ls,
        description=(
            "List the caches in the shards roots with key metadata and sizes. Each cache is opened, so "
            "missing or truncated files show as BROKEN (checksums are `verify`'s job). Staging and "
            "partial-copy folders are listed as unpublished, not as caches."
        ),
    )
    p.add_argument("roots", nargs="*", metavar="ROOT", help="shards roots (default: as for --root of other commands)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")

    p = command(
        sub,
        "verify",
        "check every file's size and xxh3_128 checksum and the metadata hash (exit 1 on any problem)",
        "  saev-shards verify 3f2a\n  saev-shards verify /scratch/me/saev/shards/3f2a9c... --progress\n",
        cmd_verify,
    )
    p.add_argument("ref", help=REF_HELP)
    add_roots(p)
    add_progress(p)
    _register_derived(sub)


def _register_derived(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``report``, ``stats`` and ``resolve``: what is drawn, computed or found for a cache."""
    p = command(
        sub,
        "report",
        "one picture of a cache: norms by layer, dimensions with outliers marked, CLS and content tokens, "
        "lengths and truncation, shard sizes (needs the plot extra)",
        "  saev-shards report 3f2a                       # report-<hash>.png here; its path on stdout\n"
        "  saev-shards report 3f2a --out 3f2a.html       # the picture and the numbers in one page\n",
        cmd_report,
    )
    p.add_argument("ref", help=REF_HELP)
    p.add_argument("--out", metavar="FILE", help="FILE.png or FILE.html (default: report-<hash>.png here)")
    add_roots(p)
    add_progress(p)

    p = command(
        sub,
        "stats",
        "compute per-layer statistics for a cache written without them, into a verified sidecar beside it",
        "  saev-shards stats 3f2a --progress\n"
        "  saev-shards info 3f2a                  # now shows them; so does Shards.stats\n",
        cmd_stats,
        description=(
            "Compute the per-layer statistics of a cache written without them (stats.json, protocol.md 2.6: "
            "mean, variance and norms over stored tokens, padding excluded by a lengths column) and write "
            "them to <root>/.stats/<hash>.json beside the cache, which stays untouched (published caches are "
            "immutable). The sidecar records the cache's hash, the digest of its shards.json and of the "
            "numbers; Shards.stats, info and loaders find it and check all three. Prints the sidecar's path."
        ),
    )
    p.add_argument("ref", help=REF_HELP)
    p.add_argument("--force", action="store_true", help="compute again even if a sidecar exists")
    p.set_defaults(interrupted_hint="nothing was written: run the same command again to start over")
    add_roots(p)
    add_progress(p)

    p = command(
        sub,
        "resolve",
        "print the absolute path of the cache a path, hash or unique prefix names",
        '  saev-shards resolve 3f2a\n  cd "$(saev-shards resolve 3f2a)"\n',
        cmd_resolve,
    )
    p.add_argument("ref", help=REF_HELP)
    add_roots(p)
