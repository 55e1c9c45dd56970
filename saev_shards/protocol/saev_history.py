"""saev's earlier on-disk formats, November 2024 to October 2025 (protocol.md 9.5): read in place, never written.

Before the protocol 2.1 its code writes today (`saev_code`), saev wrote its caches in eight
other formats, and the caches its users hold from then (those of its paper era, and those of
its only release on the package index, saev==0.1.0) are in them. Each format is one `SaevHistory`
dialect below, as data: its metadata.json keys in the order written and the `Metadata` field
each one is (`renames`), the values of the fields it has no key for (`defaults`: float32, no
protocol, no dataset), the rule its directory name is the hash by (`hash_rule`), its
shards.json (the count key, or no shards.json at all) and whether it has labels.

What every one of them shares with 2.1 (`v21`): float32 values; shard files ``acts<06d>.bin``,
C order ``(S, L, T, D)`` with ``T = patches + cls_token`` and ``S = budget // (L * T)``; every
shard file written at full size by a memmap, so the last one is zero-padded past the last
example and the example count comes from metadata.json, never from file sizes; one more
all-zero full-size file when the examples fill the last shard exactly (the writer has opened
it already; listed with a count of 0 where there is a shards.json); ``labels.bin`` uint8
``(n_examples, patches)`` where the format has labels; no checksums.

Told apart by the keys of metadata.json (`saev_shards.protocol.detect`): a cache's keys must be
exactly one format's, and keys of two formats mixed are refused. saev 2.0's two writers
(json, then orjson) wrote the same metadata.json and differ in the hash alone: the directory
name says which. The fixtures under tests/data/saev-history were written by each version's code.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import orjson

from ..errors import ManifestError, MetadataError, Problem, Problems, UnexpectedFileError
from .checks import JSONChecks
from .common import (
    LABELS_DTYPE,
    LABELS_FILE,
    SAEV_20_PROTOCOL,
    UNVERSIONED,
    manifest_max_bytes,
    shard_name,
)
from .dialect import Dialect
from .jsonfile import load_json, short_list, short_repr
from .manifest import ArrayEntry, Manifest, ShardEntry, ShardList
from .saev_code import KEYS as SAEV_CODE_KEYS
from .saev_code import PIXEL_AGGS
from .v21 import V21Files, parse_shard_list

if TYPE_CHECKING:
    from .metadata import Metadata


def _json_sorted(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True).encode("utf-8")


def _json_compact(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _orjson_fields(obj: object) -> bytes:
    """``orjson.dumps(<saev's Metadata dataclass>, option=OPT_SORT_KEYS)``: the option sorts the
    keys of dicts (``data``), not a dataclass's fields, which stay in field order."""
    assert isinstance(obj, dict)
    items = (orjson.dumps(k) + b":" + orjson.dumps(v, option=orjson.OPT_SORT_KEYS) for k, v in obj.items())
    return b"{" + b",".join(items) + b"}"


#: The rules a directory name was the sha256 hex digest (all 64 digits) of: the bytes, and in words.
HASH_RULES: dict[str, tuple[Callable[[object], bytes], str]] = {
    "json": (_json_sorted, "sha256 of json.dumps(fields, sort_keys=True)"),
    "json-compact": (_json_compact, "sha256 of json.dumps(fields, sort_keys=True, separators=(',', ':'))"),
    "orjson": (_orjson_fields, "sha256 of orjson.dumps(fields, option=OPT_SORT_KEYS): field order, data's keys sorted"),
}


def name_by_rule(obj: object, rule: str) -> str | None:
    """The directory name metadata.json's object ``obj`` has under hash rule ``rule``; None
    when its values cannot be serialised so (a damaged file: its problems are reported elsewhere)."""
    try:
        return hashlib.sha256(HASH_RULES[rule][0](obj)).hexdigest()
    except (TypeError, ValueError, orjson.JSONEncodeError):
        return None


#: Keys of the vision-transformer era (saev 0.1.0 to 1.1) and their `Metadata` fields.
_VIT_RENAMES = {
    "vit_family": "family",
    "vit_ckpt": "ckpt",
    "n_patches_per_img": "patches_per_ex",
    "d_vit": "d_model",
    "n_imgs": "n_examples",
}
_NO_CHECKSUMS = "checksums"


class SaevHistory(V21Files):
    """One of saev's earlier formats (module docstring); the subclasses below are the data."""

    sidecar_names: tuple[str, ...] = ()
    data_types: tuple[type, ...] = (dict,)
    defaults: ClassVar[Mapping[str, Any]] = {"dataset": ""}
    count_key = "n_imgs"
    #: The key of `HASH_RULES` the directory name follows.
    hash_rule = "json-compact"
    #: How its writer wrote metadata.json: ``json.dump(fields, fd, indent=4)`` ("json") or
    #: ``orjson.dumps(fields, option=OPT_INDENT_2)`` ("orjson"); no final newline either way.
    writer = "json"
    #: ``labels.bin`` may be there.
    has_labels = False
    #: saev's commits that wrote the format.
    commits = ""
    history = True

    def name_rule(self) -> str:
        return HASH_RULES[self.hash_rule][1]

    def metadata_bytes(self, md: Metadata) -> bytes:
        obj = self.to_json(md)
        if self.writer == "orjson":
            return orjson.dumps(obj, option=orjson.OPT_INDENT_2)
        return json.dumps(obj, indent=4).encode("utf-8")

    def directory_name(self, md: Metadata) -> str:
        return hashlib.sha256(HASH_RULES[self.hash_rule][0](self.to_json(md))).hexdigest()

    def check_values(self, fields: Mapping[str, Any], problems: Problems) -> None:
        super().check_values(fields, problems)
        pixel_agg = fields["pixel_agg"]
        if self.has_pixel_agg and pixel_agg is not None and pixel_agg not in PIXEL_AGGS:
            problems.expected("pixel_agg", f"one of {list(PIXEL_AGGS)} or None", short_repr(pixel_agg))

    def check_writable(self, md: Metadata, problems: Problems) -> None:
        problems.add(
            f"dialect: {self.summary} is one of saev's earlier formats, read in place and never written; "
            "write protocol '2.1' (dialect 'saev', which saev reads today), or convert a cache "
            "(`saev-shards convert DIR --to saev`)",
            field="dialect",
        )

    def empty_shards(self, md: Metadata) -> int:
        """saev's writer opened the next file as soon as one was full: one all-zero file after a
        last shard filled exactly (also for an empty cache)."""
        return 1 if md.n_examples % md.examples_per_shard == 0 else 0

    def load_manifest(self, folder: Path, md: Metadata) -> tuple[Manifest | None, list[Problem]]:
        """The shards from shards.json (or, before 1.0.0, from metadata.json alone), each file full
        size or, for the last shard, exactly its examples (padding dropped by hand); the empty
        file after a shard filled exactly, full size or empty (listed in shards.json where there
        is one, optional where there is none); labels.bin where the format has labels."""
        problems: list[Problem] = []
        labels_path = folder / LABELS_FILE
        if not self.has_labels and os.path.lexists(labels_path):
            why = f"{self.summary} has no labels; saev wrote no labels.bin then"
            problems.append(Problem(UnexpectedFileError, f"{labels_path}: {why}"))
        if self.manifest_file is None:
            entries = [(shard_name(k), md.shard_n_examples(k)) for k in range(md.n_shards)]
            after = folder / shard_name(md.n_shards)
            if md.n_examples % md.examples_per_shard == 0 and os.path.lexists(after):
                entries.append((after.name, 0))
        else:
            path = folder / self.manifest_file
            obj, more = load_json(path, manifest_max_bytes(md.n_shards), ManifestError, every_number=False)
            if more:
                return None, more
            checks = JSONChecks(str(path))
            parsed = parse_shard_list(obj, checks, self.count_key)
            if parsed is None or checks:
                return None, checks.problems
            entries = parsed
        if problems:
            return None, problems
        # The file saev's writer left after a shard filled exactly: listed, not a shard.
        trailing: list[tuple[str, int]] = []
        while len(entries) > md.n_shards and entries[-1][1] == 0 and entries[-1][0] == shard_name(len(entries) - 1):
            trailing.insert(0, entries.pop())
        full = md.examples_per_shard * md.example_nbytes
        shards = []
        for i, (name, count) in enumerate(entries):
            nbytes = full
            data = count * md.example_nbytes
            if i == md.n_shards - 1 and name == shard_name(i) and _size(folder / name) == data:
                nbytes = data  # the padding dropped: the examples are all there
            shards.append(ShardEntry(name, count, nbytes, None))
        empty = [ShardEntry(name, 0, 0 if _size(folder / name) == 0 else full, None) for name, _ in trailing]
        labels = None
        if self.has_labels and os.path.lexists(labels_path):
            shape = (md.n_examples, md.patches_per_ex)
            labels = ArrayEntry(LABELS_FILE, LABELS_DTYPE.str, shape, shape[0] * shape[1], None)
        return Manifest(shards=ShardList.of(shards), labels=labels, empty_shards=ShardList.of(empty)), []


class PreModelOrg(SaevHistory):
    name = "saev-pre0.1-model_org"
    summary = "saev before 0.1.0, model_org keys (2024-11)"
    commits = "9d4cae4"
    protocols = (UNVERSIONED,)
    keys = (
        "model_org",
        "model_ckpt",
        "layers",
        "n_patches_per_img",
        "cls_token",
        "d_vit",
        "seed",
        "n_imgs",
        "n_patches_per_shard",
        "data",
    )
    renames: ClassVar[Mapping[str, str]] = {
        "model_org": "family",
        "model_ckpt": "ckpt",
        "n_patches_per_img": "patches_per_ex",
        "d_vit": "d_model",
        "n_imgs": "n_examples",
        "n_patches_per_shard": "patches_per_shard",
    }
    defaults: ClassVar[Mapping[str, Any]] = {"dtype": "float32", "protocol": UNVERSIONED, "dataset": ""}
    has_seed = True
    data_types = (str,)
    manifest_file = None
    hash_rule = "json"
    lacks = (
        "a protocol version",
        "a dtype key (float32, as its writer wrote)",
        "shards.json (the shards follow from n_imgs)",
        "a dataset path",
        "labels",
        _NO_CHECKSUMS,
    )


class PreModelFamily(PreModelOrg):
    name = "saev-pre0.1-model_family"
    summary = "saev before 0.1.0, model_family keys (2024-11 to 2025-03)"
    commits = "7d346f4"
    keys = ("model_family", *PreModelOrg.keys[1:])
    renames: ClassVar[Mapping[str, str]] = {
        "model_family": "family",
        **{k: v for k, v in PreModelOrg.renames.items() if k != "model_org"},
    }


class Pypi010(PreModelOrg):
    name = "saev-0.1.0"
    summary = "saev 0.1.0 (2025-04)"
    commits = "c6e3552, the release saev==0.1.0 on PyPI"
    keys = ("vit_family", "vit_ckpt", *PreModelOrg.keys[2:])
    renames: ClassVar[Mapping[str, str]] = {**_VIT_RENAMES, "n_patches_per_shard": "patches_per_shard"}


class Protocol100(SaevHistory):
    name = "saev-1.0.0"
    summary = "saev protocol 1.0.0 (2025-06 to 2025-09)"
    commits = "1c842cc to 42b6764"
    protocols = ("1.0.0",)
    keys: tuple[str, ...] = (
        "vit_family",
        "vit_ckpt",
        "layers",
        "n_patches_per_img",
        "cls_token",
        "d_vit",
        "n_imgs",
        "max_patches_per_shard",
        "data",
        "dtype",
        "protocol",
    )
    renames: ClassVar[Mapping[str, str]] = {**_VIT_RENAMES, "max_patches_per_shard": "patches_per_shard"}
    lacks: tuple[str, ...] = ("a dataset path", "labels", _NO_CHECKSUMS)


class Protocol11(Protocol100):
    name = "saev-1.1"
    summary = "saev protocol 1.1 (2025-09)"
    commits = "9179aa0"
    protocols = ("1.1",)


class Protocol11PixelAgg(Protocol11):
    name = "saev-1.1-pixel_agg"
    summary = "saev protocol 1.1 with pixel_agg (2025-09 to 2025-10)"
    commits = "70cd3b4 to 29d3347"
    keys = (*Protocol100.keys[:9], "pixel_agg", *Protocol100.keys[9:])
    has_pixel_agg = True
    has_labels = True
    lacks = ("a dataset path", _NO_CHECKSUMS)


class Protocol20Json(SaevHistory):
    name = "saev-2.0-json"
    summary = "saev protocol 2.0, json names (2025-10)"
    commits = "5d0f89c"
    protocols = (SAEV_20_PROTOCOL,)
    keys = SAEV_CODE_KEYS
    renames: ClassVar[Mapping[str, str]] = {
        "content_tokens_per_example": "patches_per_ex",
        "max_tokens_per_shard": "patches_per_shard",
    }
    defaults: ClassVar[Mapping[str, Any]] = {}
    count_key = "n_examples"
    has_pixel_agg = True
    has_labels = True
    siblings = ("saev-2.0-orjson",)
    lacks = (_NO_CHECKSUMS,)


class Protocol20Orjson(Protocol20Json):
    name = "saev-2.0-orjson"
    summary = "saev protocol 2.0, orjson names (2025-10)"
    commits = "c3dd0ae"
    hash_rule = "orjson"
    writer = "orjson"
    siblings = ("saev-2.0-json",)


#: Every earlier format, oldest first.
DIALECTS: tuple[SaevHistory, ...] = (
    PreModelOrg(),
    PreModelFamily(),
    Pypi010(),
    Protocol100(),
    Protocol11(),
    Protocol11PixelAgg(),
    Protocol20Json(),
    Protocol20Orjson(),
)
#: The formats without a ``protocol`` key (before 1.0.0).
UNVERSIONED_DIALECTS = tuple(d for d in DIALECTS if d.protocols == (UNVERSIONED,))
#: Keys that only saev's formats before 1.0.0 have, and those only its 1.x formats have
#: (beside today's saev keys): a metadata.json with one of them is read as one of those formats.
UNVERSIONED_KEYS = frozenset(k for d in UNVERSIONED_DIALECTS for k in d.keys) - {"layers", "cls_token", "data"}
V1_KEYS = frozenset(k for d in DIALECTS if d.protocols in (("1.0.0",), ("1.1",)) for k in d.keys) - set(SAEV_CODE_KEYS)


def pick(obj: dict[str, Any], candidates: Sequence[Dialect], everyone: Sequence[Dialect]) -> Dialect:
    """The dialect among ``candidates`` whose keys ``obj`` has: exactly, else the closest one
    (fewest keys missing or unknown), whose `Dialect.fields` then reports the difference.

    `MetadataError` where two readings are possible: two candidates equally close with
    different keys, or keys of another format (one of ``everyone``) mixed in with the closest's.
    """
    given = set(obj)
    exact = [d for d in candidates if given == set(d.keys)]
    if exact:
        return exact[0]

    def distance(d: Dialect) -> int:
        return len(given.symmetric_difference(d.keys))

    ranked = sorted(candidates, key=distance)
    best = ranked[0]
    tied = [d for d in ranked[1:] if distance(d) == distance(best) and set(d.keys) != set(best.keys)]
    if tied:
        raise MetadataError(
            f"two readings possible: the keys fit {best.summary} (dialect {best.name!r}) and {tied[0].summary} "
            f"(dialect {tied[0].name!r}) equally; missing {_diff(best.keys, given)} of the first, "
            f"{_diff(tied[0].keys, given)} of the second (protocol.md 9.5)"
        )
    unknown = given - set(best.keys)
    owners = [(d, unknown.intersection(d.keys)) for d in everyone if d is not best and set(d.keys) != set(best.keys)]
    # The format holding most of them; of those, saev's own before this library's.
    other, foreign = max(owners, key=lambda o: (len(o[1]), o[0].legacy), default=(None, set()))
    if other is not None and foreign:
        raise MetadataError(
            f"keys of two formats mixed: {', '.join(map(repr, sorted(foreign)))} "
            f"{'is a key' if len(foreign) == 1 else 'are keys'} of {other.summary} (dialect {other.name!r}), "
            f"the others of {best.summary} (dialect {best.name!r}), which has no such key; a cache is written "
            "in one format (protocol.md 9.5)"
        )
    return best


def by_name(dialect: Dialect, obj: dict[str, Any], dirname: str | None, everyone: Mapping[str, Dialect]) -> Dialect:
    """Among ``dialect`` and its siblings (saev 2.0's two hash rules), the one whose name
    ``dirname`` is; ``dialect`` when it is neither's (the name check then says so)."""
    if dirname is None:
        return dialect
    for name in (dialect.name, *dialect.siblings):
        candidate = everyone[name]
        if isinstance(candidate, SaevHistory) and name_by_rule(obj, candidate.hash_rule) == dirname:
            return candidate
    return dialect


def _diff(keys: Sequence[str], given: set[str]) -> str:
    missing = [k for k in keys if k not in given]
    return short_list(missing) if missing else "none"


def _size(path: Path) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:
        return -1


__all__ = ["DIALECTS", "HASH_RULES", "SaevHistory", "by_name", "name_by_rule", "pick"]
