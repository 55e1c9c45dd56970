"""Kept for imports written before the token selection became a package: the ``exclude_token_ids``
token mask lives in `saev_shards.selection.token_masks`."""

from .selection.token_masks import COLUMN, parse_exclude_token_ids, token_ids_of, token_ids_problem

__all__ = ["COLUMN", "parse_exclude_token_ids", "token_ids_of", "token_ids_problem"]
