"""``python -m saev_shards``: the same command line as the ``saev-shards`` console script."""

import sys

from .cli import main

sys.exit(main())
