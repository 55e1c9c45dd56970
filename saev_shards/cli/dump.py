"""``saev-shards dump``: wired here, implemented in `saev_shards.dump` (imported only when invoked: it needs torch)."""

from __future__ import annotations

import argparse
import importlib

from ._common import EXIT_CODES_HELP, EXIT_USAGE, Failure, add_debug


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], invoked: str | None) -> None:
    """Add ``dump``; its options are loaded only when ``dump`` is the command being run."""
    parser = sub.add_parser(
        "dump",
        help="record a model's activations into a new cache (needs torch)",
        description="Record a model's activations into a new cache (needs torch).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXIT_CODES_HELP,
        conflict_handler="resolve",  # dump's own options may redefine --debug
    )
    add_debug(parser)
    if invoked != "dump":
        return
    try:
        module = importlib.import_module("saev_shards.dump")
    except ImportError as err:
        if err.name in ("saev_shards.dump", "saev_shards"):
            message = "the dump command is not available in this installation (no module saev_shards.dump)"
        else:
            message = f"the dump command needs {err.name or 'a package'}, which is not installed ({err})"
        raise Failure(EXIT_USAGE, message) from err
    module.add_arguments(parser)
    parser.set_defaults(func=module.run)
