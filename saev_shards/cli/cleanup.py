"""Commands that delete: ``rm`` (published caches) and ``clean`` (stale staging, copies and shuffle scratch).

Both follow one rule: they list what they would delete, with sizes, then ask; ``--yes``
deletes without asking, ``--dry-run`` only lists. An answer other than ``y``/``yes`` (or
no answer: stdin closed) deletes nothing and exits 1, so a script that forgot ``--yes``
fails loudly instead of reporting success.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from .. import store
from ..errors import CommandError, RootNotSetError
from ..humanize import human_age, human_bytes
from ..protocol import is_cache_name
from ..storage.url import is_url, split_url
from ._common import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, REF_HELP, add_roots, command, plural, roots_arg, table, warn


def _confirm(question: str, args: argparse.Namespace) -> None:
    """Return if deleting may go ahead; raise `CommandError` (exit 1) when not confirmed."""
    if args.yes:
        return
    sys.stderr.write(f"{question} [y/N] ")
    sys.stderr.flush()
    answer = sys.stdin.readline()
    if answer.strip().lower() not in ("y", "yes"):
        if not answer:
            sys.stderr.write("\n")
        raise CommandError(EXIT_PROBLEM, "nothing removed: not confirmed (pass --yes to remove without asking)")


def _add_confirm_options(p: argparse.ArgumentParser) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("-y", "--yes", action="store_true", help="remove without asking")
    group.add_argument("-n", "--dry-run", action="store_true", help="only list what would be removed")


# --------------------------------------------------------------------------------------
# rm


def cmd_rm(args: argparse.Namespace) -> int:
    # Resolve every reference first: a typo in the third deletes nothing.
    urls = list(dict.fromkeys(store.resolve_remote(ref) for ref in args.refs if is_url(ref)))
    paths = list(dict.fromkeys(store.resolve(ref, roots_arg(args)) for ref in args.refs if not is_url(ref)))
    for url in urls:
        if not is_cache_name(split_url(url)[1]):
            raise CommandError(
                EXIT_USAGE, f"refusing to remove {url}: expected a cache URL ending in its hash (or a hash prefix)"
            )
    remote = {url: store.remote_objects(url) for url in urls}
    for p in paths:
        if not is_cache_name(p.name):  # a path given directly: it must be named like a cache
            raise CommandError(
                EXIT_USAGE, f"refusing to remove {p}: expected a cache directory named by its hash (64 or 8 hex digits)"
            )
    try:
        links = {p: store.runs_linking(p, args.runs_root) for p in paths}
    except RootNotSetError as err:
        if not args.force:
            raise CommandError(
                EXIT_PROBLEM,
                f"cannot check which runs link to {plural(len(paths), 'cache')}: {err}; "
                "pass --force to remove without checking",
            ) from None
        warn(f"not checked which runs link to them: {err}")
        links = {p: [] for p in paths}
    linked = {p: runs for p, runs in links.items() if runs}
    if linked and not args.force:
        lines = [
            f"{p.name[:12]}: " + ", ".join(f"{run.path}/links/{name}" for run, name in runs)
            for p, runs in linked.items()
        ]
        raise CommandError(
            EXIT_PROBLEM,
            f"refusing to remove {plural(len(linked), 'cache')} that runs link to "
            "(pass --force to remove anyway; those links then dangle): " + "; ".join(lines),
        )
    in_use = {p: store.users(p) for p in paths}
    if not args.force:
        for p in paths:  # before asking: the processes are named, nothing is removed
            store.check_not_in_use(p)
    sizes = {p: store.folder_nbytes(p) for p in paths}
    note = {p: f"  (linked by {plural(len(runs), 'run link')})" for p, runs in linked.items()}
    for p, holders in in_use.items():
        if holders:
            note[p] = (
                note.get(p, "")
                + f"  (in use by {plural(len(holders), 'process')}: pids "
                + ", ".join(str(h.pid) for h in holders)
                + ")"
            )
    rows = [(p.name[:12], human_bytes(sizes[p]), str(p) + note.get(p, "")) for p in paths]
    rows += [
        (split_url(url)[1][:12], human_bytes(sum(objects.values())), f"{url}  ({plural(len(objects), 'object')})")
        for url, objects in remote.items()
    ]
    nbytes = sum(sizes.values()) + sum(sum(objects.values()) for objects in remote.values())
    total = f"{plural(len(paths) + len(urls), 'cache')}, {human_bytes(nbytes)}"
    out = sys.stdout
    out.write(("would remove " if args.dry_run else "to remove: ") + total + "\n")
    table(rows, out, indent="  ")
    if urls:
        out.write("  (readers of a remote cache on other machines are not seen: they fail at their next read)\n")
    if args.dry_run:
        return EXIT_OK
    out.flush()
    _confirm(f"remove {total}?", args)
    for p in paths:
        store.remove(p, force=args.force)
        out.write(f"removed {p}\n")
    for url in urls:
        store.remove_remote(url)
        out.write(f"removed {url}\n")
    return EXIT_OK


# --------------------------------------------------------------------------------------
# clean


def _clean_roots(args: argparse.Namespace) -> list[Path]:
    """The given roots, else every shards root and the stage root (copies live in both)."""
    if args.roots:
        return [Path(r).expanduser().absolute() for r in args.roots]
    found: list[Path] = []
    with contextlib.suppress(RootNotSetError):  # no shards root: the stage root only
        found += [r.path for r in store.shards_roots()]
    found.append(store.stage_root().path)
    return list(dict.fromkeys(found))


def cmd_clean(args: argparse.Namespace) -> int:
    items = [u for root in _clean_roots(args) for u in store.unpublished(root)]
    stale = [u for u in items if not u.live]
    live = [u for u in items if u.live]
    out = sys.stdout
    for u in live:
        out.write(f"keeping {u.path}: a live process holds its lock (a writer or a copy at work), or it is not yours\n")
    if not stale:
        out.write("nothing to clean: no stale staging, copy or shuffle folders\n")
        return EXIT_OK
    rows = [
        (
            store.KIND_NAMES[u.kind],
            human_bytes(u.nbytes),
            f"{human_age(u.age)} old",
            _resumable_note(u) if u.resumable else "nothing to resume",
            str(u.path),
        )
        for u in stale
    ]
    resumable = sum(u.resumable for u in stale)
    total = f"{plural(len(stale), 'stale folder')}, {human_bytes(sum(u.nbytes for u in stale))}"
    them = "it" if resumable == 1 else "them"
    warning = (
        f" ({resumable} of them interrupted with work a rerun would resume: removing {them} starts it over)"
        if resumable
        else ""
    )
    out.write(("would remove " if args.dry_run else "to remove: ") + total + warning + "\n")
    table(rows, out, indent="  ", right=(1,))
    if args.dry_run:
        return EXIT_OK
    out.flush()
    holds = "1 of them holds" if resumable == 1 else f"{resumable} of them hold"
    question = f"remove {total}?" + (f" {holds} resumable work, which would start over" if resumable else "")
    _confirm(question, args)
    for u in stale:
        if store.remove_unpublished(u):
            out.write(f"removed {u.path}\n")
        else:
            out.write(f"kept {u.path}: a writer took its lock meanwhile\n")
    return EXIT_OK


def _resumable_note(u: store.Unpublished) -> str:
    """``resumable: 3 of 5 shards sealed`` (what a rerun would keep)."""
    if u.kind == "staging":
        return f"resumable: {u.sealed} of {u.n_shards if u.n_shards is not None else '?'} shards sealed"
    return f"resumable: {human_bytes(u.nbytes)} kept"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], invoked: str | None) -> None:
    """Add ``rm`` and ``clean`` to the ``saev-shards`` parser."""
    p = command(
        sub,
        "rm",
        "remove published caches (read-only folders too), refusing those a run links to or a process uses "
        "unless --force",
        "  saev-shards rm 3f2a                  # lists it with its size, then asks\n"
        "  saev-shards rm 3f2a 9c1d --yes       # no question\n"
        "  saev-shards rm 3f2a --dry-run        # only list\n"
        "  saev-shards rm s3://bucket/shards/3f2a   # a cache in an object store (shards.json first)\n",
        cmd_rm,
        description=(
            "Remove published caches. Every reference is resolved first (a mistake removes nothing); "
            "a cache that a run under the runs root links to (links/train-shards, links/val-shards) is refused "
            "unless --force (exit 1), and so is a cache in use: a reader or a training loader holds its lock "
            "(a shared flock on the cache folder, held while it is open) or has its files open or mapped; the "
            "processes are named (exit 4). Lists what it would remove with sizes and asks; --yes removes without "
            "asking, --dry-run only lists. Not confirmed: nothing removed, exit 1. A URL (s3://..., a hash prefix "
            "resolved in its root) removes that remote cache: its shards.json first, so that no reader or listing "
            "takes the rest for a cache, then its other objects and its statistics sidecar; runs and readers on "
            "other machines are not checked."
        ),
    )
    p.add_argument("refs", nargs="+", metavar="REF", help=REF_HELP)
    _add_confirm_options(p)
    p.add_argument(
        "--force",
        action="store_true",
        help="remove caches even if runs link to them or processes use them (those then fail at their next read)",
    )
    p.add_argument("--runs-root", metavar="DIR", help="where runs live (default: $SAEV_RUNS_ROOT, $SAEV_NFS/saev/runs)")
    add_roots(p)

    p = command(
        sub,
        "clean",
        "remove stale staging, partial-copy and shuffle scratch folders (their writer is gone), with sizes and ages",
        "  saev-shards clean --dry-run          # what is stale, how big, how old\n"
        "  saev-shards clean                    # lists, then asks\n"
        "  saev-shards clean /local/ssd/saev/shards --yes\n",
        cmd_clean,
        description=(
            "Remove .staging-<hash> folders (and their lock files), .copying-<hash> folders and the "
            ".shuffle-<hash> scratch folders of shuffles whose writer is gone: a live writer, copy or shuffle "
            "holds an flock on its lock, and such folders are kept. Looks in the "
            "given roots, else in every shards root and the stage root. Lists what it would remove with sizes "
            "and ages and asks; --yes removes without asking, --dry-run only lists. Removing the staging folder "
            "of an interrupted dump means it starts over instead of resuming."
        ),
    )
    p.add_argument(
        "roots", nargs="*", metavar="ROOT", help="roots to clean (default: the shards roots and the stage root)"
    )
    _add_confirm_options(p)
