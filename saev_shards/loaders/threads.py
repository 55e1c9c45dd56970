"""How many threads the loaders read and gather with by default (`TokenLoader`'s
``read_threads`` and ``gather_threads``)."""

from __future__ import annotations

import os

#: Most threads the defaults pick: a node's memory bandwidth is saturated well before.
MAX_DEFAULT_THREADS = 16


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask: what SLURM or taskset granted)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_gather_threads() -> int:
    """Threads gathering batches on the host: one per usable core, at most 16."""
    return max(1, min(MAX_DEFAULT_THREADS, usable_cores()))


def default_read_threads(device_side: bool = False, sequential: bool = False) -> int:
    """Threads reading spans: at least 4 requests in flight for a disk, half the cores when
    they also gather on the host, every core when the device gathers (at most 16).

    ``sequential`` (the ordered walk, whose spans follow each other in each file) on the
    host: 2. The kernel's readahead keeps such a stream's next requests in flight by itself,
    and more threads reading one file's consecutive spans break the stream up: on the
    development machine's disk 4 threads read a cold file at about half the rate of 1 or 2
    (docs/loaders.md, "Read-ahead"). The device mode's read threads also copy every window,
    so they stay one per core."""
    if sequential and not device_side:
        return 2
    cores = usable_cores()
    return max(4, min(MAX_DEFAULT_THREADS, cores if device_side else cores // 2))
