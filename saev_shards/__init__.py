"""saev_shards: the saev sharded activation protocol, read and written at the speed of the disk.

>>> import saev_shards as ss
>>> md = ss.Metadata(family="clip", ckpt="ViT-B-16/openai", layers=(6, 11), patches_per_ex=196,
...                  cls_token=True, d_model=768, n_examples=10_000, patches_per_shard=2_400_000,
...                  data={"name": "imagenet-1k"}, dataset="/data/imagenet")
>>> with ss.ShardWriter(root, md) as w:        # doctest: +SKIP
...     w.write(acts)                           # (B, 2, 197, 768)
>>> shards = ss.open(root / md.hash)           # doctest: +SKIP
>>> shards.example(0, layer=11).shape          # doctest: +SKIP
(197, 768)

The core needs numpy, orjson and xxhash only; torch is imported lazily by the loaders
and the recorder. protocol.md is the normative description of the bytes on disk.

The package, bottom up: `errors`; `protocol` (every byte rule, the parsed `Metadata` and
`Manifest`, the offsets); `codecs` (float8_e4m3 and bfloat16 at speed); `fileio`; `remote`;
`reader` (`Shards`) and `writer` (`ShardWriter`); `store` (roots and the catalogue of
caches); `loaders`, `shuffle`, `convert`, `dump`; `cli`; `demo`. Modules that moved into
these packages keep their earlier import paths (`_compat`).
"""

from types import ModuleType
from typing import TYPE_CHECKING

from . import _compat, errors, store
from .codecs.bfloat16 import bf16_to_float32
from .codecs.dtypes import to_float32
from .errors import (
    AlreadyPublishedError,
    AmbiguousPrefixError,
    CacheInUseError,
    CacheNotFoundError,
    CacheRefError,
    ChecksumMismatchError,
    ConfigError,
    DiskFullError,
    DtypeError,
    DtypeRangeError,
    DumpError,
    FileSizeError,
    HashMismatchError,
    InvalidCacheError,
    JSONFileError,
    LayerIndexError,
    LoaderError,
    ManifestError,
    MetadataError,
    MetadataFileError,
    MissingDependencyError,
    NameNotFoundError,
    NonFiniteError,
    NotRegularFileError,
    ProtocolVersionError,
    ProtocolWarning,
    RecorderError,
    RootNotSetError,
    RunError,
    RunExistsError,
    RunNotFoundError,
    RunWarning,
    ScaleError,
    ShardsError,
    ShuffleError,
    SlowPathWarning,
    StatsFileError,
    TokenizerError,
    UnexpectedFileError,
    UnknownCacheError,
    WriterBusyError,
    WriterError,
)
from .protocol import layout
from .protocol.common import LEGACY_PROTOCOL, PROTOCOL, SUPPORTED_PROTOCOLS
from .protocol.manifest import Manifest
from .protocol.metadata import Metadata, Site
from .protocol.v3 import content_hash
from .reader import Shards, TextColumn
from .shuffle import shuffle_cache
from .store import open_cache as open
from .writer import ShardWriter, finalize

__version__ = "0.1.0"


if not TYPE_CHECKING:  # hidden from type checkers, so a misspelt `ss.name` is still an error there

    def __getattr__(name: str) -> ModuleType:
        return _compat.attribute(name)  # a module's earlier name (`saev_shards.float8`), imported on first use


__all__ = [
    "LEGACY_PROTOCOL",
    "PROTOCOL",
    "SUPPORTED_PROTOCOLS",
    "AlreadyPublishedError",
    "AmbiguousPrefixError",
    "CacheInUseError",
    "CacheNotFoundError",
    "CacheRefError",
    "ChecksumMismatchError",
    "ConfigError",
    "DiskFullError",
    "DtypeError",
    "DtypeRangeError",
    "DumpError",
    "FileSizeError",
    "HashMismatchError",
    "InvalidCacheError",
    "JSONFileError",
    "LayerIndexError",
    "LoaderError",
    "Manifest",
    "ManifestError",
    "Metadata",
    "MetadataError",
    "MetadataFileError",
    "MissingDependencyError",
    "NameNotFoundError",
    "NonFiniteError",
    "NotRegularFileError",
    "ProtocolVersionError",
    "ProtocolWarning",
    "RecorderError",
    "RootNotSetError",
    "RunError",
    "RunExistsError",
    "RunNotFoundError",
    "RunWarning",
    "ScaleError",
    "ShardWriter",
    "Shards",
    "ShardsError",
    "ShuffleError",
    "Site",
    "SlowPathWarning",
    "StatsFileError",
    "TextColumn",
    "TokenizerError",
    "UnexpectedFileError",
    "UnknownCacheError",
    "WriterBusyError",
    "WriterError",
    "__version__",
    "bf16_to_float32",
    "content_hash",
    "errors",
    "finalize",
    "layout",
    "open",
    "shuffle_cache",
    "store",
    "to_float32",
]
