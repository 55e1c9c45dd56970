"""``saev-shards``: inspect, verify, find and stage caches; create and check runs.

Every command is a small function over `saev_shards.store` and `saev_shards.open`; this
module only parses arguments, prints, and turns errors into one line and an exit code.
It never imports torch: ``dump`` (which needs it) is imported only when it is invoked.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import orjson

from . import __version__, store
from .errors import (
    CacheRefError,
    InvalidCacheError,
    RootNotSetError,
    RunError,
    RunExistsError,
    RunNotFoundError,
    ShardsError,
    UnknownCacheError,
    WriterBusyError,
)
from .reader import Shards
from .reader import open as open_cache

PROG = "saev-shards"

# Exit codes: documented in --help (EXIT_CODES_HELP) and docs/cli.md.
EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_SYSTEM = 4
EXIT_INTERNAL = 5
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what shells report for a C tool whose reader went away

EXIT_CODES_HELP = """\
exit codes:
  0    success
  1    a problem was found: a cache is invalid or fails verification, a run has errors
  2    usage error: bad arguments, no root configured, a command not installed
  3    not found: no cache or run matches, or a hash prefix is ambiguous or too short
  4    system error: permission denied, disk full, another process holds the cache
  5    internal error: a bug (rerun with --debug and report the traceback)
  130  interrupted (Ctrl-C); `stage` resumes where it stopped when run again
  141  the reader of the output went away (e.g. `| head`); nothing is printed
"""

ROOTS_HELP = """\
roots:
  shards: --root DIR (repeatable) > $SAEV_SHARDS_ROOT (':'-separated, searched in order)
          > $SAEV_SCRATCH/saev/shards
  runs:   --runs-root DIR > $SAEV_RUNS_ROOT > $SAEV_NFS/saev/runs
  stage:  --to DIR > $SAEV_STAGE_ROOT > $TMPDIR/saev/shards
"""


class _Failure(Exception):
    """A command's own verdict: print ``message`` as an error and exit with ``code``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------------------
# formatting


def human_bytes(n: float) -> str:
    """Decimal units, as `Shards.__repr__` and the progress bar print them: ``3.7 KB``."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _table(rows: Sequence[Sequence[str]], out: TextIO, indent: str = "", right: Sequence[int] = ()) -> None:
    """Columns padded to their widest cell; the columns numbered in ``right`` (numbers) right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        out.write(indent + "  ".join(cells).rstrip() + "\n")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _json(obj: Any, out: TextIO) -> None:
    out.write(orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode() + "\n")


def _disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _progress(args: argparse.Namespace) -> bool | None:
    value: bool | None = args.progress
    return value  # None: only when stderr is a terminal


def _roots(args: argparse.Namespace) -> list[str] | None:
    roots: list[str] | None = args.root
    return roots


# --------------------------------------------------------------------------------------
# info


def _cache_summary(shards: Shards) -> dict[str, Any]:
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
        "path": str(shards.path),
        "protocol": md.protocol,
        "family": md.family,
        "ckpt": md.ckpt,
        "dataset": md.dataset,
        "data": md.data,
        "shape": list(md.shape),
        "dtype": md.dtype,
        "layers": list(md.layers),
        "patches_per_ex": md.patches_per_ex,
        "cls_token": md.cls_token,
        "tokens_per_ex": md.tokens_per_ex,
        "d_model": md.d_model,
        "n_examples": md.n_examples,
        "patches_per_shard": md.patches_per_shard,
        "examples_per_shard": md.examples_per_shard,
        "n_shards": shards.n_shards,
        "nbytes": md.nbytes,
        "disk_nbytes": _disk_bytes(shards.path),
        "checksums": all(d is not None for _, _, d in man.files()),
        "shards": [
            {"name": s.name, "n_examples": s.n_examples, "nbytes": s.nbytes, "xxh3_128": s.xxh3_128} for s in man.shards
        ],
        "labels": None if man.labels is None else {"dtype": _dtype(man.labels.dtype), "shape": list(man.labels.shape)},
        "columns": {k: {"dtype": _dtype(c.dtype), "shape": list(c.shape)} for k, c in sorted(man.columns.items())},
        "text": {k: {"n_lines": t.n_lines} for k, t in sorted(man.text.items())},
        "stats": per_layer,
    }


