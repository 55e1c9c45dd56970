"""protocol.v32: protocol 3.2, 3.1 with an optional ``sites`` key saying what each layer slot holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from saev_shards.errors import MetadataError, Problems
from saev_shards.protocol import v32
from saev_shards.protocol.sites import Site

from ...support.caches import small_metadata
from ...support.dialect_fixtures import caches, check_read_back


@pytest.mark.parametrize("folder", caches("v32"), ids=lambda p: p.parent.name)
def test_the_golden_cache_is_read_and_written_back_exactly(folder: Path) -> None:
    shards = check_read_back(folder)
    assert shards.metadata.dialect == "3.2"
    obj = json.loads((folder / "metadata.json").read_bytes())
    assert v32.DIALECT.to_json(shards.metadata) == obj


def test_sites_are_optional_and_written_as_objects() -> None:
    md = small_metadata(protocol="3.2")
    assert "sites" not in v32.DIALECT.to_json(md)
    sited = small_metadata(protocol="3.2", sites=["a:input", ("b", "output")])
    assert sited.sites == (Site("a", "input"), Site("b", "output"))
    obj = v32.DIALECT.to_json(sited)
    assert obj["sites"] == [{"module": "a", "io": "input"}, {"module": "b", "io": "output"}]
    problems = Problems(MetadataError)
    fields = v32.DIALECT.fields(obj, problems)
    assert not problems and fields["sites"] == sited.sites and fields["dialect"] == "3.2"


def test_a_bad_sites_value_and_unknown_keys_are_problems() -> None:
    obj = v32.DIALECT.to_json(small_metadata(protocol="3.2"))
    problems = Problems(MetadataError)
    v32.DIALECT.fields({**obj, "sites": "a:input", "extra": 1}, problems)
    assert problems.messages() == [
        "unknown keys ['extra'] (allowed: " + str(list(v32.DIALECT.keys)) + ")",
        "sites: expected an array of site objects, found string",
    ]


def test_sites_need_protocol_3_2() -> None:
    assert small_metadata(protocol="3.1", sites=["a:input", "b:input"]).dialect == "3.2"  # this version's: taken up
    with pytest.raises(MetadataError, match=r"sites: protocol 3\.0 cannot say what each layer holds"):
        small_metadata(protocol="3.0", sites=["a:input", "b:input"])
