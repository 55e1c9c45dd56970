"""Kept for imports written before the token selection became a package: the check of a
``layers`` argument given as a string lives in `saev_shards.selection.layers`."""

from .selection.layers import string_layers_problem

__all__ = ["string_layers_problem"]
