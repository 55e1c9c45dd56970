"""The on-disk protocol (protocol.md, normative): every byte rule, parsed type and offset formula.

* `v3`: protocol 3.0, this library's own; `v31`: protocol 3.1 (float8_e4m3 with scale
  files, blocks.json), the version it writes by default; `v32`: protocol 3.2 (metadata's
  optional ``sites``: what each layer slot holds, `sites`), written for caches with sites;
* `saev_code`: protocol 2.1 as saev's code writes it (``"saev"``, 8-digit names, and
  ``"saev-64"``, the 64-digit names of caches written before 2025-10-14);
* `saev_spec`: protocol 2.1 as saev's protocol document describes it (read only);
* `saev_history`: the eight formats saev wrote before 2.1, November 2024 to October 2025
  (saev 0.1.0, protocols 1.0.0, 1.1 and 2.0, ...: read in place, never written);
* `v21`: the files both 2.1 dialects share; `common`: names, dtypes and limits;
  `jsonfile`: the one strict JSON loader every JSON file of a cache goes through;
* `versions`: every dialect by name and the one a metadata.json is written in (`detect`);
* the parsed types: `metadata` (`Metadata`, the configuration a cache is a pure function
  of), `manifest` (`Manifest`, the data files and their digests); the offsets: `layout`
  (protocol.md 3 and 4); float8_e4m3's scale rule and a numpy reference of it: `float8`
  (protocol.md 5; the fast engines are `saev_shards.codecs`); the writer's staging folder
  names: `staging`; the checks of a JSON object's keys: `checks`.

Each version is a `Dialect`; the reader, the writer and the store ask it (`Metadata.rules`,
`detect`) rather than compare version strings. This package is also what
``saev_shards.format`` (the old name of its constants and helpers) imports as.
"""

from __future__ import annotations

from ..errors import ProtocolWarning
from .common import (
    CACHE_NAME_RE,
    CHECKSUMS_FILE,
    COLUMN_DTYPES,
    DEFAULT_DTYPE,
    DTYPES,
    DTYPES_BY_PROTOCOL,
    FIELD_NAME_RE,
    HASH_RE,
    JSON_SLACK_BYTES,
    LABELS_DTYPE,
    LABELS_FILE,
    LEGACY_PROTOCOL,
    MANIFEST_BYTES_PER_SHARD,
    MANIFEST_FILE,
    MAX_METADATA_BYTES,
    METADATA_FILE,
    PROTOCOL,
    SHARD_NAME_RE,
    STATS_BYTES_PER_NUMBER,
    STATS_FILE,
    SUPPORTED_PROTOCOLS,
    XXH3_RE,
    column_file,
    manifest_max_bytes,
    shard_name,
    stats_max_bytes,
    text_file,
)
from .dialect import Dialect
from .jsonfile import (
    JSON_INT_MAX,
    JSON_INT_MIN,
    MAX_JSON_DEPTH,
    is_int,
    json_value_problem,
    read_json_file,
    short_list,
    short_repr,
    strict_json_loads,
    type_name,
)
from .manifest import Manifest
from .metadata import Metadata, Site
from .v3 import canonical_json, content_hash, pretty_json
from .versions import DEFAULT_DIALECTS, DIALECTS, check_version, detect, dialect, is_cache_name

__all__ = [
    "CACHE_NAME_RE",
    "CHECKSUMS_FILE",
    "COLUMN_DTYPES",
    "DEFAULT_DIALECTS",
    "DEFAULT_DTYPE",
    "DIALECTS",
    "DTYPES",
    "DTYPES_BY_PROTOCOL",
    "FIELD_NAME_RE",
    "HASH_RE",
    "JSON_INT_MAX",
    "JSON_INT_MIN",
    "JSON_SLACK_BYTES",
    "LABELS_DTYPE",
    "LABELS_FILE",
    "LEGACY_PROTOCOL",
    "MANIFEST_BYTES_PER_SHARD",
    "MANIFEST_FILE",
    "MAX_JSON_DEPTH",
    "MAX_METADATA_BYTES",
    "METADATA_FILE",
    "PROTOCOL",
    "SHARD_NAME_RE",
    "STATS_BYTES_PER_NUMBER",
    "STATS_FILE",
    "SUPPORTED_PROTOCOLS",
    "XXH3_RE",
    "Dialect",
    "Manifest",
    "Metadata",
    "ProtocolWarning",
    "Site",
    "canonical_json",
    "check_version",
    "column_file",
    "content_hash",
    "detect",
    "dialect",
    "is_cache_name",
    "is_int",
    "json_value_problem",
    "manifest_max_bytes",
    "pretty_json",
    "read_json_file",
    "shard_name",
    "short_list",
    "short_repr",
    "stats_max_bytes",
    "strict_json_loads",
    "text_file",
    "type_name",
]
