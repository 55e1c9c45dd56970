"""``python -m saev_shards.demo`` (what ``make demo`` runs): `saev_shards.demo.run.main`."""

import sys

from .run import main

sys.exit(main(sys.argv[1:]))
