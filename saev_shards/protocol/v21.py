"""What both dialects of protocol 2.1 share (protocol.md section 9): the files beside metadata.json.

* shards.json is an array of ``{"name", "n_examples"}`` objects, one per shard file;
* every shard file but the last is full; the last is zero-padded to a full shard (saev's
  writer memmaps every shard at full size), and a reader also accepts it unpadded;
* when the examples fill the last shard exactly, saev's writer leaves one more all-zero,
  full-size file, listed with ``n_examples`` 0 (`Manifest.empty_shards`);
* ``labels.bin``, uint8 ``(n_examples, patches_per_ex)``, is there when labels were written;
* there are no checksums, unless this library's sidecar ``checksums.json`` is there:
  ``{"files": {<file name>: {"nbytes", "xxh3_128"}}}`` for every data file. saev's readers
  open files by the names metadata.json and shards.json give and never list the folder,
  so they ignore it.

The metadata.json of each dialect, and the directory name, live in `saev_code` and `saev_spec`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from ..errors import ManifestError, Problem
from .checks import JSONChecks
from .common import (
    CHECKSUMS_FILE,
    LABELS_DTYPE,
    LABELS_FILE,
    MANIFEST_FILE,
    manifest_max_bytes,
    shard_name,
)
from .dialect import Dialect
from .jsonfile import load_json, short_repr, type_name
from .manifest import ArrayEntry, Manifest, ShardEntry, ShardList
from .v3 import pretty_json

if TYPE_CHECKING:
    from .metadata import Metadata


class V21Files(Dialect):
    """The files of protocol 2.1 (module docstring); subclasses add metadata.json and the name."""

    legacy = True
    padded_last = True
    sidecar_names: tuple[str, ...] = (CHECKSUMS_FILE,)
    #: The key of a shards.json entry that holds its example count (saev 1.x: ``n_imgs``).
    count_key = "n_examples"

    def shard_nbytes(self, md: Metadata, shard: int) -> int:
        """Every shard file is full size: saev's readers memmap each at ``(S, L, T, D)``."""
        md.shard_n_examples(shard)  # IndexError when out of range
        return md.examples_per_shard * md.example_nbytes

    def load_manifest(self, folder: Path, md: Metadata) -> tuple[Manifest | None, list[Problem]]:
        path = folder / MANIFEST_FILE
        # Every integer is type-checked below: the strict loader's scan may skip scalars.
        obj, problems = load_json(path, manifest_max_bytes(md.n_shards), ManifestError, every_number=False)
        if problems:
            return None, problems
        checks = JSONChecks(str(path))
        entries = parse_shard_list(obj, checks, self.count_key)
        if entries is None or checks:
            return None, checks.problems
        # saev's writer leaves one empty file after a shard filled exactly: listed, not a shard.
        # Only entries named for their position qualify, so only such names reach a system call.
        trailing: list[tuple[str, int]] = []
        while len(entries) > md.n_shards and entries[-1][1] == 0 and entries[-1][0] == shard_name(len(entries) - 1):
            trailing.insert(0, entries.pop())
        digests: dict[str, tuple[int, str]] = {}
        sidecar = folder / CHECKSUMS_FILE
        if os.path.lexists(sidecar):  # absent: no checksums; present but a link or broken: an error
            obj, problems = load_json(sidecar, manifest_max_bytes(md.n_shards + len(trailing)), ManifestError)
            if problems:
                return None, problems
            digests, problems = parse_checksums(obj, str(sidecar))
            if problems:
                return None, problems
        full = md.examples_per_shard * md.example_nbytes
        shards = []
        for i, (name, count) in enumerate(entries):
            nbytes = count * md.example_nbytes
            if i == md.n_shards - 1 and name == shard_name(i) and _size(folder / name) == full:
                nbytes = full  # padded to a full shard, as saev writes it; both lengths are accepted
            shards.append(ShardEntry(name, count, *digests.get(name, (nbytes, None))))
        empty = [ShardEntry(name, 0, *digests.get(name, (full, None))) for name, _ in trailing]
        labels = None
        if os.path.lexists(folder / LABELS_FILE):
            nbytes, digest = digests.get(LABELS_FILE, (md.n_examples * md.patches_per_ex, None))
            labels = ArrayEntry(LABELS_FILE, LABELS_DTYPE.str, (md.n_examples, md.patches_per_ex), nbytes, digest)
        return Manifest(shards=ShardList.of(shards), labels=labels, empty_shards=ShardList.of(empty)), []

    def manifest_bytes(self, manifest: Manifest, md: Metadata) -> bytes:
        """As saev's writer writes it: ``orjson.dumps([{"name", "n_examples"}, ...], option=OPT_INDENT_2)``,
        no final newline, the empty shards last."""
        entries = [{"name": s.name, "n_examples": s.n_examples} for s in (*manifest.shards, *manifest.empty_shards)]
        return orjson.dumps(entries, option=orjson.OPT_INDENT_2)

    def sidecars(self, manifest: Manifest, md: Metadata) -> dict[str, bytes]:
        return {CHECKSUMS_FILE: pretty_json(checksums_json(manifest))}


def parse_shard_list(obj: object, checks: JSONChecks, count_key: str = "n_examples") -> list[tuple[str, int]] | None:
    """``[(name, n_examples), ...]`` of a 2.1 shards.json (or of saev's earlier ones, whose
    count is ``count_key``); every problem goes to ``checks``."""
    if not isinstance(obj, list):
        checks.add(f"expected an array of shard objects (protocol 2.1), found {type_name(obj)}")
        return None
    entries: list[tuple[str, int]] = []
    for i, e in enumerate(obj):
        where = f"[{i}]"
        if not checks.keys(where, e, ("name", count_key)):
            continue
        assert isinstance(e, dict)
        count = checks.count(f"{where}.{count_key}", e[count_key])
        if not isinstance(e["name"], str):
            checks.expected(f"{where}.name", "a string", type_name(e["name"]))
        elif count is not None:
            entries.append((e["name"], count))
    return entries


def checksums_json(manifest: Manifest) -> dict[str, Any]:
    """The checksums.json object: size and digest of every data file."""
    return {"files": {name: {"nbytes": n, "xxh3_128": h} for name, n, h in manifest.files()}}


def parse_checksums(obj: object, path: str) -> tuple[dict[str, tuple[int, str]], list[Problem]]:
    """Parse checksums.json into ``{name: (nbytes, xxh3_128)}``."""
    checks = JSONChecks(path)
    out: dict[str, tuple[int, str]] = {}
    if not checks.keys("top level", obj, ("files",)):
        return out, checks.problems
    assert isinstance(obj, dict)
    files = obj["files"]
    if not isinstance(files, dict):
        checks.expected("files", "an object", type_name(files))
        return out, checks.problems
    for name, e in files.items():
        where = f"files[{short_repr(name)}]"
        if not checks.keys(where, e, ("nbytes", "xxh3_128")):
            continue
        nbytes = checks.count(f"{where}.nbytes", e["nbytes"])
        digest = checks.digest(f"{where}.xxh3_128", e["xxh3_128"])
        if nbytes is not None and digest is not None:
            out[name] = (nbytes, digest)
    return out, checks.problems


def _size(path: Path) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:
        return -1
