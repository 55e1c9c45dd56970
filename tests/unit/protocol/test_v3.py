"""protocol.v3: protocol 3.0's metadata.json bytes, its content-hash directory name and its
shards.json, read and written back exactly (the golden 3.0 cache), and its JSON forms."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from saev_shards.protocol import v3

from ...support.dialect_fixtures import caches, check_read_back

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)


@pytest.mark.parametrize("folder", caches("v3"), ids=lambda p: p.parent.name)
def test_the_golden_cache_is_read_and_written_back_exactly(folder: Path) -> None:
    shards = check_read_back(folder)
    assert shards.metadata.dialect == "3.0"


@given(st.dictionaries(st.text(max_size=8), json_values, max_size=5))
def test_the_content_hash_is_sha256_of_the_canonical_json(obj: dict[str, object]) -> None:
    canonical = v3.canonical_json(obj)
    assert json.loads(canonical) == obj
    assert canonical == json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    assert v3.content_hash(obj) == hashlib.sha256(canonical).hexdigest()
    pretty = v3.pretty_json(obj)
    assert pretty.endswith(b"\n") and json.loads(pretty) == obj


def test_canonical_json_escapes_non_ascii_and_refuses_nan() -> None:
    assert v3.canonical_json({"b": "é", "a": 1}) == b'{"a":1,"b":"\\u00e9"}'
    assert v3.pretty_json({"b": "é"}) == '{\n  "b": "é"\n}\n'.encode()
    with pytest.raises(ValueError):
        v3.canonical_json({"x": float("nan")})


def test_the_manifest_json_round_trips(tmp_path: Path) -> None:
    folder = caches("v3")[0]
    shards = check_read_back(folder)
    obj = v3.manifest_json(shards.manifest)
    assert v3.manifest_bytes(shards.manifest) == (folder / "shards.json").read_bytes()
    assert json.loads((folder / "shards.json").read_bytes()) == obj
    assert set(obj) <= set(v3.TOP_KEYS)
    assert all(set(entry) == set(v3.SHARD_KEYS) for entry in obj["shards"])
