"""Commands over one cache: ``verify``, ``report``, ``stats``, ``resolve`` (``info`` and ``ls`` are
modules of their own, ``stage`` is `transfer`'s)."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from .. import store
from ..errors import CommandError
from ..humanize import human_bytes
from ._common import (
    EXIT_OK,
    EXIT_USAGE,
    REF_HELP,
    add_progress,
    add_roots,
    command,
    plural,
    progress_arg,
    roots_arg,
    warn,
)


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
    """Add this module's commands to the ``saev-shards`` parser: ``verify``, ``report``, ``stats`` and
    ``resolve`` (``info`` and ``ls`` have modules of their own, ``stage`` is `transfer`'s)."""
    for add in (_add_verify, _add_report, _add_stats, _add_resolve):
        add(sub)


def _add_verify(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def _add_report(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def _add_stats(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def _add_resolve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = command(
        sub,
        "resolve",
        "print the absolute path of the cache a path, hash or unique prefix names",
        '  saev-shards resolve 3f2a\n  cd "$(saev-shards resolve 3f2a)"\n',
        cmd_resolve,
    )
    p.add_argument("ref", help=REF_HELP)
    add_roots(p)
