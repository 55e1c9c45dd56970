"""`saev-shards convert`: bring caches in from the formats users already have.

One command converts a source into an ordinary cache, streaming with bounded memory,
verifying the checksums the source carries, publishing atomically and resuming after a
kill (docs/convert.md). Source kinds, detected or named with ``--from``:

* ``pickle``: pickle shards (the pickle.gz activation shard format), loaded only with a restricted unpickler;
* ``zarr``: zarr activation logs, single store or sharded;
* ``saelens``: SAELens' cached activations (a Hugging Face ``datasets`` folder);
* ``npy``: a plain ``.npy`` of shape (N, L, T, D), memory-mapped.

>>> from saev_shards.convert import convert, Options
>>> result = convert("activations/", root="shards", options=Options(max_tokens=128))  # doctest: +SKIP
>>> result.path, result.report.lines()                                                # doctest: +SKIP
"""

from .base import Chunk, Options, Plan, Report, Source, SourcePlan
from .registry import SOURCES, TARGETS, SourceKind, Target, detect
from .run import ConvertOptions, Prepared, Result, convert, metadata_for, prepare, run

__all__ = [
    "SOURCES",
    "TARGETS",
    "Chunk",
    "ConvertOptions",
    "Options",
    "Plan",
    "Prepared",
    "Report",
    "Result",
    "Source",
    "SourceKind",
    "SourcePlan",
    "Target",
    "convert",
    "detect",
    "metadata_for",
    "prepare",
    "run",
]
