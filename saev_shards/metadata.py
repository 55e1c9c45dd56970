"""`Metadata`: the configuration a cache is a pure function of (protocol.md section 2.1)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np

from . import layout
from .errors import MetadataError
from .format import (
    DEFAULT_DTYPE,
    DTYPES,
    DTYPES_BY_PROTOCOL,
    LEGACY_PROTOCOL,
    PROTOCOL,
    SUPPORTED_PROTOCOLS,
    content_hash,
    is_int,
    json_value_problem,
    short_list,
    short_repr,
    type_name,
)

#: The exact key set of metadata.json, in the seed's order.
KEYS = (
    "family",
    "ckpt",
    "layers",
    "patches_per_ex",
    "cls_token",
    "d_model",
    "n_examples",
    "patches_per_shard",
    "data",
    "dataset",
    "dtype",
    "protocol",
)


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

    def __post_init__(self) -> None:
        layers = self.layers
        if isinstance(layers, (list, tuple)):
            object.__setattr__(self, "layers", tuple(layers))
        given: object = self.dtype
        if isinstance(given, np.dtype) or (isinstance(given, type) and issubclass(given, np.generic)):
            object.__setattr__(self, "dtype", np.dtype(given).name)  # np.float16 -> "float16"
        problems = validate(self.to_dict())
        if problems:
            raise MetadataError("invalid metadata: " + "; ".join(problems))
        # A private deep copy, so later changes to the caller's dict cannot change the hash.
        object.__setattr__(self, "data", copy.deepcopy(self.data))

    # -- identity -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON object stored as metadata.json (layers as a list)."""
        d = {k: getattr(self, k) for k in KEYS}
        d["layers"] = list(self.layers) if isinstance(self.layers, tuple) else self.layers
        return d

    @property
    def hash(self) -> str:
        """``sha256(json.dumps(metadata, sort_keys=True, separators=(',', ':')))``, 64 hex digits."""
        return content_hash(self.to_dict())

    def __hash__(self) -> int:
        return hash(self.hash)

    def replace(self, **changes: Any) -> Metadata:
        """A copy with some fields changed (a different cache, so a different hash)."""
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
        """Bytes of all activations (protocol 3.0 files hold exactly this much)."""
        return self.n_examples * self.example_nbytes

    def shard_n_examples(self, shard: int) -> int:
        """Examples in shard ``shard``."""
        return layout.shard_n_examples(shard, self.n_examples, self.examples_per_shard)

    def shard_nbytes(self, shard: int) -> int:
        """Exact length of shard file ``shard`` as this library writes it.

        Protocol 2.1 pads the last shard to a full shard, as the saev reference writer does.
        """
        if self.protocol == LEGACY_PROTOCOL:
            count = self.examples_per_shard
            layout.shard_n_examples(shard, self.n_examples, self.examples_per_shard)
        else:
            count = self.shard_n_examples(shard)
        return count * self.example_nbytes

    def layer_index(self, layer: int) -> int:
        """Position of layer value ``layer`` in `layers`; `KeyError` naming the choices if absent."""
        try:
            return self.layers.index(layer)
        except ValueError:
            raise KeyError(f"layer {layer!r} was not recorded; recorded layers are {list(self.layers)}") from None


