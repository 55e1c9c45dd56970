"""The named points where tests stop or pause a process (`fault_point`), at shard granularity
or coarser: the crash and race suites set ``saev_shards.fileio.fault_hook`` to kill or pause
a process at one of them (docs/contributing/reliability.md). Nothing happens in normal use.
"""

from __future__ import annotations

import sys


def fault_point(name: str, index: int = -1) -> None:
    """A named step of writing or publishing (``index``: the shard or file it concerns).

    Does nothing unless a test has set ``saev_shards.fileio.fault_hook``; the points sit at
    shard granularity or coarser, so they cost nothing measurable.
    """
    hook = sys.modules[__package__].fault_hook  # the package attribute: tests set it there
    if hook is not None:
        hook(name, index)
