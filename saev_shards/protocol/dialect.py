"""`Dialect`: what one protocol version asks of the bytes, as methods the reader, writer and
store call instead of branching on versions.

A dialect owns metadata.json (its keys, their order, its bytes) and the directory name
computed from it, shards.json and its sidecars, and the sizes of the shard files. Each
version's module (`v3`, `v31`, `saev_code`, `saev_spec`) defines one, and `saev_history` one
per format saev wrote before; `saev_shards.protocol` keeps the registry and tells which one a
cache is written in.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import DtypeError, Problem, Problems
from .checks import check_keys
from .common import DTYPES_BY_PROTOCOL, FLOAT8, MANIFEST_FILE, PROTOCOL, PROTOCOL_32
from .jsonfile import short_repr, type_name

if TYPE_CHECKING:
    from .manifest import Manifest
    from .metadata import Metadata


class Dialect:
    """The byte rules of one protocol version or dialect (see the module docstring).

    Subclasses set the class attributes and implement `metadata_bytes`, `directory_name`,
    `load_manifest` and `manifest_bytes`; the defaults here are protocol 3.0's where 3.0
    has a rule, and nothing where it has none.
    """

    #: As `Metadata.dialect`: ``"3.2"``, ``"3.1"``, ``"3.0"``, ``"saev"``, ``"saev-64"``, ``"saev-spec"``, or
    #: one of saev's earlier formats (`saev_history`: ``"saev-0.1.0"``, ...).
    name: str = ""
    #: What it is, for messages and listings.
    summary: str = ""
    #: Values of metadata.json's ``protocol`` this dialect is written with.
    protocols: tuple[str, ...] = ()
    #: metadata.json's keys, in the order written.
    keys: tuple[str, ...] = ()
    #: metadata.json key -> `Metadata` field, where they differ.
    renames: ClassVar[Mapping[str, str]] = {}
    #: Read with a `ProtocolWarning` (an older major version than this library's, protocol.md 8).
    legacy: bool = False
    #: Holds per-example columns, text and statistics besides activations and labels.
    holds_extras: bool = False
    #: The last shard's file may be zero-padded to a full shard (protocol.md 9).
    padded_last: bool = False
    #: JSON files besides metadata.json and shards.json a cache of this dialect may hold.
    sidecar_names: tuple[str, ...] = ()
    #: Types `Metadata.data` may have.
    data_types: tuple[type, ...] = (dict,)
    #: metadata.json records ``pixel_agg`` (saev's code only).
    has_pixel_agg: bool = False
    #: Bytes per digest of blocks.json, which caches of this dialect hold (protocol 3.1); None: no blocks.json.
    block_size: int | None = None
    #: `Metadata` fields this dialect has no key for, and the value they take when read
    #: (saev's early formats: ``dtype`` float32, no ``protocol``, no ``dataset``).
    defaults: ClassVar[Mapping[str, Any]] = {}
    #: metadata.json records ``seed`` (saev before 1.0.0 only).
    has_seed: bool = False
    #: The file that lists the shards; None: there is none, the metadata alone says (saev before 1.0.0).
    manifest_file: str | None = MANIFEST_FILE
    #: Dialects a cache with the same metadata.json may be written in, told apart by the
    #: directory name alone (saev 2.0's two hash rules).
    siblings: tuple[str, ...] = ()
    #: What a cache of this dialect does not record, in words (shown by ``info``).
    lacks: tuple[str, ...] = ()
    #: One of saev's earlier formats (`saev_history`, protocol.md 9.5): read in place, never written.
    history: bool = False

    def name_rule(self) -> str:
        """The rule the directory name is the hash by, in words ("" where protocol.md says it alone)."""
        return ""

    #: metadata.json may say what each layer slot holds (``sites``, protocol 3.2).
    has_sites: bool = False

    # -- metadata.json -------------------------------------------------------------------
    def fields(self, obj: dict[str, Any], problems: Problems) -> dict[str, Any]:
        """metadata.json's object as `Metadata` fields (the keys it has, renamed, and ``dialect``);
        the problems with its key set (missing and unknown keys) go to ``problems``."""
        check_keys(problems, obj, self.keys, show_allowed=True)
        fields = {self.renames.get(k, k): v for k, v in obj.items() if k in self.keys}
        fields.update(self.defaults)
        fields["dialect"] = self.name
        return fields

    def to_json(self, md: Metadata) -> dict[str, Any]:
        """The metadata.json object, keys in the order written (layers as a list)."""
        out = {}
        for key in self.keys:
            value = getattr(md, self.renames.get(key, key))
            out[key] = list(value) if isinstance(value, tuple) else value
        return out

    def metadata_bytes(self, md: Metadata) -> bytes:
        """metadata.json as this dialect writes it."""
        raise NotImplementedError

    def directory_name(self, md: Metadata) -> str:
        """The cache's directory name: a hash of its metadata."""
        raise NotImplementedError

    def check_values(self, fields: Mapping[str, Any], problems: Problems) -> None:
        """Add what this dialect cannot hold among `Metadata` ``fields`` (checked whenever a
        `Metadata` is made, after the rules every dialect shares)."""
        version = fields["protocol"]
        if version not in self.protocols:
            problems.add(
                f"protocol: dialect {self.name!r} ({self.summary}) is written as {list(self.protocols)}, found "
                f"{version!r} (name a dialect that fits, or none: dialect='' means the protocol's default)",
                field="protocol",
            )
        allowed = DTYPES_BY_PROTOCOL.get(version, ())
        if fields["dtype"] not in allowed:
            hint = ""
            if fields["dtype"] == FLOAT8:
                hint = f" (float8_e4m3 is protocol {PROTOCOL}'s" + (
                    "; saev's code reads float32 only)" if self.legacy else ")"
                )
            problems.expected(
                "dtype", f"one of {list(allowed)} for protocol {version}{hint}", short_repr(fields["dtype"]), DtypeError
            )
        if not isinstance(fields["data"], self.data_types):
            kinds = " or ".join("an object" if t is dict else "a string" for t in self.data_types)
            problems.expected("data", f"{kinds} ({self.summary})", type_name(fields["data"]))
        if fields.get("sites") is not None and not self.has_sites:
            problems.add(
                f"sites: {self.summary} cannot say what each layer holds; a cache with sites is protocol "
                f"{PROTOCOL_32} (leave protocol and dialect at their defaults, or give protocol={PROTOCOL_32!r})",
                field="sites",
            )
        if fields["pixel_agg"] is not None and not self.has_pixel_agg:
            problems.add(
                f"pixel_agg: {self.summary} has no pixel_agg; expected None, found {short_repr(fields['pixel_agg'])}",
                field="pixel_agg",
            )
        if (fields["seed"] is None) == self.has_seed:
            expected = "an integer (the seed of its dump)" if self.has_seed else f"None ({self.summary} has no seed)"
            problems.expected("seed", expected, short_repr(fields["seed"]))

    def check_writable(self, md: Metadata, problems: Problems) -> None:
        """Add what keeps a cache of ``md`` from being written in this dialect (beyond `check_values`)."""

    # -- the data files --------------------------------------------------------------------
    def shard_nbytes(self, md: Metadata, shard: int) -> int:
        """Exact length of shard file ``shard`` as written: its examples, no padding."""
        return md.shard_n_examples(shard) * md.example_nbytes

    def empty_shards(self, md: Metadata) -> int:
        """All-zero, full-size shard files the writer leaves after the last shard (none)."""
        return 0

    def load_manifest(self, folder: Path, md: Metadata) -> tuple[Manifest | None, list[Problem]]:
        """Read shards.json (and the sidecars) of the cache in ``folder``: the manifest and every
        problem found in them. Files are not looked at beyond what the manifest format needs."""
        raise NotImplementedError

    def manifest_bytes(self, manifest: Manifest, md: Metadata) -> bytes:
        """shards.json as this dialect writes it."""
        raise NotImplementedError

    def sidecars(self, manifest: Manifest, md: Metadata) -> dict[str, bytes]:
        """JSON files written beside shards.json (before it), by name."""
        return {}

    def __repr__(self) -> str:
        return f"<dialect {self.name}: {self.summary}>"