def validate(d: dict[str, Any]) -> list[str]:
    """Every problem with a metadata object, as messages naming the field (empty if valid).

    Values follow the rules of every JSON file of a cache (`format.json_value_problem`):
    strings of valid Unicode, integers within 64 bits, finite numbers, at most
    `format.MAX_JSON_DEPTH` levels of nesting, checked before anything recursive (the hash,
    the deep copy, a message) touches a value.
    """
    problems: list[str] = []
    keys = set(d)
    missing = [k for k in KEYS if k not in keys]
    unknown = sorted(keys - set(KEYS), key=str)
    if missing:
        problems.append(f"missing keys {missing}")
    if unknown:
        problems.append(f"unknown keys {short_list(unknown)} (allowed: {list(KEYS)})")

    def want(key: str, ok: bool, expected: str) -> bool:
        if key in d and not ok:
            v = d[key]
            problems.append(f"{key}: expected {expected}, found {type_name(v)} {short_repr(v, 60)}")
            return False
        return key in d

    for key in ("family", "ckpt", "dataset"):
        if want(key, isinstance(d.get(key), str), "a string"):
            problem = json_value_problem(d[key])
            if problem:
                problems.append(f"{key}: {problem}")
    if want("layers", isinstance(d.get("layers"), (list, tuple)), "an array of integers"):
        layers = d["layers"]
        if not layers:
            problems.append("layers: expected at least one layer, found []")
        elif not all(is_int(x) for x in layers):
            problems.append(f"layers: expected integers, found {short_repr(layers, 60)}")
        elif not all(LAYER_MIN <= x <= LAYER_MAX for x in layers):
            problems.append(f"layers: expected integers within signed 64 bits, found {short_repr(layers, 60)}")
        elif len(set(layers)) != len(layers):
            problems.append(f"layers: expected distinct values, found {short_repr(list(layers), 60)}")
    for key, low in (("patches_per_ex", 0), ("d_model", 1), ("n_examples", 0), ("patches_per_shard", 1)):
        if want(key, is_int(d.get(key)), "an integer") and d[key] < low:
            problems.append(f"{key}: expected an integer >= {low}, found {short_repr(d[key])}")
    want("cls_token", isinstance(d.get("cls_token"), bool), "true or false")
    protocol = d.get("protocol")
    if want(
        "protocol",
        isinstance(protocol, str) and protocol in SUPPORTED_PROTOCOLS,
        f"one of {list(SUPPORTED_PROTOCOLS)}",
    ):
        assert isinstance(protocol, str)
        allowed = DTYPES_BY_PROTOCOL[protocol]
        dtype = d.get("dtype")
        want("dtype", isinstance(dtype, str) and dtype in allowed, f"one of {list(allowed)} for protocol {protocol}")
    if "data" in d:
        data = d["data"]
        if protocol == LEGACY_PROTOCOL:
            want("data", isinstance(data, (dict, str)), "an object or a string (protocol 2.1)")
        else:
            want("data", isinstance(data, dict), "an object")
        # One level less than the file's limit: data sits inside the metadata object.
        problem = json_value_problem([data])
        if problem:
            problems.append(f"data: {problem}")

    if not problems:
        tokens = layout.tokens_per_ex(d["patches_per_ex"], d["cls_token"])
        if tokens < 1:
            problems.append("patches_per_ex: must be >= 1 when cls_token is false (T would be 0)")
            return problems
        try:
            eps = layout.examples_per_shard(d["patches_per_shard"], tokens, len(d["layers"]))
        except MetadataError as err:
            problems.append(str(err))
            return problems
        example_bytes = len(d["layers"]) * tokens * d["d_model"] * DTYPES[d["dtype"]].itemsize
        if eps * example_bytes > layout.MAX_NBYTES or d["n_examples"] * example_bytes > layout.MAX_NBYTES:
            problems.append("sizes: a shard or the whole cache would exceed 2**63-1 bytes")
        if layout.n_shards(d["n_examples"], eps) > 1_000_000:
            problems.append(
                "n_examples: more than 1,000,000 shards would not fit the 6-digit shard names; raise patches_per_shard"
            )
    return problems


def parse_metadata(obj: object) -> Metadata:
    """Turn parsed metadata.json into `Metadata`, or raise `MetadataError` listing every problem."""
    if not isinstance(obj, dict):
        raise MetadataError(f"expected a JSON object, found {type_name(obj)}")
    problems = validate(obj)
    if problems:
        raise MetadataError("; ".join(problems))
    fields = dict(obj)
    fields["layers"] = tuple(fields["layers"])
    return Metadata(**fields)
