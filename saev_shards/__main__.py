"""``python -m saev_shards``: the same command line as the ``saev-shards`` console script."""

from .cli import run

run()
