"""Shared fixtures. Hypothesis profiles: `dev` (default), `ci` (derandomized; `make test`),
`thorough` (many examples); pick one with HYPOTHESIS_PROFILE."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

import saev_shards as ss

from .support.caches import write_cache

settings.register_profile(
    "ci", derandomize=True, max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture(autouse=True)
def _protocol_warning_per_test() -> None:
    """The protocol 2.1 warning shows once per cache per process; each test starts afresh."""
    import importlib

    importlib.import_module("saev_shards.reader.open")._LEGACY_WARNED.clear()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """An empty shards root."""
    path = tmp_path / "shards"
    path.mkdir()
    return path


@pytest.fixture
def make_cache(root: Path) -> Callable[..., tuple[ss.Shards, Any]]:
    """``make_cache(md=None, **writer_kwargs) -> (shards, logical)``: a published cache and its data."""

    def make(md: ss.Metadata | None = None, **kwargs: Any) -> tuple[ss.Shards, Any]:
        from .support.caches import small_metadata

        md = md or small_metadata()
        logical = write_cache(root, md, **kwargs)
        return ss.open(root / md.hash), logical

    return make
