"""protocol.checks: shape checks of parsed JSON that word every problem and keep going."""

from __future__ import annotations

import pytest

from saev_shards.errors import ManifestError, MetadataError, Problems
from saev_shards.protocol.checks import JSONChecks, check_keys


def test_check_keys_names_the_missing_and_the_unknown() -> None:
    problems = Problems(MetadataError)
    missing = check_keys(problems, ["a", "z", 3], ("a", "b", "c"), "shards[0]", show_allowed=True)
    assert missing == ["b", "c"]
    assert problems.messages() == [
        "shards[0]: missing keys ['b', 'c']",
        "shards[0]: unknown keys [3, 'z'] (allowed: ['a', 'b', 'c'])",
    ]
    assert [p.field for p in problems.problems] == ["shards[0]", "shards[0]"]
    clean = Problems(MetadataError)
    assert check_keys(clean, {"a": 1}, ("a",)) == [] and not clean


def test_json_checks_return_the_value_or_record_the_problem() -> None:
    checks = JSONChecks("/c/shards.json")
    assert checks.keys("top", {"n": 1}, ("n",))
    assert checks.count("n", 3) == 3
    assert checks.digest("d", "0" * 32) == "0" * 32
    assert checks.name("name", "acts000000.bin", "acts000000.bin") == "acts000000.bin"
    assert not checks
    assert not checks.keys("top", [1], ("n",))
    assert not checks.keys("top", {}, ("n",))
    assert checks.count("n", -1) is None and checks.count("n", True) is None
    assert checks.digest("d", "0" * 31) is None and checks.digest("d", "F" * 32) is None
    assert checks.name("name", "x.bin", "acts000000.bin") is None
    assert checks.messages() == [
        "/c/shards.json: top: expected an object, found array",
        "/c/shards.json: top: missing keys ['n']",
        "/c/shards.json: n: expected an integer >= 0, found int -1",
        "/c/shards.json: n: expected an integer >= 0, found bool True",
        f"/c/shards.json: d: expected 32 lower-case hex digits (xxh3_128), found '{'0' * 31}'",
        "/c/shards.json: d: expected 32 lower-case hex digits (xxh3_128), found 'FFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFF'",
        "/c/shards.json: name: expected name 'acts000000.bin', found 'x.bin'",
    ]
    with pytest.raises(ManifestError, match="top: expected an object") as info:
        checks.raise_if_any()
    assert "name: expected name 'acts000000.bin'" in str(info.value)
