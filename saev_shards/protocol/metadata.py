"""`Metadata`: the configuration a cache is a pure function of (protocol.md section 2.1)."""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any

import numpy as np

from ..errors import DtypeError, MetadataError, NameNotFoundError, Problems
from . import layout
from .common import DEFAULT_DTYPE, DTYPES, FLOAT8, METADATA_PROTOCOLS, PROTOCOL, PROTOCOL_32, SCALES_DTYPE
from .dialect import Dialect
from .jsonfile import is_int, json_value_problem, short_repr, type_name
from .saev_code import DEFAULT_PIXEL_AGG as SAEV_DEFAULT_PIXEL_AGG
from .sites import Site, as_site, describe, normalise, site_problem, sites_problems
from .v3 import KEYS
from .versions import DEFAULT_DIALECTS, DIALECTS, detect

SAEV_DEFAULT_DIALECT = "saev"
__all__ = ["FIELDS", "KEYS", "Metadata", "Site", "check_fields", "parse_metadata", "validate"]

#: Layer values are block indices, held as numpy int64 by the statistics and the loaders.
LAYER_MIN = -(2**63)
LAYER_MAX = 2**63 - 1


@dataclasses.dataclass(frozen=True, kw_only=True, eq=True)
class Metadata:
    """Configuration of one cache; its `hash` names the cache directory.

    >>> md = Metadata(family="clip", ckpt="ViT-B-16/openai", layers=(6, 11),
    ...               patches_per_ex=196, cls_token=True, d_model=768, n_examples=10_000,
    ...               patches_per_shard=2_400_000, data={"name": "imagenet-1k"},
    ...               dataset="/data/imagenet")
    >>> md.tokens_per_ex, md.examples_per_shard, md.n_shards
    (197, 6091, 2)
    """

    family: str
    ckpt: str
    layers: tuple[int, ...]
    patches_per_ex: int
    cls_token: bool
    d_model: int
    n_examples: int
    patches_per_shard: int
    data: Any
    dataset: str
    dtype: str = DEFAULT_DTYPE
    protocol: str = PROTOCOL
    #: saev's code only: how patch labels were aggregated from pixel labels ("majority" or
    #: "prefer-fg"; saev writes "majority" when there are none). None in 3.0, which has no such key.
    pixel_agg: str | None = None
    #: saev before 1.0.0 only (read, never written): the seed its dump ran with, one of the
    #: hashed fields of those caches. None in every other dialect.
    seed: int | None = None
    #: How the bytes are laid out (`saev_shards.protocol.DIALECTS`): "3.2", "3.1" or "3.0"; for protocol 2.1
    #: "saev" (saev's code, the default), "saev-64" (its names before 2025-10-14) or
    #: "saev-spec" (saev's protocol document, read only); saev's earlier formats (read only,
    #: protocol.md 9.5: "saev-0.1.0", ...). Empty: the protocol's default.
    dialect: str = ""
    #: What each layer slot holds (protocol 3.2, protocol.md 2.1.1): one `Site` per layer, the
    #: input or the output of a named module (``Site("encoder.layer.3.intermediate", "input")``;
    #: given as such, as ``(module, io)`` pairs or as ``"module:io"`` strings). None: every slot
    #: is the output of the block ``layers`` names, as in every cache before 3.2. A cache with
    #: sites is protocol 3.2: with ``protocol`` left at its default, `Metadata` picks it.
    sites: tuple[Site, ...] | None = None

    def __post_init__(self) -> None:
        layers = self.layers
        if isinstance(layers, (list, tuple)):
            object.__setattr__(self, "layers", tuple(layers))
        given: object = self.dtype
        if isinstance(given, np.dtype) or (isinstance(given, type) and issubclass(given, np.generic)):
            object.__setattr__(self, "dtype", np.dtype(given).name)  # np.float16 -> "float16"
        object.__setattr__(self, "sites", normalise(self.sites))
        if self.sites is not None and self.dialect == "" and self.protocol == PROTOCOL:
            object.__setattr__(self, "protocol", PROTOCOL_32)  # the version that can say what slots hold
        if self.dialect == "" and isinstance(self.protocol, str) and self.protocol in DEFAULT_DIALECTS:
            # The protocol's defaults: for 2.1, saev's code as saev itself writes a cache.
            object.__setattr__(self, "dialect", DEFAULT_DIALECTS[self.protocol])
            if self.pixel_agg is None and self.dialect == SAEV_DEFAULT_DIALECT:
                object.__setattr__(self, "pixel_agg", SAEV_DEFAULT_PIXEL_AGG)
        with Problems(MetadataError, head="invalid metadata: ") as problems:
            check_fields(self.fields(), problems)
        # A private deep copy, so later changes to the caller's dict cannot change the hash.
        object.__setattr__(self, "data", copy.deepcopy(self.data))

    # -- identity -----------------------------------------------------------------
    def fields(self) -> dict[str, Any]:
        """Every field by name (`dataclasses.asdict` without its deep copies)."""
        return {name: getattr(self, name) for name in FIELDS}

    @property
    def rules(self) -> Dialect:
        """The byte rules of this cache's `dialect` (a `saev_shards.protocol.Dialect`; `dialect`
        is its name)."""
        return DIALECTS[self.dialect]

    @property
    def format(self) -> Dialect:
        """Deprecated: `rules` (the name it had before ``dialect``'s object and string were told
        apart). Warns with `DeprecationWarning`."""
        warnings.warn("Metadata.format is deprecated; use Metadata.rules", DeprecationWarning, stacklevel=2)
        return self.rules

    def to_dict(self) -> dict[str, Any]:
        """The JSON object stored as metadata.json, keys in the order written (layers as a list)."""
        return self.rules.to_json(self)

    def to_bytes(self) -> bytes:
        """metadata.json's bytes, as this cache's dialect writes them."""
        return self.rules.metadata_bytes(self)

    @property
    def hash(self) -> str:
        """The directory name: for 3.0 (and saev's document) ``sha256(json.dumps(metadata,
        sort_keys=True, separators=(',', ':')))``, 64 hex digits; for saev's code the first 8
        (``"saev-64"``: all 64) of the sha256 of its compact orjson in field order (protocol.md 9);
        for saev's earlier formats all 64 digits by each one's rule (protocol.md 9.5)."""
        return self.rules.directory_name(self)

    def __hash__(self) -> int:
        return hash(self.hash)

    def replace(self, **changes: Any) -> Metadata:
        """A copy with some fields changed (a different cache, so a different hash).

        Changing ``protocol`` without naming a ``dialect`` takes the new protocol's default
        dialect (``"2.1"``: saev's code), and drops ``pixel_agg`` (and ``seed``) where that
        dialect has none.
        """
        if "protocol" in changes and "dialect" not in changes:
            changes["dialect"] = ""
            default = DEFAULT_DIALECTS.get(changes["protocol"])
            if "pixel_agg" not in changes and default is not None and not DIALECTS[default].has_pixel_agg:
                changes["pixel_agg"] = None
            if "seed" not in changes and default is not None and not DIALECTS[default].has_seed:
                changes["seed"] = None
        return dataclasses.replace(self, **changes)

    # -- derived sizes ------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        """L: number of recorded layers."""
        return len(self.layers)

    @property
    def tokens_per_ex(self) -> int:
        """T: patches plus one when there is a [CLS] token."""
        return layout.tokens_per_ex(self.patches_per_ex, self.cls_token)

    @property
    def examples_per_shard(self) -> int:
        """S: examples in every shard but the last."""
        return layout.examples_per_shard(self.patches_per_shard, self.tokens_per_ex, self.n_layers)

    @property
    def n_shards(self) -> int:
        """Number of shard files."""
        return layout.n_shards(self.n_examples, self.examples_per_shard)

    @property
    def shard_shape(self) -> tuple[int, int, int, int]:
        """``(S, L, T, D)`` of a full shard."""
        return (self.examples_per_shard, self.n_layers, self.tokens_per_ex, self.d_model)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(N, L, T, D)`` of the logical tensor."""
        return (self.n_examples, self.n_layers, self.tokens_per_ex, self.d_model)

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        """Dtype of the raw stored values (uint16 for bfloat16)."""
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        """Bytes per stored value."""
        return self.numpy_dtype.itemsize

    @property
    def example_nbytes(self) -> int:
        """Bytes of one example's ``(L, T, D)`` block."""
        return layout.example_nbytes(self.n_layers, self.tokens_per_ex, self.d_model, self.itemsize)

    @property
    def nbytes(self) -> int:
        """Bytes of all activations (3.0's shard files hold exactly this much, 2.1's are padded)."""
        return self.n_examples * self.example_nbytes

    @property
    def scales_nbytes(self) -> int:
        """Bytes of all scales (float8_e4m3: a float32 per vector, in the scale files; else 0)."""
        return self.n_examples * self.vector_scales_nbytes

    @property
    def vector_scales_nbytes(self) -> int:
        """Bytes of one example's scales: ``L * T * 4`` for float8_e4m3, else 0."""
        return self.n_layers * self.tokens_per_ex * SCALES_DTYPE.itemsize if self.dtype == FLOAT8 else 0

    def shard_scales_nbytes(self, shard: int) -> int:
        """Exact length of shard ``shard``'s scale file (float8_e4m3; 0 for other dtypes, which have none)."""
        return self.shard_n_examples(shard) * self.vector_scales_nbytes

    def shard_n_examples(self, shard: int) -> int:
        """Examples in shard ``shard``."""
        return layout.shard_n_examples(shard, self.n_examples, self.examples_per_shard)

    def shard_nbytes(self, shard: int) -> int:
        """Exact length of shard file ``shard`` as this library writes it.

        Protocol 2.1 pads the last shard to a full shard, as saev's writer does.
        """
        return self.rules.shard_nbytes(self, shard)

    def site_of(self, layer: int) -> Site | None:
        """What the slot of layer value ``layer`` holds: its `Site` (protocol 3.2), or None for a
        cache without sites, whose slots are block outputs."""
        index = self.layer_index(layer)
        return None if self.sites is None else self.sites[index]

    def describe_layer(self, layer: int) -> str:
        """A layer slot for people: ``"encoder.layer.3.intermediate (input)"`` where the cache
        has sites, else ``"layer 3"``."""
        return describe(self.site_of(layer), layer)

    def site_layer(self, site: object) -> int:
        """The layer value of the slot holding ``site`` (a `Site`, a ``(module, io)`` pair or
        ``"module:io"``); `NameNotFoundError` (a `KeyError`) naming the recorded sites."""
        wanted = as_site(site)
        if wanted is None:
            raise NameNotFoundError(f"site: {site_problem(site)}")
        if self.sites is None:
            raise NameNotFoundError(
                f"site {str(wanted)!r}: this cache records no sites (protocol {self.protocol}): every layer slot "
                f"is a block output; choose layers by value, {list(self.layers)}"
            )
        try:
            return self.layers[self.sites.index(wanted)]
        except ValueError:
            shown = ", ".join(repr(str(s)) for s in self.sites[:12]) + (" ..." if len(self.sites) > 12 else "")
            raise NameNotFoundError(f"site {str(wanted)!r} was not recorded; recorded sites are {shown}") from None

    def layer_index(self, layer: int) -> int:
        """Position of layer value ``layer`` in `layers`; `NameNotFoundError` (a `KeyError`) naming
        the recorded values if absent."""
        try:
            return self.layers.index(layer)
        except ValueError:
            raise NameNotFoundError(
                f"layer {layer!r} was not recorded; recorded layer values are {list(self.layers)}"
            ) from None


