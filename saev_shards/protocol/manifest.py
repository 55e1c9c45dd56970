"""The manifest of a cache's data files, as frozen types (protocol.md sections 2.2 and 9).

Each protocol version parses its own files into these (`saev_shards.protocol`); the rest
of the library works on `Manifest`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, overload


class ShardEntry(NamedTuple):
    """One activation shard: ``acts<06d>.bin`` with its example count, size and digest.

    A NamedTuple, not a dataclass: caches have up to 10^6 of these, built on every open.
    """

    name: str
    n_examples: int
    nbytes: int
    xxh3_128: str | None  # None only in a protocol 2.1 cache without checksums.json


class ShardList(Sequence[ShardEntry]):
    """The shards of a manifest, held as four columns; a `ShardEntry` is built when indexed.

    Opening a cache of 10^4 shards then creates no per-shard object at all.
    """

    __slots__ = ("counts", "digests", "names", "sizes")

    def __init__(self, names: list[str], counts: list[int], sizes: list[int], digests: Sequence[str | None]) -> None:
        self.names = names
        self.counts = counts
        self.sizes = sizes
        self.digests = list(digests)

    @classmethod
    def of(cls, entries: Iterable[ShardEntry]) -> ShardList:
        rows = list(entries)
        return cls(
            [e.name for e in rows], [e.n_examples for e in rows], [e.nbytes for e in rows], [e.xxh3_128 for e in rows]
        )

    def __len__(self) -> int:
        return len(self.names)

    @overload
    def __getitem__(self, i: int) -> ShardEntry: ...
    @overload
    def __getitem__(self, i: slice) -> list[ShardEntry]: ...
    def __getitem__(self, i: int | slice) -> ShardEntry | list[ShardEntry]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return ShardEntry(self.names[i], self.counts[i], self.sizes[i], self.digests[i])

    def __iter__(self) -> Iterator[ShardEntry]:
        return map(ShardEntry, self.names, self.counts, self.sizes, self.digests)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ShardList):
            return (self.names, self.counts, self.sizes, self.digests) == (
                other.names, other.counts, other.sizes, other.digests
            )  # fmt: skip
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ShardList({len(self)} shards)"

    def __reduce__(self) -> tuple[Any, ...]:
        return (ShardList, (self.names, self.counts, self.sizes, self.digests))


@dataclasses.dataclass(frozen=True)
class ArrayEntry:
    """A raw C-order array file (labels or a per-example column)."""

    name: str
    dtype: str  # numpy dtype.str, e.g. "|u1", "<i4"
    shape: tuple[int, ...]
    nbytes: int
    xxh3_128: str | None


@dataclasses.dataclass(frozen=True)
class TextEntry:
    """A JSON Lines file with one line per example."""

    name: str
    n_lines: int
    nbytes: int
    xxh3_128: str


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """A plain file with a size and a digest (the statistics file)."""

    name: str
    nbytes: int
    xxh3_128: str


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Everything a cache's manifest records (shards.json, and for 2.1 its checksums.json).

    ``empty_shards``: protocol 2.1 only, the all-zero full-size shard files with
    ``n_examples`` 0 that saev's writer leaves after the last one when the examples fill it
    exactly (protocol.md 9); they hold no example, but saev's readers expect them.
    ``scales``: protocol 3.1 float8_e4m3 caches only, the scale file of each shard
    (``scales<06d>.bin``; its ``n_examples`` are the shard's). ``blocks``: protocol 3.1 only,
    blocks.json, the digest of every block of every other listed file.
    """

    shards: ShardList
    labels: ArrayEntry | None = None
    # Plain dicts (picklable, for DataLoader workers); treat them as read-only.
    columns: Mapping[str, ArrayEntry] = dataclasses.field(default_factory=dict)
    text: Mapping[str, TextEntry] = dataclasses.field(default_factory=dict)
    stats: FileEntry | None = None
    empty_shards: ShardList = dataclasses.field(default_factory=lambda: ShardList([], [], [], []))
    scales: ShardList | None = None
    blocks: FileEntry | None = None

    def __post_init__(self) -> None:
        for field in ("shards", "empty_shards", "scales"):
            given: object = getattr(self, field)  # any sequence of ShardEntry is accepted
            if given is not None and not isinstance(given, ShardList):
                object.__setattr__(self, field, ShardList.of(given))  # type: ignore[arg-type]

    def files(self) -> list[tuple[str, int, str | None]]:
        """``(name, nbytes, xxh3_128)`` of every listed file: shards, empty shards, scale files,
        the others, then blocks.json."""
        rows = self.blocked_files()
        if self.blocks is not None:
            rows.append((self.blocks.name, self.blocks.nbytes, self.blocks.xxh3_128))
        return rows

    def blocked_files(self) -> list[tuple[str, int, str | None]]:
        """`files` without blocks.json: the files blocks.json holds digests of (protocol 3.1)."""
        rows: list[tuple[str, int, str | None]] = []
        for shards in (self.shards, self.empty_shards, self.scales):
            if shards is not None:
                rows.extend(zip(shards.names, shards.sizes, shards.digests, strict=True))
        return rows + self.other_files()

    def other_files(self) -> list[tuple[str, int, str | None]]:
        """``(name, nbytes, xxh3_128)`` of the data files that are not shards, scales or blocks.json."""
        out: list[tuple[str, int, str | None]] = []
        if self.labels is not None:
            out.append((self.labels.name, self.labels.nbytes, self.labels.xxh3_128))
        out.extend((c.name, c.nbytes, c.xxh3_128) for c in self.columns.values())
        out.extend((t.name, t.nbytes, t.xxh3_128) for t in self.text.values())
        if self.stats is not None:
            out.append((self.stats.name, self.stats.nbytes, self.stats.xxh3_128))
        return out


@dataclasses.dataclass(frozen=True)
class BlockDigests:
    """blocks.json (protocol 3.1): the xxh3_128 digest of every ``block_size`` bytes of every
    listed file; block ``i`` of a file covers bytes ``[i * block_size, (i + 1) * block_size)``
    (the last one ends with the file)."""

    block_size: int
    # Plain dict: file name -> digests of its blocks in order ([] for an empty file).
    files: Mapping[str, Sequence[str]]

    def span(self, index: int, nbytes: int) -> tuple[int, int]:
        """``(first, last)`` byte of block ``index`` of a file of ``nbytes`` bytes (inclusive)."""
        first = index * self.block_size
        return first, min(first + self.block_size, nbytes) - 1


#: The earlier name of `BlockDigests` ("blocks" alone also names the loaders' read spans and a
#: model's transformer blocks).
Blocks = BlockDigests
