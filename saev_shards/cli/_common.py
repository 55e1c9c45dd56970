"""What every command shares: exit codes, help texts, output formatting, common options."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import orjson

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
  130  interrupted (Ctrl-C); `stage` and `shuffle` resume where they stopped when run again
  141  the reader of the output went away (e.g. `| head`); nothing is printed
"""

ROOTS_HELP = """\
roots:
  shards: --root DIR (repeatable) > $SAEV_SHARDS_ROOT (':'-separated, searched in order)
          > $SAEV_SCRATCH/saev/shards
  runs:   --runs-root DIR > $SAEV_RUNS_ROOT > $SAEV_NFS/saev/runs
  stage:  --to DIR > $SAEV_STAGE_ROOT > $TMPDIR/saev/shards
"""


class Failure(Exception):
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


def table(rows: Sequence[Sequence[str]], out: TextIO, indent: str = "", right: Sequence[int] = ()) -> None:
    """Columns padded to their widest cell; the columns numbered in ``right`` (numbers) right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        out.write(indent + "  ".join(cells).rstrip() + "\n")


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def print_json(obj: Any, out: TextIO) -> None:
    out.write(orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode() + "\n")


def progress_arg(args: argparse.Namespace) -> bool | None:
    value: bool | None = args.progress
    return value  # None: only when stderr is a terminal


def roots_arg(args: argparse.Namespace) -> list[str] | None:
    roots: list[str] | None = args.root
    return roots


def warn(message: str) -> None:
    sys.stderr.write(f"{PROG}: warning: {message}\n")


# --------------------------------------------------------------------------------------
# options and sub-parsers


def add_debug(p: argparse.ArgumentParser) -> None:
    # SUPPRESS: a subcommand's default must not overwrite `saev-shards --debug <command>`.
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="print tracebacks of errors")


def add_roots(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--root",
        action="append",
        metavar="DIR",
        help="shards root to search (repeatable; default: $SAEV_SHARDS_ROOT, else $SAEV_SCRATCH/saev/shards)",
    )


def add_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: only when stderr is a terminal)",
    )


def command(
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
    add_debug(p)
    return p


REF_HELP = "a cache: its path, its full hash, or a unique hash prefix (4+ hex digits)"
