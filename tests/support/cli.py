"""Running the command line in a child process the way a user's shell does."""

from __future__ import annotations

import sys

#: ``python -m saev_shards`` with Ctrl-C raising KeyboardInterrupt even when the tests run
#: with SIGINT ignored (a shell without job control starts background jobs so, e.g.
#: ``nohup make test &``; Python then installs no handler and the child inherits SIG_IGN).
_WITH_CTRL_C = (
    "import signal, sys\n"
    "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
    "{setup}\n"
    "from saev_shards.cli import run\n"
    "run(sys.argv[1:])\n"
)


def cli_with_ctrl_c(*args: str, setup: str = "") -> list[str]:
    """The argv of ``saev-shards ARGS...`` (the console script's entry point) in a child that
    SIGINT interrupts; ``setup`` is Python run first (e.g. a test's patch)."""
    return [sys.executable, "-c", _WITH_CTRL_C.format(setup=setup), *args]
