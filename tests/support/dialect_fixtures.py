"""The caches under tests/data by the dialect they are written in, and the checks every
dialect's unit tests make of its own (tests/unit/protocol/test_<dialect module>.py): the
dialect reads their metadata.json and lists, and gives back their names and sizes."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import saev_shards as ss
from saev_shards.errors import ProtocolWarning

DATA = Path(__file__).resolve().parents[1] / "data"


@functools.cache
def caches(module: str) -> tuple[Path, ...]:
    """The folders of the fixtures written in a dialect of protocol module ``module`` (``"v3"``...)."""
    found = []
    for path in sorted(DATA.rglob("metadata.json")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ProtocolWarning)
            shards = ss.open(path.parent)
        if type(shards.metadata.rules).__module__ == f"saev_shards.protocol.{module}":
            found.append(path.parent)
    return tuple(found)


def check_read_back(folder: Path, *, same_metadata_bytes: bool = True, same_list_bytes: bool = True) -> ss.Shards:
    """The dialect of the cache in ``folder`` gives back its directory name, its metadata.json
    (and shards.json) bytes where it wrote them itself, reads its list without a problem, and
    sizes its last shard's file."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProtocolWarning)
        shards = ss.open(folder)
    md = shards.metadata
    dialect = md.rules
    assert dialect.directory_name(md) == folder.name
    if same_metadata_bytes:
        assert dialect.metadata_bytes(md) == (folder / "metadata.json").read_bytes()
    manifest, problems = dialect.load_manifest(folder, md)
    assert problems == [] and manifest is not None
    if same_list_bytes and dialect.manifest_file is not None:
        assert dialect.manifest_bytes(manifest, md) == (folder / dialect.manifest_file).read_bytes()
    last = md.n_shards - 1
    assert dialect.shard_nbytes(md, last) == (folder / f"acts{last:06d}.bin").stat().st_size
    return shards