#: `Metadata`'s fields, in declaration order.
FIELDS = (*KEYS[:-2], "dtype", "protocol", "pixel_agg", "seed", "dialect", "sites")


def validate(d: dict[str, Any], absent: frozenset[str] = frozenset()) -> list[str]:
    """Every problem with `Metadata` fields given as a dict (empty if valid), as messages
    naming the field (`check_fields` into a fresh `errors.Problems`)."""
    problems = Problems(MetadataError)
    check_fields(d, problems, absent)
    return problems.messages()


def check_fields(d: dict[str, Any], problems: Problems, absent: frozenset[str] = frozenset()) -> None:
    """Add every problem with `Metadata` fields given as a dict to ``problems``: the rules of
    every dialect, then the dialect's own (`saev_shards.protocol.Dialect.check_values`).
    Fields in ``absent`` (missing from a file, and reported as such) are not checked.

    Values follow the rules of every JSON file of a cache (`protocol.jsonfile.json_value_problem`):
    strings of valid Unicode, integers within 64 bits, finite numbers, at most
    `protocol.jsonfile.MAX_JSON_DEPTH` levels of nesting, checked before anything recursive
    (the hash, the deep copy, a message) touches a value.
    """
    before = len(problems)

    def want(key: str, ok: bool, expected: str, kind: type[MetadataError] = MetadataError) -> bool:
        if key in absent:
            return False
        if not ok:
            v = d[key]
            problems.expected(key, expected, f"{type_name(v)} {short_repr(v, 60)}", kind=kind)
        return ok

    def json_value(key: str, value: object) -> None:
        problem = json_value_problem(value)
        if problem:
            problems.add(f"{key}: {problem}", field=key)

    for key in ("family", "ckpt", "dataset"):
        if want(key, isinstance(d[key], str), "a string"):
            json_value(key, d[key])
    if want("layers", isinstance(d["layers"], (list, tuple)), "an array of integers"):
        layers = d["layers"]
        if not layers:
            problems.expected("layers", "at least one layer", "[]")
        elif not all(is_int(x) for x in layers):
            problems.expected("layers", "integers", short_repr(layers, 60))
        elif not all(LAYER_MIN <= x <= LAYER_MAX for x in layers):
            problems.expected("layers", "integers within signed 64 bits", short_repr(layers, 60))
        elif len(set(layers)) != len(layers):
            problems.expected("layers", "distinct values", short_repr(list(layers), 60))
    for key, low in (("patches_per_ex", 0), ("d_model", 1), ("n_examples", 0), ("patches_per_shard", 1)):
        if want(key, is_int(d[key]), "an integer") and d[key] < low:
            problems.expected(key, f"an integer >= {low}", short_repr(d[key]))
    want("cls_token", isinstance(d["cls_token"], bool), "true or false")
    # A dtype problem is a `DtypeError` (a `MetadataError`): raised as such when it is the only
    # problem, so a caller can tell a refused dtype from the rest.
    want("dtype", isinstance(d["dtype"], str), "a string", DtypeError)
    if want("pixel_agg", d["pixel_agg"] is None or isinstance(d["pixel_agg"], str), "a string or None"):
        json_value("pixel_agg", d["pixel_agg"])
    seed = d["seed"]
    if (
        want("seed", seed is None or is_int(seed), "an integer or None")
        and seed is not None
        and not (LAYER_MIN <= seed <= LAYER_MAX)
    ):
        problems.expected("seed", "an integer within signed 64 bits", short_repr(seed))
    if "data" not in absent:
        json_value("data", [d["data"]])  # one level less than the file's limit: data sits inside the object
    layers_given = "layers" not in absent and isinstance(d["layers"], (list, tuple))
    if d.get("sites") is not None and layers_given:
        for message in sites_problems(d["sites"], len(d["layers"])):
            problems.add(message, field="sites")
    version = d["protocol"]
    if (
        want(
            "protocol",
            isinstance(version, str) and version in METADATA_PROTOCOLS,
            f"one of {list(METADATA_PROTOCOLS)}",
        )
        and not absent
    ):
        if d["dialect"] in DIALECTS:
            DIALECTS[d["dialect"]].check_values(d, problems)
        else:
            problems.expected("dialect", f"one of {list(DIALECTS)}", short_repr(d["dialect"]))

    if len(problems) == before and not absent:
        _check_sizes(d, problems)


