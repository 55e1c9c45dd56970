"""The storage interface (`storage.base.Files`), run on both storages it has: a local folder
(`LocalFiles`) and a remote cache served from memory (`RemoteFiles` with an in-memory client).
Whatever a caller asks, both answer with the same bytes, the same digests and the same kinds
of errors; and no module outside `saev_shards.storage` asks which storage it holds."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

import saev_shards
from saev_shards.errors import CacheNotFoundError, StatsFileError
from saev_shards.fileio import BlockHasher
from saev_shards.storage import Files, LocalFiles
from saev_shards.storage.blockcache import BlockCache
from saev_shards.storage.client import Client
from saev_shards.storage.remote import RemoteFiles

DATA = bytes((i * 13 + i // 7) % 256 for i in range(6000))
JSON = orjson.dumps({"count": [1, 2], "name": "x"})
URL = "s3://bucket/root/" + "b" * 64


class MemoryServer(Client):
    """A remote root in memory: ``objects`` (names under the cache) -> bytes."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        super().__init__(URL)
        self.objects = objects

    def stream(self, name: str, start: int, end: int, chunk: int = 0) -> Iterator[Any]:
        if name not in self.objects:
            raise FileNotFoundError(name)
        body = self.objects[name][start : end + 1]  # one byte past the end at most, as the real one
        for i in range(0, len(body), 1000):
            yield body[i : i + 1000]

    def get_bytes(self, name: str, max_bytes: int) -> bytes:
        if name not in self.objects:
            raise FileNotFoundError(name)
        return self.objects[name]


def _storages(tmp_path: Path, kind: str) -> Files:
    objects = {"f.bin": DATA, "stats.json": JSON, "metadata.json": JSON}
    if kind == "local":
        folder = tmp_path / ("c" * 64)
        folder.mkdir(parents=True)
        for name, data in objects.items():
            (folder / name).write_bytes(data)
        return LocalFiles(folder)
    listed = {n: (len(data), xxhash.xxh3_128_hexdigest(data)) for n, data in objects.items() if n != "metadata.json"}
    files = RemoteFiles(URL, listed, BlockCache(tmp_path / "block-cache"))
    files.client = MemoryServer(objects)
    return files


@pytest.fixture(params=["local", "remote"])
def files(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Files]:
    made = _storages(tmp_path, request.param)
    yield made
    made.close_all()


def test_each_storage_implements_the_whole_interface() -> None:
    for cls in (LocalFiles, RemoteFiles):
        assert issubclass(cls, Files) and not getattr(cls, "__abstractmethods__", None), cls


def test_whole_files_read_the_same_on_both(files: Files) -> None:
    assert bytes(files.read("f.bin")) == DATA
    assert bytes(files.read("f.bin", 100, 250)) == DATA[100:250]
    with files.open_file("f.bin") as f:
        assert f.read() == DATA
    loaded = files.load("f.bin", np.dtype(np.uint8), (len(DATA),))
    assert bytes(loaded) == DATA and not loaded.flags.writeable
    mapped = files.map("f.bin", np.dtype(np.uint8), (len(DATA),))
    assert (mapped is not None) == files.mappable
    fd = files.open("f.bin")
    out = bytearray(50)
    assert files.preadv(fd, [memoryview(out)], 5990) == 10 and bytes(out[:10]) == DATA[5990:]
    files.prefetch(fd, 0, len(DATA))
    files.prefetch(fd, 0, len(DATA), scattered=True)
    files.close(fd)


@given(start=st.integers(0, len(DATA) + 5), length=st.none() | st.integers(0, len(DATA)))
def test_a_stream_stops_one_byte_past_where_it_is_asked_to(
    tmp_path_factory: pytest.TempPathFactory, start: int, length: int | None
) -> None:
    for kind in ("local", "remote"):
        files = _storages(tmp_path_factory.mktemp(kind), kind)
        stop = None if length is None else start + length
        got = b"".join(bytes(piece) for piece in files.stream("f.bin", start, stop))
        want = DATA[start:] if stop is None else DATA[start : stop + 1]
        assert got == want, kind


@pytest.mark.parametrize("block_size", [None, 1000, 4096])
def test_verify_file_gives_the_digests_of_the_whole_and_of_each_block(files: Files, block_size: int | None) -> None:
    ticks: list[int] = []
    nbytes, digest, blocks = files.verify_file("f.bin", block_size, ticks.append)
    want = BlockHasher(block_size)
    want.update(DATA)
    assert (nbytes, digest, blocks) == (len(DATA), want.hexdigest(), want.block_hexdigests())
    assert sum(ticks) == len(DATA)


def test_a_missing_file_is_cache_not_found_on_both(files: Files) -> None:
    with pytest.raises(CacheNotFoundError, match=r"gone\.bin"):
        files.verify_file("gone.bin", None, lambda n: None)


def test_json_files_are_read_again_under_the_strict_rules(files: Files) -> None:
    assert files.read_json("stats.json", 1 << 10, StatsFileError) == (orjson.loads(JSON), [])
    assert files.read_json("metadata.json", 1 << 10, StatsFileError) == (orjson.loads(JSON), [])
    value, problems = files.read_json("stats.json", 4, StatsFileError)
    assert value is None and [p.kind for p in problems] == [StatsFileError]
    assert files.where("stats.json") in problems[0].message
    value, problems = files.read_json("f.bin" if files.mappable else "missing.json", 1 << 20, StatsFileError)
    assert value is None and len(problems) == 1


def test_where_things_are(files: Files) -> None:
    assert files.where("f.bin").endswith("/f.bin") and files.where("f.bin").startswith(files.location)
    root = files.location.rsplit("/", 1)[0]
    assert files.beside(".stats/x.json") == f"{root}/.stats/x.json"
    assert (files.url is None) == (files.local_root is not None)
    assert files.footprint() >= len(DATA) + len(JSON)
    assert files.streams >= 1
    assert not files.per_block("f.bin")


# -- no caller asks which storage it holds ------------------------------------------------------

PACKAGE = Path(saev_shards.__file__).parent
#: Code that decides with these asks "is it remote?" instead of asking the storage.
PROBES = (
    re.compile(r"getattr\(\s*[\w.]*files\b"),
    re.compile(r"\burl is (not )?None\b"),
    re.compile(r"\bfiles\.copies\b"),
    re.compile(r"\bfiles\.url\b"),
)


def test_no_module_outside_the_storage_package_probes_the_storage() -> None:
    """Every difference between local and remote storage is a `Files` method or property: no
    attribute probing and no branching on the URL outside `saev_shards.storage` (and the
    `remote` compatibility package)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in ("storage", "remote"):
            continue
        code = ast.unparse(ast.parse(path.read_text()))  # comments and docstrings' wording left out
        for probe in PROBES:
            found += [f"{rel}: {m.group()}" for m in probe.finditer(code)]
    # `Shards.url` itself reads the storage's URL: the one public place it is exposed.
    assert found == ["reader/shards.py: files.url"], found