def _dtype(spelling: str) -> str:
    return np.dtype(spelling).name  # "|u1" -> "uint8": the manifest's spelling is for machines


def cmd_info(args: argparse.Namespace) -> int:
    shards = open_cache(store.resolve(args.ref, _roots(args)))
    info = _cache_summary(shards)
    out = sys.stdout
    if args.json:
        _json(info, out)
        return EXIT_OK
    n, layers, tokens, d = info["shape"]
    itemsize = shards.metadata.itemsize
    shard_list = shards.manifest.shards
    partial_last = shard_list and shard_list[-1].n_examples != info["examples_per_shard"]
    last = f" (last: {shard_list[-1].n_examples})" if partial_last else ""
    cls = "CLS + " if info["cls_token"] else ""
    data = orjson.dumps(info["data"]).decode()
    rows = [
        ("cache", info["hash"]),
        ("path", info["path"]),
        ("protocol", info["protocol"]),
        ("model", f"{info['family']} {info['ckpt']}"),
        ("dataset", info["dataset"] or "-"),
        ("data", data if len(data) <= 100 else data[:97] + "..."),
        ("shape", f"({n}, {layers}, {tokens}, {d})  examples x layers x tokens x d_model"),
        ("dtype", f"{info['dtype']} ({itemsize} bytes per value)"),
        ("layers", str(info["layers"])),
        ("tokens", f"{tokens} per example ({cls}{info['patches_per_ex']})"),
        ("shards", f"{info['n_shards']} x {info['examples_per_shard']} examples{last}"),
        (
            "bytes",
            f"{info['nbytes']:,} bytes of activations ({human_bytes(info['nbytes'])}), "
            f"{human_bytes(info['disk_nbytes'])} on disk",
        ),
        ("checksums", "xxh3_128 for every file" if info["checksums"] else "none recorded: sizes only (protocol 2.1)"),
        ("labels", "-" if info["labels"] is None else f"{info['labels']['dtype']} {tuple(info['labels']['shape'])}"),
        ("columns", ", ".join(f"{k} {c['dtype']} {tuple(c['shape'])}" for k, c in info["columns"].items()) or "-"),
        ("text", ", ".join(f"{k} ({t['n_lines']:,} lines)" for k, t in info["text"].items()) or "-"),
        ("stats", "-" if info["stats"] is None else "per layer, over stored tokens:"),
    ]
    _table(rows, out)
    if info["stats"] is not None:
        table = [("layer", "tokens", "mean |x|", "mean |x|^2", "mean var", "non-finite")]
        table += [
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
        _table(table, out, indent="  ", right=range(1, 6))
    return EXIT_OK


# --------------------------------------------------------------------------------------
# ls


def _short_problem(entry: store.CacheEntry) -> str:
    """One line for a table cell: paths inside the cache are shown by file name."""
    text = entry.problem or ""
    text = text.replace(f"{entry.path}/", "").replace(f"{entry.path}: ", "")
    lines = [line.strip(" -") for line in text.splitlines() if line.strip()]
    if len(lines) > 1:  # "N problems" followed by grouped details: keep the count and the first
        return f"{lines[0]}, first: {lines[2] if len(lines) > 2 else lines[1]}"
    return lines[0] if lines else "?"


def cmd_ls(args: argparse.Namespace) -> int:
    roots = store.shards_roots(args.roots or None)
    out = sys.stdout
    listing = []
    code = EXIT_OK
    for root in roots:
        exists = root.path.is_dir()
        entries = store.list_caches(root.path) if exists else []
        unpublished = store.list_unpublished(root.path) if exists else []
        listing.append((root, exists, entries, unpublished))
        if any(not e.ok for e in entries):
            code = EXIT_PROBLEM
        if not exists and root.source == "argument":
            code = max(code, EXIT_NOT_FOUND)
    if args.json:
        _json(
            [
                {
                    "root": str(root.path),
                    "source": root.source,
                    "exists": exists,
                    "caches": [_entry_json(e) for e in entries],
                    "unpublished": [str(p) for p in unpublished],
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
            f"{root.path} ({root.source}): {_plural(len(entries), 'cache')}, {human_bytes(total)}"
            + (f", {broken} broken" if broken else "")
            + "\n"
        )
        if entries:
            rows = [("HASH", "MODEL", "DTYPE", "SHAPE", "SHARDS", "SIZE", "STATUS")]
            for e in entries:
                md = e.metadata
                rows.append(
                    (
                        e.hash[:12],
                        f"{md.family}:{md.ckpt}" if md else "?",
                        md.dtype if md else "?",
                        f"({', '.join(map(str, md.shape))})" if md else "?",
                        str(e.n_shards if e.n_shards is not None else (md.n_shards if md else "?")),
                        human_bytes(e.nbytes),
                        "ok" if e.ok else "BROKEN: " + _short_problem(e),
                    )
                )
            _table(rows, out, indent="  ")
        for p in unpublished:
            out.write(f"  unpublished (being written, or interrupted): {p.name}\n")
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


def cmd_verify(args: argparse.Namespace) -> int:
    shards = open_cache(store.resolve(args.ref, _roots(args)))
    files = shards.manifest.files()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nbytes = shards.verify(progress=_progress(args))
    for w in caught:
        _warn(str(w.message))
    unchecked = any(digest is None for _, _, digest in files)
    checked = "sizes only (no checksums recorded)" if unchecked else "sizes, xxh3_128 checksums"
    sys.stdout.write(
        f"ok {shards.path}\n   {len(files)} files, {nbytes:,} bytes ({human_bytes(nbytes)}): "
        f"{checked} and the metadata hash match\n"
    )
    return EXIT_OK


def cmd_resolve(args: argparse.Namespace) -> int:
    sys.stdout.write(f"{store.resolve(args.ref, _roots(args))}\n")
    return EXIT_OK


def cmd_stage(args: argparse.Namespace) -> int:
    report = store.copy_cache(args.ref, args.to, roots=_roots(args), progress=_progress(args))
    err = sys.stderr
    name = report.path.name[:12]
    if report.already_staged:
        err.write(f"{name}: already staged, nothing copied\n")
    else:
        done = [f"copied {report.copied_files} files ({human_bytes(report.copied_bytes)})"]
        if report.kept_files or report.resumed_files:
            done.append(
                f"resumed: kept {report.kept_files} complete and {report.resumed_files} half-written files "
                f"({human_bytes(report.kept_bytes)}) after re-verifying them"
            )
        if report.recopied:
            done.append(f"re-copied {len(report.recopied)} that failed verification ({', '.join(report.recopied)})")
        if report.repaired:
            done.append("repaired a damaged local copy")
        checked = "checksums verified" if not report.unverified else f"{len(report.unverified)} files had no checksum"
        err.write(f"{name}: " + "; ".join(done) + f"; {checked}\n")
    store.open_quietly(report.path)  # what the caller gets is a cache that opens
    sys.stdout.write(f"{report.path}\n")
    return EXIT_OK


# --------------------------------------------------------------------------------------
# runs


def cmd_run_init(args: argparse.Namespace) -> int:
    run = store.create_run(
        args.train,
        args.val,
        run_id=args.id,
        runs_root=args.runs_root,
        roots=_roots(args),
        train_dataset=args.train_dataset,
        val_dataset=args.val_dataset,
    )
    out = sys.stdout
    out.write(f"created run {run.path}\n")
    rows = []
    for name in store.LINK_NAMES:
        link = run.link(name)
        if os.path.lexists(link):
            target = os.readlink(link)
            rows.append((f"links/{name}", f"-> {target}" + ("" if link.exists() else "  (does not exist here)")))
    rows.append(("checkpoint/", "(empty: training writes sae.pt and config.json here)"))
    _table(rows, out, indent="  ")
    return EXIT_OK


def cmd_run_show(args: argparse.Namespace) -> int:
    run = store.open_run(args.run, args.runs_root)
    paths: dict[str, str | None] = {"run": str(run.path)}
    for name in store.LINK_NAMES:
        try:
            paths[name] = str(run.target(name))
        except RunError:
            paths[name] = None
    paths["sae_checkpoint"] = str(run.sae_checkpoint)
    paths["checkpoint_config"] = str(run.checkpoint_config)
    if args.json:
        _json(paths, sys.stdout)
    else:
        _table(
            [(k, v if v is not None else "- (missing or dangling; see: saev-shards doctor)") for k, v in paths.items()],
            sys.stdout,
        )
    return EXIT_OK


_MARK = {"ok": "ok", "note": "note", "warning": "WARNING", "error": "ERROR"}


def cmd_doctor(args: argparse.Namespace) -> int:
    if args.run is None:
        findings = _doctor_environment(args)
        title = "environment"
    else:
        run = store.open_run(args.run, args.runs_root)
        findings = store.doctor(run, verify=args.verify, require_checkpoint=args.trained, progress=_progress(args))
        title = f"run {run.path}"
    errors = sum(f.level == "error" for f in findings)
    warnings_ = sum(f.level == "warning" for f in findings)
    if args.json:
        _json(
            {
                "subject": title,
                "errors": errors,
                "warnings": warnings_,
                "findings": [{"level": f.level, "subject": f.subject, "message": f.message} for f in findings],
            },
            sys.stdout,
        )
    else:
        out = sys.stdout
        out.write(f"{title}\n")
        _table([(_MARK[f.level], f.subject, f.message) for f in findings], out, indent="  ")
        out.write(f"{_plural(errors, 'error')}, {_plural(warnings_, 'warning')}\n")
    return EXIT_PROBLEM if errors else EXIT_OK


def _doctor_environment(args: argparse.Namespace) -> list[store.Finding]:
    findings: list[store.Finding] = []

    def check(kind: str, get: Callable[[], list[store.Root]]) -> None:
        try:
            roots = get()
        except RootNotSetError as err:
            findings.append(store.Finding("error", kind, str(err)))
            return
        for root in roots:
            if not root.path.is_dir():
                findings.append(store.Finding("warning", kind, f"{root} does not exist yet"))
                continue
            findings.append(store.Finding("ok", kind, str(root)))
            if kind == "shards root":
                findings.extend(
                    store.Finding("note", kind, f"unpublished (being written, or interrupted): {p}")
                    for p in store.list_unpublished(root.path)
                )

    check("shards root", lambda: store.shards_roots(_roots(args)))
    check("runs root", lambda: [store.runs_root(args.runs_root)])
    check("stage root", lambda: [store.stage_root(None)])
    return findings


# --------------------------------------------------------------------------------------
# dump (another module; imported only when invoked)


def _add_dump(sub: argparse._SubParsersAction[argparse.ArgumentParser], invoked: bool) -> None:
    parser = sub.add_parser(
        "dump",
        help="record a model's activations into a new cache (needs torch)",
        description="Record a model's activations into a new cache (needs torch).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXIT_CODES_HELP,
        conflict_handler="resolve",  # dump's own options may redefine --debug
    )
    _add_debug(parser)
    if not invoked:
        return
    try:
        module = importlib.import_module("saev_shards.dump")
    except ImportError as err:
        if err.name in ("saev_shards.dump", "saev_shards"):
            message = "the dump command is not available in this installation (no module saev_shards.dump)"
        else:
            message = f"the dump command needs {err.name or 'a package'}, which is not installed ({err})"
        raise _Failure(EXIT_USAGE, message) from err
    module.add_arguments(parser)
    parser.set_defaults(func=module.run)


# --------------------------------------------------------------------------------------
# the parser


def _add_debug(p: argparse.ArgumentParser) -> None:
    # SUPPRESS: a subcommand's default must not overwrite `saev-shards --debug <command>`.
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="print tracebacks of errors")


def _add_roots(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--root",
        action="append",
        metavar="DIR",
        help="shards root to search (repeatable; default: $SAEV_SHARDS_ROOT, else $SAEV_SCRATCH/saev/shards)",
    )


def _add_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: only when stderr is a terminal)",
    )


