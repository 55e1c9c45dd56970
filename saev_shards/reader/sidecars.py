"""What lives beside the activations: labels, per-example columns and text fields, and statistics.

Each is opened on first use and kept per process (`ShardHandles._aux`). Statistics come
from the cache's own stats.json, else from the stats sidecar that `saev-shards stats`
wrote beside the cache (protocol.md 2.9): finding and checking a sidecar lives here
(`find_stats`, `sidecar_path`), so the reader never imports the store; writing one is the
store's job (`store.sidecar`).
"""

from __future__ import annotations

import functools
import io
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import orjson
import xxhash

from ..errors import (
    InvalidCacheError,
    ManifestError,
    NameNotFoundError,
    Problem,
    StatsFileError,
    raise_problems,
)
from ..fileio import hash_file
from ..protocol.common import METADATA_FILE, stats_max_bytes
from ..protocol.jsonfile import read_json_file, short_repr
from ..protocol.v3 import parse_stats, pretty_json
from ..storage.local import naming_removal
from .handles import ShardHandles
from .indexing import wrap_index


class TextColumn(Sequence[Any]):
    """Per-example JSON values of one text field, read lazily from its JSON Lines file.

    ``opener``: how the file is opened (a cache's storage: `Files.open_file`), and ``read``:
    where its bytes come from, read whole on first use; ``path`` then only names it in
    messages. With neither, ``path`` is a local file, opened in place.
    """

    def __init__(
        self,
        path: Path | str,
        n_lines: int,
        read: Callable[[], bytes | bytearray] | None = None,
        *,
        opener: Callable[[], Any] | None = None,
    ) -> None:
        self.path = path
        self.n_lines = n_lines
        self._read = read
        self._opener = opener
        self._data: bytes | bytearray | None = None
        self._offsets: npt.NDArray[np.int64] | None = None

    def _open(self) -> Any:
        if self._opener is not None:
            return self._opener()
        if self._read is None:
            path = Path(self.path)
            with naming_removal(path.parent, path.name):
                return open(path, "rb")
        if self._data is None:
            self._data = self._read()
        return io.BytesIO(self._data)

    def _index(self) -> npt.NDArray[np.int64]:
        if self._offsets is None:
            with self._open() as f:
                data = np.frombuffer(f.read(), dtype=np.uint8)
            ends = np.flatnonzero(data == ord("\n")) + 1
            if len(ends) != self.n_lines:
                raise ManifestError(f"{self.path}: expected {self.n_lines} lines, found {len(ends)}")
            self._offsets = np.concatenate([[0], ends]).astype(np.int64)
        return self._offsets

    def __len__(self) -> int:
        return self.n_lines

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n_lines))]
        i = wrap_index(int(i), self.n_lines, "example")
        offsets = self._index()
        with self._open() as f:
            f.seek(int(offsets[i]))
            return self._value(f.read(int(offsets[i + 1] - offsets[i])), i)

    def __iter__(self) -> Iterator[Any]:
        count = 0
        with self._open() as f:
            for count, line in enumerate(f, 1):
                if count > self.n_lines:
                    break
                yield self._value(line, count - 1)
        if count != self.n_lines:
            found = "more" if count > self.n_lines else str(count)
            raise ManifestError(f"{self.path}: expected {self.n_lines} lines, found {found}")

    def _value(self, line: bytes, i: int) -> Any:
        try:
            return orjson.loads(line)
        except orjson.JSONDecodeError as err:  # damaged since written: `verify` names the file
            raise InvalidCacheError(f"{self.path}: line {i + 1}: not valid JSON ({err})") from None


V = TypeVar("V")


