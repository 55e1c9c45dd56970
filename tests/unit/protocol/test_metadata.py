"""Metadata: the exact hash formula, validation, serialisation."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import saev_shards as ss
from saev_shards.protocol.metadata import KEYS, parse_metadata
from saev_shards.protocol.v3 import pretty_json

from ...support.caches import small_metadata, write_cache
from ...support.strategies import metadata


def seed_hash(md: dict[str, Any]) -> str:
    """The seed protocol's formula, spelled out independently of the library."""
    return hashlib.sha256(json.dumps(md, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def test_hash_is_the_seed_formula() -> None:
    md = small_metadata()
    assert md.hash == seed_hash(md.to_dict())
    assert len(md.hash) == 64
    assert all(c in "0123456789abcdef" for c in md.hash)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@given(data=st.dictionaries(st.text(max_size=10), json_values, max_size=5), dataset=st.text(), ckpt=st.text())
def test_hash_formula_with_unicode_and_floats(data: dict[str, Any], dataset: str, ckpt: str) -> None:
    md = small_metadata(data=data, dataset=dataset, ckpt=ckpt)
    assert md.hash == seed_hash(md.to_dict())
    # What is written to metadata.json parses back to metadata with the same hash.
    again = parse_metadata(json.loads(pretty_json(md.to_dict())))
    assert again == md
    assert again.hash == md.hash


def test_non_ascii_is_hashed_as_escapes() -> None:
    md = small_metadata(data={"name": "café ∑"})
    text = json.dumps(md.to_dict(), sort_keys=True, separators=(",", ":"))
    assert "\\u00e9" in text
    assert md.hash == hashlib.sha256(text.encode()).hexdigest()


def test_pinned_hash() -> None:
    """A fixed configuration has a fixed hash forever (changing it breaks every training config);
    in protocol 3.0 the one earlier releases gave it, in 3.1 (the default now) one of its own."""
    md = ss.Metadata(
        family="clip",
        ckpt="ViT-B-16/openai",
        layers=(6, 11),
        patches_per_ex=196,
        cls_token=True,
        d_model=768,
        n_examples=10_000,
        patches_per_shard=2_400_000,
        data={"name": "imagenet-1k"},
        dataset="/data/imagenet",
        dtype="float16",
        protocol="3.0",
    )
    assert md.hash == seed_hash(md.to_dict())
    assert md.hash == "df9d849fcb7d5202ae0c3ab674739e62d14c90b6278c2e0534e2cbe3548e1eb8"
    v31 = md.replace(protocol="3.1")
    assert v31.hash == seed_hash(v31.to_dict())
    assert v31.hash == "d61e36ab39b4c9f07f8891944530fdf700d61d7ce964dba891c5fe6b0bb88b9c"
    assert v31 == md.replace(protocol=ss.PROTOCOL)  # the default
    assert (md.tokens_per_ex, md.examples_per_shard, md.n_shards) == (197, 6091, 2)
    assert md.shard_shape == (6091, 2, 197, 768)


def test_metadata_properties() -> None:
    md = small_metadata()
    assert md.shape == (23, 2, 5, 8)
    assert md.n_layers == 2
    assert md.itemsize == 2
    assert md.example_nbytes == 2 * 5 * 8 * 2
    assert md.nbytes == 23 * md.example_nbytes
    assert [md.shard_n_examples(k) for k in range(md.n_shards)] == [5, 5, 5, 5, 3]
    assert md.layer_index(11) == 1
    with pytest.raises(KeyError, match=r"layer 7 was not recorded; recorded layer values are \[6, 11\]"):
        md.layer_index(7)


def test_dtype_accepts_numpy_types() -> None:
    assert small_metadata(dtype=np.float32).dtype == "float32"
    assert small_metadata(dtype=np.dtype("float16")).dtype == "float16"


def test_data_is_copied() -> None:
    data = {"name": "x"}
    md = small_metadata(data=data)
    before = md.hash
    data["name"] = "changed"
    assert md.hash == before


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"layers": ()}, "at least one layer"),
        ({"layers": (1, 1)}, "distinct"),
        ({"layers": (1, True)}, "expected integers"),
        ({"patches_per_ex": -1}, "patches_per_ex: expected an integer >= 0"),
        ({"patches_per_ex": 0, "cls_token": False}, "T would be 0"),
        ({"d_model": 0}, "d_model: expected an integer >= 1"),
        ({"n_examples": 2.0}, "n_examples: expected an integer, found float"),
        ({"cls_token": 1}, "cls_token: expected true or false"),
        ({"dtype": "int8"}, "dtype: expected one of"),
        ({"dtype": "float16", "protocol": "2.1"}, "for protocol 2.1"),
        ({"protocol": "9.0"}, "protocol: expected one of"),
        ({"data": [1, 2]}, "data: expected an object"),
        ({"data": {"x": float("nan")}}, "data: nan is not a JSON number"),
        ({"patches_per_shard": 9}, "patches_per_shard=9 is too small"),
        ({"family": 3}, "family: expected a string"),
        # Values the writer or a JSON tool could not hold are rejected here, not later (issue 10).
        ({"family": "\ud800"}, r"family: string '\\ud800' is not valid Unicode"),
        ({"ckpt": "a\udcffb"}, "ckpt: string .* is not valid Unicode"),
        ({"data": {"x\ud800": 1}}, "data: string .* is not valid Unicode"),
        ({"data": {"n": 2**64}}, "data: integer 18446744073709551616 does not fit 64 bits"),
        ({"data": {"n": 1 << 20_000}}, "data: integer <integer of 20001 bits> does not fit 64 bits"),
        ({"data": {1: 2}}, "data: object keys must be strings"),
        ({"layers": (2**63,)}, "layers: expected integers within signed 64 bits"),
        ({"protocol": 3.0}, "protocol: expected one of"),
        ({"d_model": 10**5000}, "sizes: a shard or the whole cache would exceed"),
    ],
)
def test_invalid_metadata(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ss.MetadataError, match=message):
        small_metadata(**changes)


