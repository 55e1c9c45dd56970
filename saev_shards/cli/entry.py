"""The ``saev-shards`` command line itself: the parser (each command module's ``register``), and
the mapping from errors to one line and an exit code (`run`, `main`). It never imports
torch: ``dump`` (which needs it) is imported only when it is invoked."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
import warnings
from collections.abc import Sequence
from typing import NoReturn

from .. import __version__
from ..errors import (
    BlockCacheError,
    CacheInUseError,
    CacheRefError,
    CommandError,
    ConfigError,
    ConvertOptionError,
    DiskFullError,
    InvalidCacheError,
    MissingDependencyError,
    RemoteAccessDeniedError,
    RemoteBucketError,
    RemoteCredentialsError,
    RemoteError,
    RemoteRegionError,
    RootNotSetError,
    RunExistsError,
    RunNotFoundError,
    ShardsError,
    SourceNotFoundError,
    UnknownCacheError,
    WriterBusyError,
)
from ..humanize import human_bytes
from . import caches, cleanup, convert, dump, info, ls, runs, shuffle, transfer
from ._common import (
    EXIT_BROKEN_PIPE,
    EXIT_CODES_HELP,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_PROBLEM,
    EXIT_SYSTEM,
    EXIT_USAGE,
    PROG,
    ROOTS_HELP,
    EscapingWriter,
    warn,
)

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_CODES_HELP",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_PROBLEM",
    "EXIT_SYSTEM",
    "EXIT_USAGE",
    "build_parser",
    "human_bytes",
    "main",
    "run",
]

#: The modules whose commands make up the command line, in --help order.
COMMANDS = (info, ls, caches, transfer, cleanup, shuffle, convert, runs, dump)


def build_parser(invoked: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; ``invoked`` names the command about to run (dump loads lazily)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Inspect, verify, find, stage, complete and remove saev activation caches; create and check training runs."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            "  saev-shards ls                          # caches in the shards root(s)\n"
            "  saev-shards info 3f2a                   # a readable summary of one cache\n"
            "  saev-shards verify 3f2a                 # sizes, checksums and hash\n"
            "  saev-shards stage 3f2a                  # verified local copy in $TMPDIR\n"
            "  saev-shards push 3f2a s3://bucket/shards # publish in an object store (prints the URL)\n"
            "  saev-shards pull s3://bucket/shards/3f2a # verified copy into the shards root\n"
            "  saev-shards stats 3f2a                  # statistics for a cache written without them\n"
            "  saev-shards report 3f2a                 # one picture: norms, dimensions, tokens, shards\n"
            "  saev-shards rm 3f2a                     # remove a cache (asks; refuses if a run links to it)\n"
            "  saev-shards clean --dry-run             # staging and copy folders whose writer is gone\n"
            "  saev-shards shuffle 3f2a --layers 11    # a perfectly shuffled copy for training\n"
            "  saev-shards run init --train 3f2a --val 9c1d --id sae-16k\n"
            "  saev-shards doctor --run sae-16k\n"
            "  saev-shards convert ./activations      # pickle shards, zarr logs, SAELens, .npy -> a cache\n"
            "  saev-shards <command> --help            # examples for each command\n\n"
            + ROOTS_HELP
            + "\n"
            + EXIT_CODES_HELP
        ),
    )
    parser.add_argument("--debug", action="store_true", default=False, help="print tracebacks of errors")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>", required=True)

    for module in COMMANDS:
        module.register(sub, invoked)
    return parser


def _invokedcommand(argv: Sequence[str]) -> str | None:
    # Global options take no values, so the first bare word is the command.
    return next((a for a in argv if not a.startswith("-")), None)


# --------------------------------------------------------------------------------------
# errors and exit codes


def _exit_code(err: BaseException) -> int:
    # Object stores: each refusal its own code (docs/cli.md), before the generic kinds below.
    if isinstance(err, RemoteCredentialsError):
        return EXIT_USAGE  # nothing (valid) configured: set the variables
    if isinstance(err, RemoteBucketError):
        return EXIT_NOT_FOUND
    if isinstance(err, RemoteRegionError):
        return EXIT_PROBLEM
    if isinstance(err, (RemoteAccessDeniedError, RemoteError)):
        return EXIT_SYSTEM  # a denied request, or the server failing after every retry
    if isinstance(err, (UnknownCacheError, CacheRefError, RunNotFoundError, SourceNotFoundError)):
        return EXIT_NOT_FOUND
    if isinstance(err, BlockCacheError):
        return EXIT_USAGE  # the block cache's variables or folder: configured wrongly
    if isinstance(err, (ConfigError, RootNotSetError, RunExistsError, ConvertOptionError, MissingDependencyError)):
        return EXIT_USAGE
    if isinstance(err, (WriterBusyError, CacheInUseError, DiskFullError)):
        return EXIT_SYSTEM  # another process holds it, or the disk is full: the system, not the cache
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


def run(argv: Sequence[str] | None = None) -> NoReturn:
    """The ``saev-shards`` console script (and ``python -m saev_shards``): `main`, then exit.

    An interrupted command (Ctrl-C: `main` has printed what it keeps and returns 130) ends
    the process at once, without waiting for any thread it started: a read ahead of a
    source, a copy, the scratch writes of a shuffle. Each command has already released
    what it holds (writers aborted, locks closed) before `main` returns.
    """
    code = main(argv)
    if code == EXIT_INTERRUPTED:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    sys.exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args_list
    saved = warnings.showwarning, sys.stdout, sys.stderr
    warnings.showwarning = lambda message, *a, **k: warn(str(message))  # one line, no source
    # Everything printed passes `printable`: caches are data from elsewhere, and a family, a
    # ckpt or a file name holding ESC sequences must not drive the user's terminal.
    sys.stdout, sys.stderr = EscapingWriter(sys.stdout), EscapingWriter(sys.stderr)
    args: argparse.Namespace | None = None
    try:
        parser = build_parser(_invokedcommand(args_list))
        args = parser.parse_args(args_list)
        code: int = args.func(args)
        sys.stdout.flush()  # inside the try: a closed pipe is reported here, not at exit
        return code
    except CommandError as err:
        sys.stderr.write(f"{PROG}: error: {err}\n")
        return int(err.code)
    except KeyboardInterrupt:
        hint = getattr(args, "interrupted_hint", None)  # what a command keeps, said once
        sys.stderr.write(f"\n{PROG}: interrupted" + (f"; {hint}" if hint else "") + "\n")
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
        warnings.showwarning, sys.stdout, sys.stderr = saved
