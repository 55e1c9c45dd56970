"""protocol.v21: the files of protocol 2.1 (full-size shard files, shards.json as saev's writer
wrote it, the checksums.json sidecar), for every dialect written so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import saev_shards as ss
from saev_shards.errors import ManifestError
from saev_shards.protocol import v21
from saev_shards.protocol.checks import JSONChecks

from ...support.dialect_fixtures import caches, check_read_back

LEGACY = caches("saev_spec") + caches("saev_code")


@pytest.mark.parametrize("folder", LEGACY, ids=lambda p: p.name)
def test_every_shard_file_is_full_size(folder: Path) -> None:
    shards = check_read_back(folder, same_metadata_bytes=False)
    md, dialect = shards.metadata, shards.metadata.rules
    assert isinstance(dialect, v21.V21Files)
    for k in range(md.n_shards):
        assert dialect.shard_nbytes(md, k) == md.examples_per_shard * md.example_nbytes
    with pytest.raises(IndexError):
        dialect.shard_nbytes(md, md.n_shards)


def test_the_checksums_sidecar_lists_every_file_and_reads_back(tmp_path: Path) -> None:
    source = check_read_back(caches("saev_code")[0])
    root = tmp_path / "saev" / "shards"
    with ss.ShardWriter(root, source.metadata) as w:
        w.write(source[:])
    folder = root / source.metadata.hash
    shards = check_read_back(folder)
    md, dialect = shards.metadata, shards.metadata.rules
    sidecar = (folder / "checksums.json").read_bytes()
    assert dialect.sidecars(shards.manifest, md) == {"checksums.json": sidecar}
    parsed, problems = v21.parse_checksums(json.loads(sidecar), "checksums.json")
    assert problems == []
    assert parsed == {name: (n, h) for name, n, h in shards.manifest.files()}
    assert len(parsed) == md.n_shards + len(shards.manifest.empty_shards)  # saev leaves one after an exact fill


def test_parse_shard_list_takes_names_and_counts_and_words_each_problem() -> None:
    checks = JSONChecks("/c/shards.json")
    assert v21.parse_shard_list([{"name": "acts000000.bin", "n_imgs": 3}], checks, "n_imgs") == [("acts000000.bin", 3)]
    assert not checks
    entries = v21.parse_shard_list([{"name": 1, "n_examples": 2}, {"name": "a", "n_examples": -1}, [], {}], checks)
    assert entries == []
    assert checks.messages() == [
        "/c/shards.json: [0].name: expected a string, found int",
        "/c/shards.json: [1].n_examples: expected an integer >= 0, found int -1",
        "/c/shards.json: [2]: expected an object, found array",
        "/c/shards.json: [3]: missing keys ['name', 'n_examples']",
    ]
    other = JSONChecks("/c/shards.json")
    assert v21.parse_shard_list({"shards": []}, other) is None
    assert other.messages() == ["/c/shards.json: expected an array of shard objects (protocol 2.1), found object"]


def test_parse_checksums_words_each_problem() -> None:
    good = {"nbytes": 4, "xxh3_128": "0" * 32}
    parsed, problems = v21.parse_checksums({"files": {"a": good, "b": {"nbytes": -1, "xxh3_128": "x"}}}, "/c/x.json")
    assert parsed == {"a": (4, "0" * 32)}
    assert [p.message for p in problems] == [
        "/c/x.json: files['b'].nbytes: expected an integer >= 0, found int -1",
        "/c/x.json: files['b'].xxh3_128: expected 32 lower-case hex digits (xxh3_128), found 'x'",
    ]
    assert all(p.kind is ManifestError for p in problems)
    assert [p.message for p in v21.parse_checksums({"files": []}, "/c/x.json")[1]] == [
        "/c/x.json: files: expected an object, found array"
    ]
    assert [p.message for p in v21.parse_checksums([], "/c/x.json")[1]] == [
        "/c/x.json: top level: expected an object, found array"
    ]