def test_parse_rejects_unknown_and_missing_keys() -> None:
    d = small_metadata().to_dict()
    d["extra"] = 1
    del d["ckpt"]
    with pytest.raises(ss.MetadataError, match=r"missing keys \['ckpt'\].*unknown keys \['extra'\]"):
        parse_metadata(d)
    assert list(small_metadata().to_dict()) == list(KEYS)


def test_protocol_2_1_means_saevs_code_and_its_defaults() -> None:
    md = small_metadata(dtype="float32", protocol="2.1", data="gASVAAAA")
    assert (md.protocol, md.dialect, md.pixel_agg) == ("2.1", "saev", "majority")
    assert len(md.hash) == 8
    with pytest.raises(ss.MetadataError, match=r"data: expected a string"):
        small_metadata(dtype="float32", protocol="2.1")
    with pytest.raises(ss.MetadataError, match=r"pixel_agg: expected one of \['majority', 'prefer-fg'\] or None"):
        small_metadata(dtype="float32", protocol="2.1", data="x", pixel_agg="mean")
    with pytest.raises(ss.MetadataError, match=rf"pixel_agg: protocol {ss.PROTOCOL} has no pixel_agg"):
        small_metadata(pixel_agg="majority")
    # Named explicitly, a dialect takes no defaults: pixel_agg stays None (as older saev wrote it).
    assert small_metadata(dtype="float32", protocol="2.1", data="x", dialect="saev").pixel_agg is None


def test_saev_document_dialect_hashes_like_3_0() -> None:
    md = small_metadata(dtype="float32", protocol="2.1", dialect="saev-spec", data="gASVAAAA")
    assert md.hash == seed_hash(md.to_dict())
    assert list(md.to_dict()) == list(KEYS)


