"""Protocol 2.1 as saev's own code writes and reads it (protocol.md section 9): metadata.json and the name.

saev's caches are made by its ``ShardWriter`` (``saev.data.shards``), not by its protocol
document (`saev_spec`), and the two disagree. The code (commit 3d73f1f, 2026-03; the
fixtures under tests/data/saev-code-* were written by it):

* metadata.json is ``orjson.dumps(<its Metadata dataclass>, option=OPT_INDENT_2)``: the 13
  keys of `KEYS` in that order, a 2-space indent, non-ASCII characters as raw UTF-8, no
  final newline;
* the directory name is the first 8 hex digits of the sha256 of the same fields serialised
  compactly (``orjson.dumps``), in field order (its sort-keys option does not reorder a
  dataclass's fields); caches written before 2025-10-14 carry all 64 digits
  (dialect ``"saev-64"``);
* its loader calls ``Metadata(**dict)``: a missing or an extra key is an error there, and
  so is a value outside what it declares (`SAEV_FAMILIES`, `PIXEL_AGGS`, ``dtype``
  "float32", ``protocol`` one of "1.0.0", "1.1", "2.1", ``data`` a string: base64 of a
  pickle, never decoded here);
* its readers require the cache's path to end in ``saev/shards/<name>``, its writers a
  root ending in ``saev/shards``.

The files beside metadata.json are `v21`'s. Reading is lenient where saev was over time
(any family string; ``pixel_agg`` null, as older versions wrote it); writing refuses what
saev's current loader would reject (`check_writable`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, ClassVar

import orjson

from ..errors import Problems
from .common import SAEV_CODE_PROTOCOLS
from .jsonfile import short_repr
from .v21 import V21Files

if TYPE_CHECKING:
    from .metadata import Metadata

#: metadata.json's keys, in the order saev's Metadata dataclass declares (and writes) them.
KEYS = (
    "family",
    "ckpt",
    "layers",
    "content_tokens_per_example",
    "cls_token",
    "d_model",
    "n_examples",
    "max_tokens_per_shard",
    "data",
    "dataset",
    "pixel_agg",
    "dtype",
    "protocol",
)
#: The model families saev's Metadata accepts.
SAEV_FAMILIES = ("bird-mae", "clip", "dinov2", "dinov3", "fake-clip", "pe-core", "pe-spatial", "siglip")
#: How patch labels were aggregated from pixel labels; saev writes "majority" when there are none.
PIXEL_AGGS = ("majority", "prefer-fg")
DEFAULT_PIXEL_AGG = "majority"
#: Hex digits of the directory name saev's code writes since 2025-10-14 (before: all 64).
SHORT_NAME_DIGITS = 8
#: Where saev's writers and readers expect caches: ``.../saev/shards/<name>``.
SAEV_ROOT_PARTS = ("saev", "shards")


class SaevCode(V21Files):
    """saev's code, 8-digit names (``"saev"``); `SaevCode64` for the older 64-digit names."""

    name = "saev"
    summary = "protocol 2.1 as saev's code writes it"
    protocols = SAEV_CODE_PROTOCOLS
    keys = KEYS
    renames: ClassVar[Mapping[str, str]] = {
        "content_tokens_per_example": "patches_per_ex",
        "max_tokens_per_shard": "patches_per_shard",
    }
    data_types = (str,)
    has_pixel_agg = True
    digits = SHORT_NAME_DIGITS

    def metadata_bytes(self, md: Metadata) -> bytes:
        return orjson.dumps(self.to_json(md), option=orjson.OPT_INDENT_2)

    def directory_name(self, md: Metadata) -> str:
        return hashlib.sha256(orjson.dumps(self.to_json(md))).hexdigest()[: self.digits]

    def check_values(self, fields: Mapping[str, Any], problems: Problems) -> None:
        super().check_values(fields, problems)
        pixel_agg = fields["pixel_agg"]
        if pixel_agg is not None and pixel_agg not in PIXEL_AGGS:
            problems.expected("pixel_agg", f"one of {list(PIXEL_AGGS)} or None", short_repr(pixel_agg))

    def check_writable(self, md: Metadata, problems: Problems) -> None:
        if md.family not in SAEV_FAMILIES:
            problems.add(f"family: saev reads only {', '.join(SAEV_FAMILIES)}; found {md.family!r}", field="family")
        if md.pixel_agg is None and self.digits == SHORT_NAME_DIGITS:
            problems.add(
                f"pixel_agg: saev requires one of {list(PIXEL_AGGS)} (how patch labels were aggregated; "
                "saev itself writes 'majority' when there are no labels); found None (pass pixel_agg=...)",
                field="pixel_agg",
            )
        normal = str(PurePosixPath(md.dataset))
        if md.dataset != normal:
            # saev's loader makes a pathlib.Path of it, so the value it sees (and hashes) is the normal form.
            problems.add(
                f"dataset: saev stores a path; expected its normal form {normal!r}, found {md.dataset!r}",
                field="dataset",
            )

    def empty_shards(self, md: Metadata) -> int:
        """saev's writer opens the next shard file as soon as one is full, and lists it at the
        end with ``n_examples`` 0: one all-zero file when the examples fill the last shard
        exactly (also for an empty cache)."""
        return 1 if md.n_examples % md.examples_per_shard == 0 else 0


class SaevCode64(SaevCode):
    """saev's code before 2025-10-14: the same bytes, all 64 digits of the hash as the name."""

    name = "saev-64"
    summary = "protocol 2.1 as saev's code wrote it before 2025-10-14 (64-digit names)"
    digits = 64


DIALECT = SaevCode()
DIALECT_64 = SaevCode64()
