"""fileio.faults: a fault point calls the package's hook when a test has set one, else nothing."""

from __future__ import annotations

import pytest

from saev_shards import fileio


def test_fault_point_calls_the_package_hook_only_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fileio.fault_hook is None
    fileio.fault_point("anything", 3)  # no hook: nothing happens
    seen: list[tuple[str, int]] = []
    monkeypatch.setattr(fileio, "fault_hook", lambda name, index: seen.append((name, index)))
    fileio.fault_point("shard_written", 7)
    fileio.fault_point("published")
    assert seen == [("shard_written", 7), ("published", -1)]
