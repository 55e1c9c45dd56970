"""loaders.threads: the default thread counts, from the cores this process may run on (its
affinity mask, else the machine's count): gathers one per core, reads at least four requests
in flight, two for the ordered walk on the host, at most 16 of either."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from saev_shards.loaders import threads
from saev_shards.loaders.threads import MAX_DEFAULT_THREADS, default_gather_threads, default_read_threads


@given(st.integers(1, 200))
def test_defaults_follow_the_usable_cores(cores: int) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
        assert threads.usable_cores() == cores
        assert default_gather_threads() == min(16, cores)
        assert default_read_threads() == max(4, min(16, cores // 2))
        assert default_read_threads(device_side=True) == max(4, min(16, cores))
        assert default_read_threads(sequential=True) == 2
        assert default_read_threads(device_side=True, sequential=True) == max(4, min(16, cores))
        counts = [default_gather_threads(), *(default_read_threads(d, s) for d in (False, True) for s in (False, True))]
    assert all(1 <= n <= MAX_DEFAULT_THREADS for n in counts)


def test_without_an_affinity_mask_the_machines_cores_count(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(pid: int) -> set[int]:
        raise OSError("not here")

    monkeypatch.setattr(os, "sched_getaffinity", refused, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert threads.usable_cores() == 6
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert threads.usable_cores() == 1 and default_gather_threads() == 1 and default_read_threads() == 4
