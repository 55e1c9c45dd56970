"""``python -m saev_shards.dump CONFIG ...``: ``saev-shards dump`` without the console script
(torchrun starts modules: ``torchrun --nproc-per-node 8 -m saev_shards.dump dump.toml``)."""

import sys

from . import main

sys.exit(main())
