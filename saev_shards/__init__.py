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
"""

from . import errors, layout, store
from .dtypes import bf16_to_float32, to_float32
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
from .format import LEGACY_PROTOCOL, PROTOCOL, SUPPORTED_PROTOCOLS, ProtocolWarning, content_hash
from .manifest import Manifest
from .metadata import Metadata, Site
from .reader import Shards, TextColumn
from .shuffle import shuffle_cache
from .store import open_cache as open
from .writer import ShardWriter, finalize

__version__ = "0.1.0"

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
