"""``saev-shards ls``: the caches of the shards roots (local and remote), with key metadata and sizes."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from .. import store
from ..humanize import human_age, human_bytes
from ._common import EXIT_NOT_FOUND, EXIT_OK, EXIT_PROBLEM, command, plural, print_json, table


def _cache_table(
    entries: Sequence[Any], out: TextIO, problem: Callable[[Any], str], shards_from_metadata: bool = False
) -> None:
    """The caches of one root as `ls` shows them, one row each (local and remote roots alike);
    ``problem`` gives a broken cache's status text."""
    rows = [("HASH", "MODEL", "FORMAT", "DTYPE", "SHAPE", "SHARDS", "SIZE", "STATUS")]
    for e in entries:
        md = e.metadata
        n_shards = e.n_shards
        if n_shards is None and shards_from_metadata and md:
            n_shards = md.n_shards
        rows.append(
            (
                e.hash[:12],
                f"{md.family}:{md.ckpt}" if md else "?",
                md.dialect if md else "?",
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
                            "dialect": e.metadata.dialect if e.metadata else None,
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
        "dialect": md.dialect if md else None,
        "family": md.family if md else None,
        "ckpt": md.ckpt if md else None,
        "dtype": md.dtype if md else None,
        "shape": list(md.shape) if md else None,
        "layers": list(md.layers) if md else None,
    }


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], invoked: str | None) -> None:
    """Add ``ls`` to the ``saev-shards`` parser."""
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
