"""remote.files, the earlier name of `saev_shards.storage.remote`: its names are the storage
package's own objects, and `refetch_json` reads the file again through `RemoteFiles.read_json`."""

from __future__ import annotations

from typing import Any

from saev_shards import storage
from saev_shards.errors import InvalidCacheError, ManifestError, Problem
from saev_shards.remote import files
from saev_shards.storage import remote, remote_json, units


def test_every_name_is_the_one_in_the_storage_package() -> None:
    homes = (remote, remote_json, units)
    for name in files.__all__:
        if name == "refetch_json":
            continue
        value = getattr(files, name)
        assert any(getattr(home, name, None) is value for home in homes), name
    assert files.RemoteFiles is storage.remote.RemoteFiles


def test_refetch_json_reads_the_file_again_through_read_json() -> None:
    calls: list[tuple[str, int, type[InvalidCacheError]]] = []

    class Fake:
        def read_json(self, name: str, max_bytes: int, kind: type[InvalidCacheError]) -> tuple[Any, list[Problem]]:
            calls.append((name, max_bytes, kind))
            return {"n": 1}, []

    got = files.refetch_json(Fake(), "manifest.json", 4096, ManifestError)  # type: ignore[arg-type]
    assert got == ({"n": 1}, [])
    assert calls == [("manifest.json", 4096, ManifestError)]
