"""A perfectly shuffled copy of a cache's chosen tokens, written at sequential disk speed.

>>> shuffled = shuffle_cache("/scratch/saev/shards/3f2a...", layers=11, seed=0)   # doctest: +SKIP
>>> shuffled.shape                                                                  # doctest: +SKIP
(251_108_732, 1, 1, 768)

The result is an ordinary protocol 3.0 cache with one token per example (``patches_per_ex``
1, no CLS) and the chosen layers as its layers: row ``j`` is one ``(example, token)`` of the
source at every chosen layer, and rows are in a uniformly random order (`order`). Reading
it in order (`saev_shards.loaders.OrderedLoader`, or a memmap) gives a perfectly shuffled
epoch with sequential reads. Columns ``source_example`` and ``source_token`` (and
``labels.bin``, per-token columns such as ``token_ids``) say where each row came from;
``metadata.data.shuffle`` records the source hash, the selection and the seed, so the same
source, selection, seed and dtype give the same hash and the same bytes.

How: an external shuffle in two passes with bounded memory (`plan`). The scatter pass
reads the source once in chunks and writes each chunk's tokens grouped by bucket (`scatter`);
the write pass loads one bucket at a time, sorts it by key and appends it through
`ShardWriter` (`write_pass`). Both passes read and write large sequential blocks; a killed
shuffle resumes where it stopped (sealed runs are kept, the writer resumes after its last
sealed shard) and ends with byte-identical output; nothing is published until the end.
"""

from .options import DEFAULT_MEMORY, ShuffleOptions
from .order import bucket_of, shuffle_order, sort_keys
from .plan import SOURCE_EXAMPLE, SOURCE_TOKEN, ShufflePlan, make_plan
from .ranks import run_rank
from .run import plan_shuffle, run_plan, shuffle_cache
from .scatter import CLS_LABEL

__all__ = [
    "CLS_LABEL",
    "DEFAULT_MEMORY",
    "SOURCE_EXAMPLE",
    "SOURCE_TOKEN",
    "ShuffleOptions",
    "ShufflePlan",
    "bucket_of",
    "make_plan",
    "plan_shuffle",
    "run_plan",
    "run_rank",
    "shuffle_cache",
    "shuffle_order",
    "sort_keys",
]
