"""protocol.saev_spec: protocol 2.1 as saev's protocol document describes it, read in place
(the legacy fixtures), and never written."""

from __future__ import annotations

from pathlib import Path

import pytest

from saev_shards.errors import MetadataError, Problems
from saev_shards.protocol import saev_spec, v3

from ...support.dialect_fixtures import caches, check_read_back


@pytest.mark.parametrize("folder", caches("saev_spec"), ids=lambda p: p.parent.name)
def test_the_legacy_caches_are_read_in_their_dialect(folder: Path) -> None:
    # their metadata.json was written by another writer (its bytes differ); the name is its content hash
    shards = check_read_back(folder, same_metadata_bytes=False)
    md = shards.metadata
    assert md.dialect == "saev-spec" and md.protocol == "2.1"
    assert saev_spec.DIALECT.directory_name(md) == v3.content_hash(saev_spec.DIALECT.to_json(md))
    assert saev_spec.DIALECT.metadata_bytes(md) == v3.pretty_json(saev_spec.DIALECT.to_json(md))


def test_it_is_never_written() -> None:
    md = check_read_back(caches("saev_spec")[0], same_metadata_bytes=False).metadata
    problems = Problems(MetadataError)
    saev_spec.DIALECT.check_writable(md, problems)
    assert problems.messages() == [
        "dialect: saev's code does not read caches of its protocol document ('saev-spec'); "
        "write protocol '2.1' in dialect 'saev' (the default), which saev reads as its own"
    ]
