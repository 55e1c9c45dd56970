"""Earlier name of `saev_shards.store.copies` (verified local copies), kept for imports."""

from __future__ import annotations

from ..storage.transfer import TransferReport
from .copies import CopyOptions, StageReport, copy_cache, pull, stage

__all__ = ["CopyOptions", "StageReport", "TransferReport", "copy_cache", "pull", "stage"]