def test_legacy_last_shard_is_padded() -> None:
    md = small_metadata(dtype="float32", protocol="2.1", data="x")
    assert md.shard_nbytes(md.n_shards - 1) == md.examples_per_shard * md.example_nbytes
    assert small_metadata().shard_nbytes(4) == 3 * small_metadata().example_nbytes


def test_too_many_shards_for_six_digit_names() -> None:
    with pytest.raises(ss.MetadataError, match="1,000,000 shards"):
        small_metadata(n_examples=2_000_000, patches_per_shard=10)


def test_deep_values_are_reported_not_a_recursion_error() -> None:
    data: Any = {}
    for _ in range(100_000):
        data = {"k": data}
    with pytest.raises(ss.MetadataError, match="data: nested deeper than 64 levels"):
        small_metadata(data=data)
    with pytest.raises(ss.MetadataError, match=r"family: expected a string, found array \[\[\[\[\.\.\.\]\]\]\]"):
        small_metadata(family=[[[[[[[[1]]]]]]]])


def test_values_real_caches_hold_are_accepted(root: Path) -> None:
    """NUL and control characters in strings, 64-bit integers, long base64 data: all stored as given."""
    md = small_metadata(
        ckpt="hf-hub:timm/vit\x00\x1b[0m", family="clip é", n_examples=3,
        data={"seed": 2**64 - 1, "offset": -(2**63), "scale": 1e-300, "pickle": "gASV" * 10_000},
    )  # fmt: skip
    write_cache(root, md)
    assert ss.open(root / md.hash).metadata == md


def test_a_refused_dtype_raises_dtype_error_a_metadata_error():
    allowed = r"\['float16', 'bfloat16', 'float32', 'float8_e4m3'\]"
    with pytest.raises(ss.DtypeError, match=rf"dtype: expected one of {allowed} for protocol 3\.1") as info:
        small_metadata(dtype="int8")
    assert isinstance(info.value, ss.MetadataError)
    with pytest.raises(ss.DtypeError, match="dtype: expected a string, found int 3"):
        small_metadata(dtype=3)
    # Several kinds of problem: a plain MetadataError listing them all.
    with pytest.raises(ss.MetadataError, match=r"d_model.*dtype|dtype.*d_model") as several:
        small_metadata(dtype="int8", d_model=0)
    assert type(several.value) is ss.MetadataError
    # From a file: the same distinction.
    fields = small_metadata().to_dict()
    with pytest.raises(ss.DtypeError):
        parse_metadata({**fields, "dtype": "float64"})


def test_float8_is_refused_where_its_protocol_is_not_31() -> None:
    """float8_e4m3 is protocol 3.1's alone: saev's dialect (float32 only) and 3.0 refuse it,
    each saying why."""
    with pytest.raises(ss.DtypeError, match=r"float8_e4m3 is protocol 3\.1's; saev's code reads float32 only"):
        small_metadata(dtype="float8_e4m3", protocol="2.1", dialect="saev", data="x")
    with pytest.raises(ss.DtypeError, match=r"for protocol 3\.0 \(float8_e4m3 is protocol 3\.1's\)"):
        small_metadata(dtype="float8_e4m3", protocol="3.0")
    assert small_metadata(dtype="float8_e4m3").protocol == ss.PROTOCOL


# -- sites (protocol 3.2) ---------------------------------------------------------------------


@given(md=metadata(sites=True))
def test_sites_round_trip_through_metadata_json(md: ss.Metadata) -> None:
    """Any sites survive metadata.json (their order too) and are part of the hash; a cache
    without sites is protocol 3.1 and has no ``sites`` key, one with sites 3.2."""
    obj = json.loads(md.to_bytes())
    again = parse_metadata(obj, md.hash)
    assert again == md and again.hash == md.hash == seed_hash(obj)
    assert ("sites" in obj) == (md.sites is not None)
    assert md.protocol == ("3.1" if md.sites is None else "3.2")
    if md.sites is not None:
        assert [md.site_of(layer) for layer in md.layers] == list(md.sites)
        assert md.site_layer(str(md.sites[-1])) == md.layers[-1]
        assert md.replace(sites=tuple(reversed(md.sites))).hash != md.hash or len(md.sites) == 1


