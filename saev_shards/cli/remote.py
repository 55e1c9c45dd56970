"""Earlier name of `saev_shards.cli.transfer` (``push`` and ``pull``, now beside ``stage``)."""

from __future__ import annotations

from .transfer import cmd_pull, cmd_push

__all__ = ["cmd_pull", "cmd_push"]
