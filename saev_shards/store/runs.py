"""Earlier name of `saev_shards.store.run_folders` (SAE training run folders), kept for imports."""

from __future__ import annotations

from .run_folders import (
    CHECKPOINT_FILES,
    LINK_ALIASES,
    LINK_NAMES,
    MUST_AGREE,
    RUN_DIRS,
    Run,
    compare_caches,
    create_run,
    dataset_target,
    open_run,
    runs_linking,
)

__all__ = [
    "CHECKPOINT_FILES",
    "LINK_ALIASES",
    "LINK_NAMES",
    "MUST_AGREE",
    "RUN_DIRS",
    "Run",
    "compare_caches",
    "create_run",
    "dataset_target",
    "open_run",
    "runs_linking",
]
