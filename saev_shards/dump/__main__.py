"""``python -m saev_shards.dump CONFIG ...``: ``saev-shards dump`` without the console script
(torchrun starts modules: ``torchrun --nproc-per-node 8 -m saev_shards.dump dump.toml``).

An entry point above every layer, like the console script: it is run, never imported, so
the dump package itself does not import the command line (one set of exit codes:
`saev_shards.cli`).
"""

import sys

from saev_shards.cli import main

sys.exit(main(["dump", *sys.argv[1:]]))
