"""Which tokens of a cache to take, parsed in one place for the loaders, the datasets and the shuffle.

`SelectionSpec` is what a caller asks for (layers, token kind, the token masks);
`parse_selection` checks it against a cache once, with the caller's error class, and
gives the `Selection` every reader applies (`Selection.mask`). Below both the loaders
(which need torch) and the shuffle (numpy only): numpy only.

The package, one job per module: `spec` (the spec, the parser, the chosen selection and
its mask), `layers` (a ``layers`` argument, also the dump's and the recorder's), and
`token_masks` (the ``exclude_token_ids`` ids and the ``token_ids`` column they are
compared with; the other mask, ``max_norm_multiple``, is `saev_shards.reader.norms`).
"""

from .layers import choose_layers, string_layers_problem
from .spec import (
    TOKEN_CHOICES,
    Selection,
    SelectionSpec,
    choose_excluded_ids,
    parse_selection,
    parse_tokens,
    token_positions,
)
from .token_masks import token_ids_of, token_ids_problem

__all__ = [
    "TOKEN_CHOICES",
    "Selection",
    "SelectionSpec",
    "choose_excluded_ids",
    "choose_layers",
    "parse_selection",
    "parse_tokens",
    "string_layers_problem",
    "token_ids_of",
    "token_ids_problem",
    "token_positions",
]
