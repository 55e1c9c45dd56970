"""The versions this library reads: every dialect by name (`DIALECTS`), the one a
``protocol=`` alone means (`DEFAULT_DIALECTS`), and the one a parsed metadata.json is
written in (`detect`); `check_version` for a version string alone.
"""

from __future__ import annotations

from ..errors import MetadataError, ProtocolVersionError
from . import saev_code, saev_history, saev_spec, v3, v31, v32
from .common import (
    CACHE_NAME_RE,
    PROTOCOL,
    PROTOCOL_30,
    PROTOCOL_32,
    SAEV_20_PROTOCOL,
    SAEV_CODE_PROTOCOLS,
    SUPPORTED_PROTOCOLS,
)
from .dialect import Dialect
from .jsonfile import short_repr, type_name

#: Every dialect by name (`Metadata.dialect`).
DIALECTS: dict[str, Dialect] = {
    d.name: d
    for d in (
        v31.DIALECT,
        v32.DIALECT,
        v3.DIALECT,
        saev_code.DIALECT,
        saev_code.DIALECT_64,
        saev_spec.DIALECT,
        *saev_history.DIALECTS,
    )
}
#: What ``protocol=`` alone means: the dialect a cache of that version is written in.
DEFAULT_DIALECTS = {
    PROTOCOL: v31.DIALECT.name,
    PROTOCOL_32: v32.DIALECT.name,
    PROTOCOL_30: v3.DIALECT.name,
    **{p: saev_code.DIALECT.name for p in SAEV_CODE_PROTOCOLS},
    SAEV_20_PROTOCOL: saev_history.Protocol20Orjson.name,
}


def dialect(name: str) -> Dialect:
    """The dialect called ``name``; `MetadataError` naming the choices otherwise."""
    try:
        return DIALECTS[name]
    except (KeyError, TypeError):
        raise MetadataError(f"dialect: expected one of {list(DIALECTS)}, found {short_repr(name)}") from None


def check_version(version: object) -> str:
    """Return ``version`` if this library reads it; raise `ProtocolVersionError` otherwise."""
    if not isinstance(version, str) or version not in SUPPORTED_PROTOCOLS:
        raise ProtocolVersionError(
            f"unsupported protocol version {short_repr(version)}; this library reads "
            f"{', '.join(repr(v) for v in SUPPORTED_PROTOCOLS)}"
        )
    return version


def detect(obj: object, dirname: str | None = None) -> Dialect:
    """The dialect a parsed metadata.json is written in.

    By its ``protocol`` (`ProtocolVersionError` for one this library does not read); a 2.1
    cache is saev's document's when it has the document's keys (``patches_per_ex`` or
    ``patches_per_shard``), else saev's code's, whose 64-digit directory names (``dirname``)
    mark the older ``"saev-64"``. saev's earlier formats (`saev_history`) are told by their
    keys: without a ``protocol`` key those before 1.0.0 (``seed``, ``n_imgs``, ...), with
    "1.0.0" or "1.1" those of the vision-transformer keys (``vit_family``, ...), with "2.0"
    saev 2.0's two, whose hash rules ``dirname`` tells apart. Keys of two formats mixed, or
    keys two formats fit equally, are a `MetadataError`.
    """
    if not isinstance(obj, dict):
        raise MetadataError(f"expected a JSON object, found {type_name(obj)}")
    everyone = tuple(DIALECTS.values())
    if "protocol" not in obj:
        if saev_history.UNVERSIONED_KEYS.intersection(obj):
            return saev_history.pick(obj, (*saev_history.UNVERSIONED_DIALECTS, v3.DIALECT), everyone)
        return v3.DIALECT  # reported as a missing key
    version = check_version(obj["protocol"])
    if version == PROTOCOL:
        return v31.DIALECT
    if version == PROTOCOL_32:
        return v32.DIALECT
    if version == PROTOCOL_30:
        return v3.DIALECT
    if version == SAEV_20_PROTOCOL or (version in ("1.0.0", "1.1") and saev_history.V1_KEYS.intersection(obj)):
        candidates = [d for d in everyone if version in d.protocols and d is not saev_code.DIALECT_64]
        found = saev_history.pick(obj, candidates, everyone)
        return saev_history.by_name(found, obj, dirname, DIALECTS)
    if version in saev_spec.DIALECT.protocols and ("patches_per_ex" in obj or "patches_per_shard" in obj):
        return saev_spec.DIALECT
    if dirname is not None and len(dirname) == 64:
        return saev_code.DIALECT_64
    return saev_code.DIALECT


def is_cache_name(name: str) -> bool:
    """Whether ``name`` can be a cache's directory name (64 hex digits, or saev's 8)."""
    return CACHE_NAME_RE.fullmatch(name) is not None
