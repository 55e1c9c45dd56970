"""The source kinds and the targets `saev-shards convert` knows.

Adding a source kind is one module (``detect`` and ``open_source``, see `base`) plus one
`SourceKind` entry in `SOURCES`; adding a target is one `Target` entry in `TARGETS`.
Detection asks each kind in `SOURCES` order and takes the first that claims the path.
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from types import ModuleType

from ..errors import ConvertOptionError
from ..protocol.common import DTYPES_BY_PROTOCOL, LEGACY_PROTOCOL, PROTOCOL, PROTOCOL_30


@dataclasses.dataclass(frozen=True)
class SourceKind:
    """A kind of source: the module that reads it, what it is, and the extra it needs."""

    name: str
    module: str
    summary: str
    #: ``pip install 'saev-shards[<extra>]'`` provides what it imports; None: the core suffices.
    extra: str | None

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


@dataclasses.dataclass(frozen=True)
class Target:
    """What a conversion writes: a protocol version, the dtypes it allows, and whether it holds
    per-example columns, text and statistics (protocol 2.1 holds activations and labels only)."""

    name: str
    protocol: str
    dtypes: tuple[str, ...]
    default_dtype: str
    extras: bool
    summary: str


SOURCES: dict[str, SourceKind] = {
    k.name: k
    for k in [
        SourceKind(
            "cache",
            "saev_shards.convert.cache",
            "a cache of this library or of saev's code, any protocol (a folder named by its hash)",
            None,
        ),
        SourceKind(
            "pickle",
            "saev_shards.convert.pickle_shards",
            "pickle shards: metadata.json + shard_NNNN.pkl.gz or .pkl",
            None,
        ),
        SourceKind(
            "zarr",
            "saev_shards.convert.zarr_logs",
            "zarr activation logs: activations.zarr/, or shards/shard-XXXX.zarr + manifest.json",
            "convert",
        ),
        SourceKind(
            "saelens",
            "saev_shards.convert.saelens",
            "SAELens activation cache: a Hugging Face datasets folder, one Array2D column per hook",
            "convert",
        ),
        SourceKind("npy", "saev_shards.convert.npy", "a numpy .npy of shape (N, L, T, D), memory-mapped", None),
    ]
}

TARGETS: dict[str, Target] = {
    t.name: t
    for t in [
        Target(
            PROTOCOL,
            PROTOCOL,
            DTYPES_BY_PROTOCOL[PROTOCOL],
            "float16",
            True,
            f"an ordinary cache of this library (protocol {PROTOCOL}, the default)",
        ),
        Target(
            PROTOCOL_30,
            PROTOCOL_30,
            DTYPES_BY_PROTOCOL[PROTOCOL_30],
            "float16",
            True,
            f"a cache of this library's protocol {PROTOCOL_30}, for readers that know no later version",
        ),
        Target(
            "saev",
            LEGACY_PROTOCOL,
            DTYPES_BY_PROTOCOL[LEGACY_PROTOCOL],
            "float32",
            False,
            "a cache saev's own code reads as its own (protocol 2.1 as saev writes it, float32)",
        ),
    ]
}


def source_kind(name: str) -> SourceKind:
    try:
        return SOURCES[name]
    except KeyError:
        raise ConvertOptionError(f"--from: expected one of {', '.join(SOURCES)}, found {name!r}") from None


def target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise ConvertOptionError(f"--to: expected one of {', '.join(TARGETS)}, found {name!r}") from None


def detect(path: Path) -> SourceKind:
    """The first kind whose ``detect`` claims ``path``; `ConvertOptionError` listing the kinds otherwise."""
    for kind in SOURCES.values():
        if kind.load().detect(path):
            return kind
    kinds = "; ".join(f"{k.name}: {k.summary}" for k in SOURCES.values())
    raise ConvertOptionError(f"{path}: not a source kind convert recognises; name one with --from ({kinds})")