def _command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    help_: str,
    examples: str,
    func: Callable[[argparse.Namespace], int],
    description: str | None = None,
) -> argparse.ArgumentParser:
    p = sub.add_parser(
        name,
        help=help_,
        description=description or help_[0].upper() + help_[1:] + ".",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n" + examples + "\n" + EXIT_CODES_HELP,
    )
    p.set_defaults(func=func)
    _add_debug(p)
    return p


REF_HELP = "a cache: its path, its full hash, or a unique hash prefix (4+ hex digits)"


def build_parser(invoked: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; ``invoked`` names the command about to run (dump loads lazily)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect, verify, find and stage saev activation caches; create and check training runs.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            "  saev-shards ls                          # caches in the shards root(s)\n"
            "  saev-shards info 3f2a                   # a readable summary of one cache\n"
            "  saev-shards verify 3f2a                 # sizes, checksums and hash\n"
            "  saev-shards stage 3f2a                  # verified local copy in $TMPDIR\n"
            "  saev-shards run init --train 3f2a --val 9c1d --id sae-16k\n"
            "  saev-shards doctor --run sae-16k\n"
            "  saev-shards <command> --help            # examples for each command\n\n"
            + ROOTS_HELP
            + "\n"
            + EXIT_CODES_HELP
        ),
    )
    parser.add_argument("--debug", action="store_true", default=False, help="print tracebacks of errors")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>", required=True)

    p = _command(
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
    _add_roots(p)

    p = _command(
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

    p = _command(
        sub,
        "verify",
        "check every file's size and xxh3_128 checksum and the metadata hash (exit 1 on any problem)",
        "  saev-shards verify 3f2a\n  saev-shards verify /scratch/me/saev/shards/3f2a9c... --progress\n",
        cmd_verify,
    )
    p.add_argument("ref", help=REF_HELP)
    _add_roots(p)
    _add_progress(p)

    p = _command(
        sub,
        "resolve",
        "print the absolute path of the cache a path, hash or unique prefix names",
        '  saev-shards resolve 3f2a\n  cd "$(saev-shards resolve 3f2a)"\n',
        cmd_resolve,
    )
    p.add_argument("ref", help=REF_HELP)
    _add_roots(p)

    p = _command(
        sub,
        "stage",
        "copy a cache to local disk with checksums verified, atomically and resumably; print the copy's path",
        "  saev-shards stage 3f2a                      # to $SAEV_STAGE_ROOT or $TMPDIR/saev/shards\n"
        "  saev-shards stage 3f2a --to /local/ssd/saev/shards\n"
        "  SHARDS=$(saev-shards stage 3f2a)           # stdout is only the local path\n",
        cmd_stage,
        description=(
            "Copy a cache to local disk: files go to <dest>/.copying-<hash>/ and are hashed while written; "
            "only when every size and xxh3_128 checksum matches the source manifest is the copy made read-only "
            "and renamed to <dest>/<hash>. Interrupted? Run the same command again: complete files are "
            "re-verified and kept, a half-written one is completed. A local copy damaged since (a scratch "
            "purge) is repaired. Prints the local path on stdout, a summary on stderr."
        ),
    )
    p.add_argument("ref", help=REF_HELP)
    p.add_argument("--to", metavar="DIR", help="destination root (default: $SAEV_STAGE_ROOT, else $TMPDIR/saev/shards)")
    _add_roots(p)
    _add_progress(p)

    run_parser = sub.add_parser(
        "run",
        help="create a run folder, or show the paths a run resolves to",
        description="Run folders (seed 004): <runs root>/<run_id>/ with links/ and checkpoint/.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  saev-shards run init --train 3f2a --val 9c1d --id sae-16k\n"
        "  saev-shards run show --run sae-16k\n\n" + EXIT_CODES_HELP,
    )
    _add_debug(run_parser)
    run_sub = run_parser.add_subparsers(dest="run_command", metavar="<run command>", required=True)
    p = _command(
        run_sub,
        "init",
        "create <runs root>/<id>/ with links/{train,val}-{shards,dataset} and checkpoint/",
        "  saev-shards run init --train 3f2a --val 9c1d --id sae-16k\n"
        "  saev-shards run init --train 3f2a --train-dataset /data/imagenet/train --runs-root ./runs\n",
        cmd_run_init,
        description=(
            "Create <runs root>/<id>/ with checkpoint/ and links/train-shards, links/val-shards (the caches, "
            "resolved from paths, hashes or prefixes) and links/train-dataset, links/val-dataset (default: "
            "the dataset path recorded in each cache's metadata)."
        ),
    )
    p.add_argument("--train", required=True, metavar="REF", help="training cache: " + REF_HELP)
    p.add_argument("--val", metavar="REF", help="validation cache (optional)")
    p.add_argument("--id", metavar="RUN_ID", help="run id (default: <date>-<time>-<train hash[:8]>)")
    p.add_argument("--train-dataset", metavar="DIR", help="dataset root (default: the train cache's metadata)")
    p.add_argument("--val-dataset", metavar="DIR", help="dataset root (default: the val cache's metadata)")
    p.add_argument("--runs-root", metavar="DIR", help="runs root (default: $SAEV_RUNS_ROOT, else $SAEV_NFS/saev/runs)")
    _add_roots(p)

    p = _command(
        run_sub,
        "show",
        "print every path a run resolves to (links followed, checkpoint files)",
        "  saev-shards run show --run sae-16k\n  saev-shards run show --run /nfs/me/saev/runs/sae-16k --json\n",
        cmd_run_show,
    )
    p.add_argument("--run", required=True, metavar="RUN", help="run folder path, or a run id in the runs root")
    p.add_argument("--runs-root", metavar="DIR", help="runs root for bare run ids")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")

    p = _command(
        sub,
        "doctor",
        "check a run's links and files (or, without --run, the roots); exit 1 on any error",
        "  saev-shards doctor --run sae-16k\n"
        "  saev-shards doctor --run /nfs/me/saev/runs/sae-16k --verify --trained\n"
        "  saev-shards doctor                      # which roots are configured, and do they exist\n",
        cmd_doctor,
        description=(
            "Check a run folder: every link under links/ (missing, dangling, not a symlink, a cache that does "
            "not open or, with --verify, fails its checksums), checkpoint/ and its files, and that the train "
            "and val caches agree on model, layers and width. Without --run, check the configured roots."
        ),
    )
    p.add_argument("--run", metavar="RUN", help="run folder path, or a run id in the runs root")
    p.add_argument("--runs-root", metavar="DIR", help="runs root (default: $SAEV_RUNS_ROOT, else $SAEV_NFS/saev/runs)")
    p.add_argument("--verify", action="store_true", help="also verify the checksums of the linked caches")
    p.add_argument("--trained", action="store_true", help="require checkpoint/sae.pt and checkpoint/config.json")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    _add_roots(p)
    _add_progress(p)

    _add_dump(sub, invoked == "dump")
    return parser


def _invoked_command(argv: Sequence[str]) -> str | None:
    # Global options take no values, so the first bare word is the command.
    return next((a for a in argv if not a.startswith("-")), None)


# --------------------------------------------------------------------------------------
# errors and exit codes


def _warn(message: str) -> None:
    sys.stderr.write(f"{PROG}: warning: {message}\n")


def _exit_code(err: BaseException) -> int:
    if isinstance(err, (UnknownCacheError, CacheRefError, RunNotFoundError)):
        return EXIT_NOT_FOUND
    if isinstance(err, (RootNotSetError, RunExistsError)):
        return EXIT_USAGE
    if isinstance(err, WriterBusyError):
        return EXIT_SYSTEM
    if isinstance(err, (InvalidCacheError, ShardsError)):
        return EXIT_PROBLEM
    if isinstance(err, OSError):
        return EXIT_SYSTEM
    return EXIT_INTERNAL


def _message(err: BaseException) -> str:
    if isinstance(err, OSError) and not isinstance(err, ShardsError) and err.strerror:
        where = f"{err.filename}: " if err.filename else ""
        return f"{where}{err.strerror}"
    return str(err) or type(err).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args_list
    saved = warnings.showwarning
    warnings.showwarning = lambda message, *a, **k: _warn(str(message))  # one line, no source
    try:
        parser = build_parser(_invoked_command(args_list))
        args = parser.parse_args(args_list)
        code: int = args.func(args)
        sys.stdout.flush()  # inside the try: a closed pipe is reported here, not at exit
        return code
    except _Failure as err:
        sys.stderr.write(f"{PROG}: error: {err}\n")
        return err.code
    except KeyboardInterrupt:
        sys.stderr.write(f"\n{PROG}: interrupted\n")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader of our output went away (`saev-shards info 3f2a | head`): not an error
        # to report; send what is still buffered nowhere so the exit stays quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Exception as err:
        code = _exit_code(err)
        if debug:
            traceback.print_exc()
        if code == EXIT_INTERNAL:
            sys.stderr.write(
                f"{PROG}: internal error: {type(err).__name__}: {_message(err)} "
                "(rerun with --debug for the traceback, and please report it)\n"
            )
        else:
            sys.stderr.write(f"{PROG}: error: {_message(err)}\n")
        return code
    finally:
        warnings.showwarning = saved
