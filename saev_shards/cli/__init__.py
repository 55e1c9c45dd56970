"""``saev-shards``: inspect, verify, find and stage caches; create and check runs; dump.

Each command lives in a module of this package with a ``register(sub, invoked)`` that adds
its sub-parser; the commands are small functions over `saev_shards.store` and
`saev_shards.open`. `main` builds the parser and owns the mapping from errors to one line
and an exit code. It never imports torch: ``dump`` (which needs it) is imported only when
it is invoked.
"""

from ..humanize import human_bytes
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
)
from .entry import COMMANDS, build_parser, main, run

__all__ = [
    "COMMANDS",
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