class Fields(Mapping[str, V]):
    """A cache's per-example columns or text fields by name (`Shards.columns`, `Shards.text`).

    ``fields["name"]`` is the one spelling for both; ``fields("name")`` works too (earlier
    versions had ``shards.text("name")``). A name the cache does not have raises
    `NameNotFoundError` (a `KeyError` and a `ShardsError`) listing the names it has.
    Values are opened on first use and kept.
    """

    def __init__(self, kind: str, where: Path, names: Sequence[str], load: Callable[[str], V]) -> None:
        self._kind = kind
        self._where = where
        self._names = tuple(names)
        self._load = load
        self._values: dict[str, V] = {}

    def __getitem__(self, name: str) -> V:
        value = self._values.get(name) if isinstance(name, str) else None
        if value is None:
            if not isinstance(name, str) or name not in self._names:
                raise NameNotFoundError(
                    f"{self._where}: no {self._kind} {short_repr(name)}; this cache has "
                    + (f"{self._kind}s {sorted(self._names)}" if self._names else f"no {self._kind}s")
                )
            value = self._values[name] = self._load(name)
        return value

    def __call__(self, name: str) -> V:
        return self[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        return f"<{self._kind}s {list(self._names)}>"


class Sidecars(ShardHandles):
    """Labels, columns, text fields and statistics of a cache (`Shards` is one)."""

    @property
    def labels(self) -> np.memmap[Any, Any] | None:
        """``(n_examples, patches_per_ex)`` uint8 memmap of patch labels, or None."""
        lab = self.manifest.labels
        if lab is None:
            return None
        self._check_pid()
        if "labels" not in self._aux:
            self._aux["labels"] = self._array(lab.name, np.dtype(lab.dtype), lab.shape)
        return self._aux["labels"]  # type: ignore[no-any-return]

    @property
    def columns(self) -> Fields[npt.NDArray[Any]]:
        """Per-example numeric columns by name (``shards.columns["lengths"]``), as read-only
        memmaps; a missing name raises `NameNotFoundError` listing the columns."""
        self._check_pid()
        if "columns" not in self._aux:
            cols = self.manifest.columns

            def load(name: str) -> npt.NDArray[Any]:
                c = cols[name]
                return self._array(c.name, np.dtype(c.dtype), c.shape)

            self._aux["columns"] = Fields("column", self.path, list(cols), load)
        return self._aux["columns"]  # type: ignore[no-any-return]

    @property
    def lengths(self) -> npt.NDArray[Any] | None:
        """The ``lengths`` column (valid token positions per example), or None."""
        return self.columns.get("lengths")

    @property
    def text(self) -> Fields[TextColumn]:
        """Per-example JSON values of each text field by name (``shards.text["prompt"]``; lazy,
        indexable); ``shards.text("prompt")``, the spelling of earlier versions, works too. A
        missing name raises `NameNotFoundError` listing the text fields."""
        self._check_pid()
        if "text" not in self._aux:
            entries = self.manifest.text

            def load(name: str) -> TextColumn:
                entry = entries[name]
                opener = functools.partial(self.files.open_file, entry.name)
                return TextColumn(self.files.where(entry.name), entry.n_lines, opener=opener)

            self._aux["text"] = Fields("text field", self.path, list(entries), load)
        return self._aux["text"]  # type: ignore[no-any-return]

    @property
    def stats(self) -> dict[str, Any] | None:
        """Per-layer statistics gathered while writing (numpy arrays), else those of the
        sidecar `saev-shards stats` wrote (`store.sidecar`), else None.

        stats.json is read, and checked against its schema (protocol.md 2.6: exact keys,
        one entry per layer, ``mean`` and ``var`` of shape ``(L, D)``), on first use, not
        by `open` (it can be tens of MB for a large model); `StatsFileError` if it fails.
        """
        entry = self.manifest.stats
        if entry is None:  # computed later by `saev-shards stats`, beside the cache (protocol.md 2.9)?
            return find_stats(self)
        if "stats" not in self._aux:
            md = self.metadata
            # parse_stats type-checks every integer; a float is a float whatever its spelling.
            cap = stats_max_bytes(md.n_layers, md.d_model)
            raw, problems = self.files.read_json(entry.name, cap, StatsFileError, every_number=False)
            raise_problems(problems, self.files.location)
            tokens = md.n_examples * md.tokens_per_ex
            self._aux["stats"] = parse_stats(raw, md.layers, md.d_model, self.files.where(entry.name), tokens)
        return self._aux["stats"]  # type: ignore[no-any-return]

    def _array(self, name: str, dtype: np.dtype[Any], shape: tuple[int, ...]) -> npt.NDArray[Any]:
        """A raw array file beside the shards: a read-only memmap, or of a storage that cannot map
        (a remote cache) a read-only copy (read whole, verified)."""
        return self.files.load(name, dtype, shape)

    def _stats_problems(self) -> list[Problem]:
        self._aux.pop("stats", None)
        try:
            self.stats  # noqa: B018 - read and checked against the schema
        except InvalidCacheError as err:
            return err.problems
        return []


#: The folder of a shards root that holds sidecars (not a cache: `ls` and `resolve` skip it).
SIDECAR_DIR = ".stats"
SIDECAR_KEYS = ("cache", "manifest_xxh3_128", "stats", "stats_xxh3_128")


def sidecar_path(shards: Sidecars) -> Path:
    """Where the statistics sidecar of ``shards`` lives: ``<root>/.stats/<hash>.json``."""
    return shards.path.parent / SIDECAR_DIR / f"{shards.metadata.hash}.json"


def manifest_file(shards: Sidecars) -> Path:
    """The file that lists the shards of ``shards``: shards.json, or metadata.json for saev's
    formats before 1.0.0, which have none (their shards follow from it, protocol.md 9.5)."""
    return shards.path / (shards.metadata.rules.manifest_file or METADATA_FILE)


def manifest_digest(shards: Sidecars) -> str:
    """The xxh3_128 digest of the shards.json of ``shards`` (what a sidecar is tied to; `manifest_file`)."""
    return hash_file(manifest_file(shards), regular_only=True)[1]


def find_stats(shards: Sidecars) -> dict[str, Any] | None:
    """The sidecar statistics of ``shards`` (as `Shards.stats` returns them), None if there
    is no sidecar; `StatsFileError` if it exists but does not check out."""
    path = sidecar_path(shards)
    if not os.path.lexists(path):
        return None
    md = shards.metadata
    again = f"; remove it, or make it again with `saev-shards stats {md.hash[:12]} --force`"
    try:
        obj = read_json_file(path, stats_max_bytes(md.n_layers, md.d_model) + 4096)
    except (OSError, ValueError) as err:
        why = str(err).removeprefix(f"{path}: ")
        raise StatsFileError(f"{path}: unreadable statistics sidecar: {why}{again}") from None
    if not isinstance(obj, dict) or sorted(obj) != sorted(SIDECAR_KEYS):
        found = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise StatsFileError(f"{path}: expected an object with keys {list(SIDECAR_KEYS)}, found {found}{again}")
    if obj["cache"] != md.hash:
        raise StatsFileError(f"{path}: cache: expected {md.hash}, found {obj['cache']!r}{again}")
    digest = manifest_digest(shards)
    if obj["manifest_xxh3_128"] != digest:
        raise StatsFileError(
            f"{path}: manifest_xxh3_128: expected {digest} (of {manifest_file(shards)}), "
            f"found {obj['manifest_xxh3_128']!r}: computed for other data{again}"
        )
    found_digest = xxhash.xxh3_128_hexdigest(pretty_json(obj["stats"]))
    if obj["stats_xxh3_128"] != found_digest:
        raise StatsFileError(
            f"{path}: stats_xxh3_128: expected {obj['stats_xxh3_128']!r}, found {found_digest}: damaged{again}"
        )
    return parse_stats(obj["stats"], md.layers, md.d_model, str(path), md.n_examples * md.tokens_per_ex)
