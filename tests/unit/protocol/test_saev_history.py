"""protocol.saev_history: every format saev wrote before, told by its keys and its name's hash
rule, read in place (the fixtures saev's own code wrote) and never written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from saev_shards.errors import MetadataError, Problems
from saev_shards.protocol import saev_history, versions
from saev_shards.protocol.dialect import Dialect

from ...support.dialect_fixtures import caches, check_read_back

HISTORY = caches("saev_history")


@pytest.mark.parametrize("folder", HISTORY, ids=lambda p: str(p.relative_to(p.parents[3])))
def test_every_format_is_read_in_place_and_named_by_its_rule(folder: Path) -> None:
    # shards.json was appended at every flush by saev's writer: its bytes are its own
    shards = check_read_back(folder, same_list_bytes=False)
    dialect = shards.metadata.rules
    assert isinstance(dialect, saev_history.SaevHistory) and dialect.history
    obj = json.loads((folder / "metadata.json").read_bytes())
    assert saev_history.name_by_rule(obj, dialect.hash_rule) == folder.name
    assert dialect.name_rule() == saev_history.HASH_RULES[dialect.hash_rule][1]
    problems = Problems(MetadataError)
    dialect.check_writable(shards.metadata, problems)
    assert problems  # read, never written


def test_the_fixtures_cover_every_format() -> None:
    covered = {check_read_back(f, same_list_bytes=False).metadata.dialect for f in HISTORY}
    assert covered == {d.name for d in saev_history.DIALECTS}


def test_a_value_no_rule_can_serialise_has_no_name() -> None:
    assert saev_history.name_by_rule({"x": float("nan")}, "orjson") is not None  # orjson writes null
    assert saev_history.name_by_rule({"x": object()}, "json") is None
    assert saev_history.name_by_rule({"x": object()}, "orjson") is None


def test_saev_2_0s_two_hash_rules_are_told_apart_by_the_name() -> None:
    folder = next(f for f in HISTORY if "2.0-orjson" in str(f))
    obj = json.loads((folder / "metadata.json").read_bytes())
    orjson_dialect = versions.DIALECTS["saev-2.0-orjson"]
    json_dialect = versions.DIALECTS["saev-2.0-json"]
    assert saev_history.by_name(json_dialect, obj, folder.name, versions.DIALECTS) is orjson_dialect
    assert saev_history.by_name(json_dialect, obj, None, versions.DIALECTS) is json_dialect
    assert saev_history.by_name(json_dialect, obj, "0" * 64, versions.DIALECTS) is json_dialect


def test_keys_of_two_formats_mixed_are_refused() -> None:
    folder = next(f for f in HISTORY if "1.1-pixel_agg" in str(f))
    obj = json.loads((folder / "metadata.json").read_bytes())
    candidates = list(saev_history.DIALECTS)
    assert saev_history.pick(obj, candidates, candidates).name == "saev-1.1-pixel_agg"
    with pytest.raises(MetadataError, match=r"keys of two formats mixed: 'model_org' is a key of"):
        saev_history.pick({**obj, "model_org": "x"}, candidates, candidates)


def test_keys_two_formats_fit_equally_are_refused() -> None:
    class A(Dialect):
        name, summary, keys = "a", "format a", ("x", "y")

    class B(Dialect):
        name, summary, keys = "b", "format b", ("x", "z")

    a, b = A(), B()
    message = (
        "two readings possible: the keys fit format a (dialect 'a') and format b (dialect 'b') equally; "
        "missing ['y'] of the first, ['z'] of the second (protocol.md 9.5)"
    )
    with pytest.raises(MetadataError, match=re.escape(message)):
        saev_history.pick({"x": 1}, [a, b], [a, b])
    assert saev_history.pick({"x": 1, "y": 2}, [a, b], [a, b]) is a
