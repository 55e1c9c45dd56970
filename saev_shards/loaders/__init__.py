"""PyTorch training loaders: shuffled batches of token vectors at disk speed, ordered walks, datasets.

`ShuffledLoader` is the training path. Each epoch it cuts the cache into blocks of whole
examples (``block_bytes``, 4 MiB by default; one ``pread`` each, or one per ``(example,
layer)`` when few layers of large slices are chosen), permutes the blocks over the whole
cache, loads consecutive runs of them into a shuffle window (``buffer_bytes``) with
background threads, permutes every chosen token vector of the window, and gathers batches
with vectorised ``take`` calls on a pool of threads (or, with ``device="cuda"``, on the
GPU). Everything random is drawn from ``(seed, epoch, window)``, so the batches do not
depend on thread timing and `state_dict` resumes mid-epoch exactly. ``stack_layers=True``
yields ``(B, L, D)`` batches: one ``(example, token)`` at every chosen layer.

`OrderedLoader` walks the same selection in ``(example, layer, token)`` order with
sequential reads; both are `TokenLoader` with an order strategy. The map-style datasets
(`TokenDataset`, `ExampleDataset`, `LayerPairDataset`) work with torch's DataLoader.
torch is imported when a loader is created, never at import time.

The package, one job per module: `selection` (which tokens, on `saev_shards.selection`),
`plan` (read spans, windows and each window's order; pure numpy), `order` (the order
strategies), `schedule` (what an epoch runs: the settings, the chunks), `pools` (threads
kept across epochs), `windows` (reading windows), `host_run` (an epoch on the host),
`device` (the device-side shuffle), `mapped` (the cache read in place), `token_loader`
(the loaders), `datasets` (map-style datasets), `batch`, `outputs`, `tensors` (torch
helpers); the world is `saev_shards.world`.

>>> loader = ShuffledLoader(shards, batch_size=4096, layers=11, out_dtype="float32")  # doctest: +SKIP
>>> for batch in loader:                                                             # doctest: +SKIP
...     loss = sae(batch.acts.cuda(non_blocking=True))
"""

from ..errors import LoaderError
from .batch import Batch
from .datasets import ExampleDataset, LayerPairDataset, TokenDataset
from .order import Order, Sequential, ShuffledWindows
from .plan import BLOCK_BYTES, MIN_SLICE_READ
from .selection import CLS_LABEL, OUT_DTYPES, TOKEN_CHOICES, TokenSelection, as_shards, parse_layers, parse_out_dtype
from .tensors import to_tensor, torch_dtype
from .threads import default_gather_threads, default_read_threads
from .token_loader import OrderedLoader, ShuffledLoader, TokenLoader

__all__ = [
    "BLOCK_BYTES",
    "CLS_LABEL",
    "MIN_SLICE_READ",
    "OUT_DTYPES",
    "TOKEN_CHOICES",
    "Batch",
    "ExampleDataset",
    "LayerPairDataset",
    "LoaderError",
    "Order",
    "OrderedLoader",
    "Sequential",
    "ShuffledLoader",
    "ShuffledWindows",
    "TokenDataset",
    "TokenLoader",
    "TokenSelection",
    "as_shards",
    "default_gather_threads",
    "default_read_threads",
    "parse_layers",
    "parse_out_dtype",
    "to_tensor",
    "torch_dtype",
]