def test_sites_are_given_in_any_spelling() -> None:
    spelled = [
        ["encoder.layer.3.intermediate:input", "encoder.layer.3.output.dense:output"],
        [("encoder.layer.3.intermediate", "input"), ss.Site("encoder.layer.3.output.dense", "output")],
        [{"module": "encoder.layer.3.intermediate", "io": "input"}, "encoder.layer.3.output.dense:output"],
    ]
    made = {small_metadata(layers=(0, 1), sites=sites) for sites in spelled}
    assert len(made) == 1
    (md,) = made
    assert md.sites == (
        ss.Site("encoder.layer.3.intermediate", "input"),
        ss.Site("encoder.layer.3.output.dense", "output"),
    )
    assert md.describe_layer(1) == "encoder.layer.3.output.dense (output)"
    assert small_metadata(layers=(0,), sites=[":output"]).describe_layer(0) == "(the model) (output)"
    assert small_metadata(layers=(4,)).describe_layer(4) == "layer 4"


@pytest.mark.parametrize(
    ("sites", "message"),
    [
        (["a:input"], r"sites: expected one site per layer \(2\), found 1"),
        (["a:input", "a:input"], r"sites\[1\]: 'a:input' is sites\[0\] again"),
        (["a:inside", "b:output"], r"sites\[0\]: expected 'module:input' or 'module:output'"),
        ([("a", "input", 3), "b:output"], r"sites\[0\]: expected a site"),
        ("a:input", "sites: expected None or a list of sites"),
        (["\ud800:input", "b:output"], r"sites\[0\].module: string .* is not valid Unicode"),
    ],
)
def test_invalid_sites(sites: Any, message: str) -> None:
    with pytest.raises(ss.MetadataError, match=message):
        small_metadata(layers=(0, 1), sites=sites)


@pytest.mark.parametrize("protocol", ["3.0", "2.1"])
def test_sites_need_protocol_32(protocol: str) -> None:
    with pytest.raises(ss.MetadataError, match=r"sites: protocol .* cannot say what each layer holds.*'3\.2'"):
        small_metadata(layers=(0,), sites=["a:input"], protocol=protocol, dtype="float32", data="x")


def test_metadata_json_sites_are_parsed_strictly() -> None:
    """A 3.2 metadata.json's sites: exactly the keys module and io, the io one of two words;
    a 3.1 metadata.json has no such key (refused as unknown, so no reader of 3.1 takes a 3.2
    cache's slots for block outputs)."""
    good = small_metadata(layers=(0, 1), sites=["a:input", "a:output"]).to_dict()
    for bad, message in [
        ([{"module": "a", "io": "input", "x": 1}, {"module": "a", "io": "output"}], r"sites\[0\]: expected an object"),
        ([{"module": 3, "io": "input"}, {"module": "a", "io": "output"}], r"sites\[0\].module: expected a string"),
        ([{"module": "a", "io": "in"}, {"module": "a", "io": "output"}], r"sites\[0\].io: expected one of"),
        ({"module": "a", "io": "input"}, "sites: expected an array"),
        ([{"module": "a", "io": "input"}], "expected one site per layer"),
    ]:
        with pytest.raises(ss.MetadataError, match=message):
            parse_metadata({**good, "sites": bad})
    as_31 = {**good, "protocol": "3.1"}
    with pytest.raises(ss.MetadataError, match=r"unknown keys \['sites'\]"):
        parse_metadata(as_31)
    no_sites = {k: v for k, v in good.items() if k != "sites"}
    assert parse_metadata(no_sites).sites is None  # a 3.2 cache may omit them
