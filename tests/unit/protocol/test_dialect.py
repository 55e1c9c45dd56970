"""protocol.dialect: what every dialect shares (the `Dialect` defaults): metadata.json's keys to
`Metadata` fields and back, and the values a dialect cannot hold, each named in one message."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import saev_shards as ss
from saev_shards.errors import DtypeError, MetadataError, Problems
from saev_shards.protocol import v3, v31
from saev_shards.protocol.dialect import Dialect

from ...support.caches import small_metadata


def test_fields_and_to_json_are_inverse() -> None:
    md = small_metadata(protocol="3.0")
    obj = v3.DIALECT.to_json(md)
    assert list(obj) == list(v3.DIALECT.keys) and obj["layers"] == [6, 11]
    problems = Problems(MetadataError)
    fields = v3.DIALECT.fields(obj, problems)
    assert not problems
    assert ss.Metadata(**fields) == md


def test_missing_and_unknown_keys_are_reported_and_the_known_ones_kept() -> None:
    obj = v3.DIALECT.to_json(small_metadata(protocol="3.0"))
    del obj["dtype"]
    problems = Problems(MetadataError)
    fields = v3.DIALECT.fields({**obj, "colour": "red"}, problems)
    assert problems.messages() == [
        "missing keys ['dtype']",
        f"unknown keys ['colour'] (allowed: {list(v3.DIALECT.keys)})",
    ]
    assert "colour" not in fields and fields["dialect"] == "3.0" and fields["d_model"] == 8


@pytest.mark.parametrize(
    ("changes", "kind", "message"),
    [
        (
            dict(protocol="3.0", dtype="float8_e4m3"),
            DtypeError,
            "dtype: expected one of ['float16', 'bfloat16', 'float32'] for protocol 3.0 "
            "(float8_e4m3 is protocol 3.1's), found 'float8_e4m3'",
        ),
        (dict(protocol="3.0", data="x"), MetadataError, "data: expected an object (protocol 3.0), found string"),
        (
            dict(pixel_agg="majority"),
            MetadataError,
            "pixel_agg: protocol 3.1 has no pixel_agg; expected None, found 'majority'",
        ),
        (dict(seed=3), MetadataError, "seed: expected None (protocol 3.1 has no seed), found 3"),
        (
            dict(protocol="3.0", dialect="3.1"),
            MetadataError,
            "protocol: dialect '3.1' (protocol 3.1) is written as ['3.1'], found '3.0' "
            "(name a dialect that fits, or none: dialect='' means the protocol's default)",
        ),
    ],
)
def test_what_a_dialect_cannot_hold_is_named(changes: dict[str, Any], kind: type[Exception], message: str) -> None:
    with pytest.raises(kind, match=re.escape(message)):
        small_metadata(**changes)


def test_the_defaults_of_a_dialect() -> None:
    md = small_metadata()
    dialect = v31.DIALECT
    assert repr(dialect) == "<dialect 3.1: protocol 3.1>"
    assert dialect.name_rule() == ""
    assert dialect.empty_shards(md) == 0
    assert [dialect.shard_nbytes(md, k) for k in range(md.n_shards)] == [
        md.shard_n_examples(k) * md.example_nbytes for k in range(md.n_shards)
    ]
    assert sum(md.shard_n_examples(k) for k in range(md.n_shards)) == md.n_examples
    problems = Problems(MetadataError)
    dialect.check_writable(md, problems)
    assert not problems


def test_the_byte_rules_are_each_dialects_own() -> None:
    bare = Dialect()
    md = small_metadata()
    for call in (
        lambda: bare.metadata_bytes(md),
        lambda: bare.directory_name(md),
        lambda: bare.load_manifest(Path("."), md),
    ):
        with pytest.raises(NotImplementedError):
            call()