def _check_sizes(d: dict[str, Any], problems: Problems) -> None:
    """The sizes the fields imply (only once every field is valid on its own)."""
    tokens = layout.tokens_per_ex(d["patches_per_ex"], d["cls_token"])
    if tokens < 1:
        problems.add("patches_per_ex: must be >= 1 when cls_token is false (T would be 0)", field="patches_per_ex")
        return
    try:
        eps = layout.examples_per_shard(d["patches_per_shard"], tokens, len(d["layers"]))
    except MetadataError as err:
        problems.add(str(err))
        return
    example_bytes = len(d["layers"]) * tokens * d["d_model"] * DTYPES[d["dtype"]].itemsize
    if eps * example_bytes > layout.MAX_NBYTES or d["n_examples"] * example_bytes > layout.MAX_NBYTES:
        problems.add("sizes: a shard or the whole cache would exceed 2**63-1 bytes", field="sizes")
    if layout.n_shards(d["n_examples"], eps) > 1_000_000:
        problems.add(
            "n_examples: more than 1,000,000 shards would not fit the 6-digit shard names; raise patches_per_shard",
            field="n_examples",
        )


def parse_metadata(obj: object, dirname: str | None = None) -> Metadata:
    """Turn parsed metadata.json into `Metadata`, or raise `MetadataError` listing every problem.

    The dialect is told by the keys and ``protocol`` (`saev_shards.protocol.detect`); for a
    cache written by saev's code, ``dirname`` (the directory's name) tells its 64-digit
    names from the 8-digit ones (and saev 2.0's two hash rules apart). `ProtocolVersionError`
    for a version this library does not read; `MetadataError` for keys of two formats mixed.
    """
    dialect = detect(obj, dirname)
    assert isinstance(obj, dict)
    with Problems(MetadataError, head="") as problems:
        given = dialect.fields(obj, problems)
        fields: dict[str, Any] = dict.fromkeys(FIELDS)
        fields.update(given)
        # The fields the dialect's keys give that are missing (reported as missing keys, not checked).
        absent = frozenset(dialect.renames.get(k, k) for k in dialect.keys) - set(given) - {"pixel_agg", "sites"}
        check_fields(fields, problems, absent)
    fields["layers"] = tuple(fields["layers"])
    return Metadata(**fields)
