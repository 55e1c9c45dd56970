"""What every command shares: exit codes, help texts, output formatting, common options."""

from __future__ import annotations

import argparse
import io
import json
import re
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
  1    a problem was found: a cache is invalid or fails verification, a run has errors,
       a source to convert is broken; `rm` or `clean` refused or was not confirmed;
       a bucket is in another region than AWS_REGION
  2    usage error: bad arguments or dump configuration, no root configured, a command not installed,
       no (valid) credentials for an object store
  3    not found: no cache or run matches, a hash prefix is ambiguous or too short, no such bucket
  4    system error: permission denied (a denied object-store request too), disk full, another
       process holds the cache, a server failing after every retry
  5    internal error: a bug (rerun with --debug and report the traceback)
  130  interrupted (Ctrl-C); `stage`, `convert`, `shuffle` and `dump` resume where they stopped when run again
  141  the reader of the output went away (e.g. `| head`); nothing is printed
"""

ROOTS_HELP = """\
roots:
  shards: --root DIR (repeatable) > $SAEV_SHARDS_ROOT (':'-separated, searched in order)
          > $SAEV_SCRATCH/saev/shards; a root may be a URL (s3://bucket/shards), searched last
  runs:   --runs-root DIR > $SAEV_RUNS_ROOT > $SAEV_NFS/saev/runs
  stage:  --to DIR > $SAEV_STAGE_ROOT > $TMPDIR/saev/shards
"""


# --------------------------------------------------------------------------------------
# formatting


# What a terminal may act on rather than show: C0 controls (ESC starts colour, title and
# cursor sequences), DEL, C1 controls (U+009B is a one-character CSI), line and paragraph
# separators, bidirectional overrides (they reorder what is shown), and lone surrogates
# (file names that are not UTF-8; they cannot even be encoded for output).
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_LINE_BREAKS = frozenset("\n\r\t")
# The same, less C0: JSON text holds those only as its own line breaks (strings escape them).
_UNPRINTABLE_IN_JSON = re.compile("[\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, *, keep_line_breaks: bool = False) -> str:
    """``text`` with every character a terminal would act on escaped as ``\\x1b`` or ``\\u202e``.

    ``keep_line_breaks`` leaves newlines, carriage returns and tabs alone (for whole output
    streams, whose lines are ours; table cells escape them, so a value stays on its line).
    """
    if keep_line_breaks:
        return _UNPRINTABLE.sub(lambda m: m.group() if m.group() in _LINE_BREAKS else _escape(m), text)
    return _UNPRINTABLE.sub(_escape, text)


class EscapingWriter(io.TextIOBase):
    """A text stream that writes `printable` text (line breaks kept) to another one.

    `main` puts one in front of stdout and stderr, so no command can send a raw control
    character from a cache (metadata, file names, error messages) to the terminal.
    """

    def __init__(self, raw: TextIO) -> None:
        self.raw = raw

    def write(self, text: str) -> int:
        self.raw.write(printable(text, keep_line_breaks=True))
        return len(text)

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def isatty(self) -> bool:
        return self.raw.isatty()

    def writable(self) -> bool:
        return True


def table(rows: Sequence[Sequence[str]], out: TextIO, indent: str = "", right: Sequence[int] = ()) -> None:
    """Columns padded to their widest cell; the columns numbered in ``right`` (numbers) right-aligned.

    Cells are `printable` with line breaks escaped too: a value never leaves its cell.
    """
    rows = [[printable(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        out.write(indent + "  ".join(cells).rstrip() + "\n")


_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``"2G"``, ``"512MiB"``, ``"1.5g"`` or plain bytes -> bytes (binary units: 2G = 2 GiB)."""
    match = _SIZE_RE.fullmatch(text.strip())
    if match is None or len(match.group(1)) > 20:
        raise argparse.ArgumentTypeError(f"expected a size like 2G, 512M or 1073741824, found {text!r:.40}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def int_list(text: str) -> list[int]:
    """``"11"``, ``"6,11"`` or ``"6, 11"`` -> integers (layer values, token ids): the argparse type
    of every comma-separated list of integers."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        found = f"{text!r:.40}"
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 6,11, found {found}") from None


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def print_json(obj: Any, out: TextIO) -> None:
    """``obj`` as indented JSON, with the characters `printable` escapes written as ``\\u`` escapes.

    orjson escapes C0 controls itself; DEL, C1 and the rest can only sit inside strings,
    where ``\\uXXXX`` means the same character. A string orjson cannot encode (a file name
    that is not UTF-8) falls back to Python's json, escaping all non-ASCII text.
    """
    try:
        text = orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode()
    except orjson.JSONEncodeError:
        text = json.dumps(obj, indent=2, ensure_ascii=True, default=str)
    out.write(_UNPRINTABLE_IN_JSON.sub(lambda m: f"\\u{ord(m.group()):04x}", text) + "\n")


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


REF_HELP = (
    "a cache: its path, its full hash, a unique hash prefix (4+ hex digits), or its URL "
    "(s3://bucket/root/<hash or prefix>, https://host/root/<hash>)"
)
