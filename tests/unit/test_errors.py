"""The one problem collector (`errors.Problems`): every problem gathered, raised once, same words."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import saev_shards as ss
from saev_shards.dump import parse_config
from saev_shards.errors import (
    ConfigError,
    FileSizeError,
    InvalidCacheError,
    ManifestError,
    MetadataError,
    Problem,
    ProblemCollector,
    Problems,
    StatsFileError,
)
from saev_shards.protocol import DIALECTS
from saev_shards.protocol.checks import JSONChecks
from saev_shards.protocol.metadata import parse_metadata, validate
from saev_shards.protocol.v3 import parse_stats

from ..support.caches import small_metadata


def test_expected_keeps_its_parts_and_the_house_wording() -> None:
    problems = Problems(ConfigError, "/x/c.toml: ")
    problems.expected("layers", "a list of integers", "'6'")
    problems.add("missing key 'model'", field="model")
    (first, second) = problems.problems
    assert first.message == "/x/c.toml: layers: expected a list of integers, found '6'"
    assert (first.kind, first.field) == (ConfigError, "layers")
    assert (first.expected, first.found) == ("a list of integers", "'6'")
    assert (second.field, second.expected, second.found) == ("model", None, None)
    assert problems.messages() == [first.message, "/x/c.toml: missing key 'model'"]
    assert ProblemCollector is Problems  # the earlier name keeps working


def test_context_raises_once_with_every_problem() -> None:
    with pytest.raises(ConfigError) as info, Problems(ConfigError, head="config: ") as problems:
        problems.expected("T", "an integer >= 1", "0")
        problems.expected("layers", "a list", "'x'")
    assert str(info.value) == "config: T: expected an integer >= 1, found 0; layers: expected a list, found 'x'"


def test_context_is_silent_without_problems_and_keeps_the_callers_error() -> None:
    with Problems(ConfigError, head="config: ") as problems:
        pass
    assert not problems and len(problems) == 0
    with pytest.raises(KeyError), Problems(ConfigError) as problems:  # not replaced by a ConfigError
        problems.add("recorded, but the KeyError is what happened")
        raise KeyError("x")


def test_head_separator_and_limit() -> None:
    problems = Problems(MetadataError, sep="\n  ")
    for k in range(5):
        problems.add(f"shard {k}: not written")
    with pytest.raises(MetadataError) as info:
        problems.raise_if_any("/s: cannot finalize, 5 shards incomplete:\n  ", limit=2)
    assert str(info.value).splitlines() == [
        "/s: cannot finalize, 5 shards incomplete:",
        "  shard 0: not written",
        "  shard 1: not written",
    ]


def test_cache_kinds_without_a_head_are_grouped_with_their_problems() -> None:
    problems = Problems(ManifestError, "/c/shards.json: ", path="/c")
    problems.expected("shards[0].nbytes", "an integer >= 0", "str 'x'")
    problems.add("acts000000.bin: expected 8 bytes, found 4", kind=FileSizeError)
    with pytest.raises(InvalidCacheError) as info:  # two kinds: the common base
        problems.raise_if_any()
    assert type(info.value) is InvalidCacheError
    assert [p.kind for p in info.value.problems] == [ManifestError, FileSizeError]
    assert str(info.value).splitlines() == [
        "/c: 2 problems",
        "  shards.json (1):",
        "    - /c/shards.json: shards[0].nbytes: expected an integer >= 0, found str 'x'",
        "  size (1):",
        "    - /c/shards.json: acts000000.bin: expected 8 bytes, found 4",
    ]
    one = Problems(ManifestError, "/c/shards.json: ")
    one.add("version: expected '3.0', found '9'")
    with pytest.raises(ManifestError, match=r"^/c/shards.json: version: expected '3.0', found '9'$"):
        one.raise_if_any()


def test_manifest_checks_record_field_expected_found() -> None:
    checks = JSONChecks("/c/shards.json")
    assert checks.count("shards[3].n_examples", -1) is None
    assert checks.keys("shards[4]", {"name": "a", "extra": 1}, ("name", "n_examples")) is False
    assert [(p.field, p.expected, p.found) for p in checks.problems] == [
        ("shards[3].n_examples", "an integer >= 0", "int -1"),
        ("shards[4]", None, None),
        ("shards[4]", None, None),
    ]
    assert checks.messages() == [
        "/c/shards.json: shards[3].n_examples: expected an integer >= 0, found int -1",
        "/c/shards.json: shards[4]: missing keys ['n_examples']",
        "/c/shards.json: shards[4]: unknown keys ['extra']",
    ]
    assert all(isinstance(p, Problem) and p.kind is ManifestError for p in checks.problems)


def test_metadata_lists_every_problem_in_one_error() -> None:
    md = small_metadata()
    with pytest.raises(MetadataError) as info:
        md.replace(d_model=0, n_examples="x", layers=[])
    assert str(info.value) == (
        "invalid metadata: layers: expected at least one layer, found []; "
        "d_model: expected an integer >= 1, found 0; n_examples: expected an integer, found string 'x'"
    )
    fields: dict[str, Any] = {**md.fields(), "d_model": 0, "cls_token": 1}
    assert validate(fields) == [
        "d_model: expected an integer >= 1, found 0",
        "cls_token: expected true or false, found int 1",
    ]


def test_parsed_metadata_lists_key_and_value_problems_together() -> None:
    obj = small_metadata().to_dict()
    del obj["ckpt"]
    obj["extra"] = 1
    obj["d_model"] = -3
    with pytest.raises(MetadataError) as info:
        parse_metadata(obj)
    message = str(info.value)
    assert message.startswith("missing keys ['ckpt']; unknown keys ['extra'] (allowed: [")
    assert message.endswith("; d_model: expected an integer >= 1, found -3")


def test_a_dialect_adds_what_it_cannot_write_to_the_collector() -> None:
    md = small_metadata(dtype="float32", protocol="2.1", data="x", family="llama", dataset="a//b")
    problems = Problems(MetadataError)
    DIALECTS["saev"].check_writable(md, problems)
    assert problems.messages() == [
        "family: saev reads only bird-mae, clip, dinov2, dinov3, fake-clip, pe-core, pe-spatial, siglip; found 'llama'",
        "dataset: saev stores a path; expected its normal form 'a/b', found 'a//b'",
    ]
    clean = Problems(MetadataError)
    DIALECTS["3.0"].check_writable(small_metadata(), clean)
    assert not clean
    with pytest.raises(MetadataError, match=r"^cannot write a .* cache: family: saev reads only .*; dataset: saev"):
        ss.ShardWriter(Path("/nonexistent/saev/shards"), md)


def test_stats_lists_every_problem_in_one_error() -> None:
    obj = {"layers": [0], "count": [1, 2], "nonfinite": [0, 0], "mean": [[0.0]], "var": [[0.0]], "extra": 0}
    with pytest.raises(StatsFileError) as info:
        parse_stats(obj, layers=[0, 1], d_model=1, path="/c/stats.json")
    assert str(info.value) == (
        "/c/stats.json: missing keys ['norm_mean', 'norm_sq_mean']; unknown keys ['extra']; "
        "layers: expected [0, 1] (metadata.json's layers), found [0]; "
        "mean: expected 2 arrays of 1 numbers (shape [2, 1]), found [[0.0]]; "
        "var: expected 2 arrays of 1 numbers (shape [2, 1]), found [[0.0]]"
    )


def test_dump_config_lists_every_problem_in_one_error() -> None:
    config = {"model": {"path": "/m", "package": "p"}, "T": 0, "layers": "6", "bogus": 1, "dataset": 3}
    with pytest.raises(ConfigError) as info:
        parse_config(config, where="/x/dump.toml")
    message = str(info.value)
    assert message.startswith("/x/dump.toml: unknown keys ['bogus'] (allowed: [")
    parts = message.split("; ")
    assert "T: expected an integer >= 1 (tokens per example), found 0" in parts
    assert "dataset: expected a table or a string, found int" in parts
    assert "model: give exactly one of path, package or factory, found ['path', 'package']" in parts
    assert any(re.match(r"layers: .*'6'", p) for p in parts), parts
    assert len(parts) >= 5
