"""Every error saev_shards raises on purpose.

The base class subclasses `ValueError`, and the "not found" kinds also subclass
`FileNotFoundError`, so callers' existing ``except`` clauses keep working.

`open()` and `Shards.verify()` collect every problem they find before raising. When
all problems are of one kind, that kind is raised; when they are of several kinds,
`InvalidCacheError` is raised. Either way `.problems` lists them, grouped by kind, and
the message names every file involved by its absolute path.

Every check that can find several problems (metadata, the manifest parsers, stats.json,
the dump configuration) gathers them in one `Problems` and raises once with all of them.
"""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Iterable, Sequence


class ShardsError(ValueError):
    """Raised for anything saev_shards rejects; the base of every error here."""


class MetadataError(ShardsError):
    """Raised when metadata (a `Metadata` argument or `metadata.json`) is malformed."""


class ProtocolVersionError(MetadataError):
    """Raised when a cache declares a protocol version this library cannot read."""


class DtypeError(MetadataError):
    """Raised when a dtype is not one the protocol allows (`Metadata` and `parse_metadata`,
    when the dtype is the only field that is wrong; several problems raise `MetadataError`)."""


class JSONFileError(ShardsError):
    """Raised when a JSON file breaks the strict rules every JSON file of a cache follows (protocol.md 7):
    not UTF-8, not JSON, NaN or Infinity, a repeated key, nested too deep, an integer beyond 64 bits, too large."""


class NotRegularFileError(ShardsError):
    """Raised when a file a cache must hold is a directory, a symbolic link, a FIFO, a device or a socket."""


class LayerIndexError(ShardsError, IndexError):
    """Raised when an index along the layer axis of ``shards[...]`` (a position, ``0..L-1``) is
    out of range but is one of the recorded layer values; the message says how to select by value."""


class NameNotFoundError(ShardsError, KeyError):
    """Raised when a layer value, a column or a text field the cache does not have is asked
    for; the message lists what it has."""

    def __str__(self) -> str:  # KeyError would show the message in quotes
        return str(self.args[0]) if self.args else ""


class DtypeRangeError(ShardsError):
    """Raised when dequantized float8_e4m3 values do not fit the float dtype asked for
    (float16 holds at most 65504): read them as float32 or bfloat16 instead."""


class WriterError(ShardsError):
    """Raised when a `ShardWriter` is used wrongly (shapes, counts, order, state)."""


class NonFiniteError(WriterError):
    """Raised when values are not finite after the cast to the stored dtype."""


class AlreadyPublishedError(WriterError, FileExistsError):
    """Raised when writing a cache whose hash is already published in the root."""


class WriterBusyError(WriterError):
    """Raised when another live process already writes the same shards."""


class Problem:
    """One problem found: its kind (the error class it is reported as) and its message.

    Problems of the ``expected X, found Y`` form also keep their parts: ``field`` (where it
    is: a key, a dotted path in a file, a file), ``expected`` and ``found``; the message is
    always the full text shown to the user.
    """

    __slots__ = ("expected", "field", "found", "kind", "message")

    def __init__(
        self,
        kind: type[ShardsError],
        message: str,
        *,
        field: str | None = None,
        expected: str | None = None,
        found: str | None = None,
    ) -> None:
        self.kind = kind
        self.message = message
        self.field = field
        self.expected = expected
        self.found = found

    def __repr__(self) -> str:
        return f"Problem({self.kind.__name__}, {self.message!r})"


class Problems:
    """The one problem collector: every problem found in a file, a value or a configuration,
    gathered before anything is raised, then raised once with all of them listed.

    ``kind`` is the error class each problem is reported as (`add` may name another);
    ``prefix`` starts every message (e.g. a file's absolute path and ``": "``).

    As a context manager it raises on a clean exit when anything was collected::

        with Problems(ConfigError, head=f"{where}: ") as problems:
            problems.expected("layers", "a list of integers", repr(value))

    raises ``ConfigError("<where>: layers: expected a list of integers, found ...")``.
    `raise_if_any` tells how the problems are joined into one error.
    """

    def __init__(
        self,
        kind: type[ShardsError],
        prefix: str = "",
        *,
        head: str | None = None,
        sep: str = "; ",
        path: str | None = None,
    ) -> None:
        self.kind = kind
        self.prefix = prefix
        self.head = head
        self.sep = sep
        self.path = path
        self.problems: list[Problem] = []

    def add(self, message: str, kind: type[ShardsError] | None = None, *, field: str | None = None) -> None:
        """One problem, worded by the caller (``prefix`` is put before it)."""
        self.problems.append(Problem(kind or self.kind, self.prefix + message, field=field))

    def expected(self, field: str, expected: str, found: str, kind: type[ShardsError] | None = None) -> None:
        """The house form: ``"<field>: expected <expected>, found <found>"``."""
        message = f"{self.prefix}{field}: expected {expected}, found {found}"
        self.problems.append(Problem(kind or self.kind, message, field=field, expected=expected, found=found))

    def extend(self, problems: Iterable[Problem]) -> None:
        self.problems.extend(problems)

    def messages(self) -> list[str]:
        return [p.message for p in self.problems]

    def __bool__(self) -> bool:
        return bool(self.problems)

    def __len__(self) -> int:
        return len(self.problems)

    def raise_if_any(self, head: str | None = None, *, limit: int | None = None) -> None:
        """Raise every problem collected as one error; nothing when there is none.

        With a ``head`` (here or given to the constructor) the error is ``kind(head +
        sep.join(messages))``, the first ``limit`` messages when a limit is given. Without one,
        problems of the cache kinds (`InvalidCacheError`) are raised by `raise_problems`:
        grouped by kind, with ``.problems`` listing each; other kinds get the messages joined.
        """
        if not self.problems:
            return
        head = self.head if head is None else head
        if head is None and all(issubclass(p.kind, InvalidCacheError) for p in self.problems):
            raise_problems(self.problems, self.path)
        messages = self.messages()[:limit]
        kinds = {p.kind for p in self.problems}
        cls = kinds.pop() if len(kinds) == 1 else self.kind
        raise cls((head or "") + self.sep.join(messages))

    def __enter__(self) -> Problems:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.raise_if_any()


#: The name used before the collector served every kind of error.
ProblemCollector = Problems


class InvalidCacheError(ShardsError):
    """Raised when a cache on disk breaks the protocol; `.problems` lists every problem."""

    #: Heading used when problems of this kind are listed.
    title = "invalid cache"

    def __init__(self, problems: str | Sequence[Problem], path: str | None = None) -> None:
        if isinstance(problems, str):
            problems = [Problem(type(self), problems)]
        self.problems: list[Problem] = list(problems)
        self.path = path
        super().__init__(_format(self.problems, path))


class CacheNotFoundError(InvalidCacheError, FileNotFoundError):
    """Raised when a cache directory, or a file it must contain, does not exist."""

    title = "missing"


class MetadataFileError(InvalidCacheError, MetadataError):
    """Raised when `metadata.json` is missing keys, has unknown keys or bad values."""

    title = "metadata.json"


class ManifestError(InvalidCacheError):
    """Raised when `shards.json` is malformed or disagrees with `metadata.json`."""

    title = "shards.json"


class HashMismatchError(InvalidCacheError):
    """Raised when the directory name is not the hash of its `metadata.json`."""

    title = "hash"


class FileSizeError(InvalidCacheError):
    """Raised when a data file is not exactly as long as the manifest says."""

    title = "size"


class ChecksumMismatchError(InvalidCacheError):
    """Raised when a data file's xxh3_128 digest differs from the manifest."""

    title = "checksum"


class StatsFileError(InvalidCacheError):
    """Raised when `stats.json` does not follow its schema (protocol.md 2.6) or is not readable JSON."""

    title = "stats.json"


class UnexpectedFileError(InvalidCacheError):
    """Raised when a cache holds a data file its manifest does not list."""

    title = "unexpected file"


class ScaleError(InvalidCacheError):
    """Raised when a float8_e4m3 scale file holds a scale the scale rule cannot give (protocol.md
    5): inf, a negative number, one above the largest float32 over 448, or a NaN other than
    that of a vector stored as NaN; names the shard and the vector."""

    title = "scales"


class LoaderError(ShardsError):
    """Raised when a loader or dataset is configured in a way the cache cannot serve."""


class ConfigError(ShardsError):
    """Raised when a dump configuration is malformed; the message lists every problem."""


class DumpError(ShardsError):
    """Raised when a dump fails after its checks passed: the model or its tokenizer raised on a batch."""


class TokenizerError(ShardsError):
    """Raised when the tokenizer of a dumped cache's model cannot be found on this machine, or a
    folder offered for it does not hold the dumped model's files (`saev_shards.dump.load_tokenizer`)."""


class RecorderError(ShardsError):
    """Raised when blocks cannot be found or a hooked block's output cannot be recorded."""


class ConvertError(ShardsError):
    """Raised when a source cannot be converted into a cache: malformed, inconsistent or unsupported."""


class ConvertOptionError(ConvertError):
    """Raised when convert's options do not fit the source (or its kind cannot be detected)."""


class SourceNotFoundError(ConvertError, FileNotFoundError):
    """Raised when a conversion source, or a file its index names, does not exist."""


class SourceChecksumError(ConvertError):
    """Raised when a source file's size or checksum differs from what the source's own index records."""


class UnsafePickleError(ConvertError):
    """Raised when a pickle asks for anything but numpy arrays, dtypes and plain containers."""


class MissingDependencyError(ShardsError, ImportError):
    """Raised when an optional dependency is needed but not installed; the message names the extra."""


class ShuffleError(ShardsError):
    """Raised when a shuffle is configured wrongly or its scratch files cannot be used."""


class RootNotSetError(ShardsError):
    """Raised when a shards or runs root is needed but neither given nor set in the environment."""


class CacheRefError(ShardsError):
    """Raised when a cache reference (a path, hash or hash prefix) is malformed, e.g. too short."""


class AmbiguousPrefixError(CacheRefError):
    """Raised when a hash prefix matches several caches; `.candidates` lists their paths."""

    def __init__(self, message: str, candidates: Sequence[str] = ()) -> None:
        self.candidates = list(candidates)
        super().__init__(message)


class UnknownCacheError(CacheNotFoundError, CacheRefError):
    """Raised when a path, hash or hash prefix names no cache in the shards roots."""


class CacheInUseError(ShardsError):
    """Raised when removing a cache that other processes use (they hold its lock, or have its
    files open or mapped), or an unpublished folder whose writer holds its lock; `.holders`
    names the processes where the system says (`saev_shards.store.inuse.Holder`)."""

    def __init__(self, message: str, holders: Sequence[object] = ()) -> None:
        self.holders = list(holders)
        super().__init__(message)


class RemoteError(ShardsError):
    """Raised when an object store or HTTP server refuses a request or fails after every retry."""


class RemoteCredentialsError(RemoteError):
    """Raised when a remote request needs credentials and none are configured, or they are rejected."""


class RemoteBucketError(RemoteError, FileNotFoundError):
    """Raised when the bucket (or container) a remote URL names does not exist."""


class RemoteRegionError(RemoteError):
    """Raised when a bucket lives in another region than the one configured."""


class RemoteAccessDeniedError(RemoteError, PermissionError):
    """Raised when the credentials are valid but the request is denied (403)."""


class RemoteTimeoutError(RemoteError, TimeoutError):
    """Raised when a remote read does not arrive within ``$SAEV_SHARDS_REMOTE_TIMEOUT`` (docs/remote.md)."""


class BlockCacheError(ShardsError):
    """Raised when the block cache cannot be used as configured: ``$SAEV_SHARDS_BLOCK_CACHE_BYTES``
    is not a size, or its folder belongs to another user and is not shared with a group on
    purpose (docs/remote.md)."""


class RunError(ShardsError):
    """Raised when a run folder cannot be created or is not a run folder."""


class RunNotFoundError(RunError, FileNotFoundError):
    """Raised when a run path or run id names no run folder."""


class RunExistsError(RunError, FileExistsError):
    """Raised when creating a run whose folder already exists."""


class ProtocolWarning(UserWarning):
    """Warned when a cache of an older major protocol version is read (protocol.md 8), and when
    a cache for saev is written where saev's own code will not look for it (protocol.md 9)."""


class CommandError(ShardsError):
    """Raised by a command of the command line with its own verdict (a removal not confirmed, a
    bad option): `saev_shards.cli.main` prints the message as an error and exits with ``code``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class SlowPathWarning(UserWarning):
    """Issued once per process when work runs on a slower path than an optional dependency would
    give: float8_e4m3 dequantized with numpy because numba (the ``fast`` extra) is not installed."""


class RunWarning(UserWarning):
    """Issued when a run is created from caches training may not expect: a val cache that is the
    train cache, or differs from it in model, layers, width, tokens or dtype."""


def _format(problems: Sequence[Problem], path: str | None) -> str:
    if not problems:
        return "no problems"
    if len(problems) == 1:
        return problems[0].message  # every message names its file by absolute path
    head = f"{path}: " if path else ""
    groups: dict[str, list[str]] = {}
    for p in problems:
        groups.setdefault(getattr(p.kind, "title", p.kind.__name__), []).append(p.message)
    lines = [f"{head}{len(problems)} problems"]
    for title, messages in groups.items():
        lines.append(f"  {title} ({len(messages)}):")
        lines.extend(f"    - {m}" for m in messages[:MAX_LISTED])
        if len(messages) > MAX_LISTED:
            lines.append(f"    - ... and {len(messages) - MAX_LISTED} more (all of them in .problems)")
    return "\n".join(lines)


#: Problems of one kind shown in a message (a damaged manifest of 10^6 shards has 10^6).
MAX_LISTED = 20


def raise_problems(problems: Iterable[Problem], path: str | None = None) -> None:
    """Raise the collected problems, if any, as one error (see the module docstring)."""
    found = sorted(problems, key=lambda p: (_KIND_ORDER.get(p.kind, 99), p.kind.__name__))
    if not found:
        return
    kinds = {p.kind for p in found}
    kind = kinds.pop() if len(kinds) == 1 else InvalidCacheError
    cls = kind if issubclass(kind, InvalidCacheError) else InvalidCacheError
    raise cls(found, path)


_KIND_ORDER: dict[type[ShardsError], int] = {
    CacheNotFoundError: 0,
    MetadataFileError: 1,
    HashMismatchError: 2,
    ManifestError: 3,
    UnexpectedFileError: 4,
    FileSizeError: 5,
    ChecksumMismatchError: 6,
    StatsFileError: 7,
}


class DiskFullError(ShardsError, OSError):
    """Raised when a file cannot be written for lack of space (ENOSPC, EDQUOT), or when a
    dump or a stage would not fit; names the file or folder and the bytes needed and free.

    Also an `OSError` with ``errno`` ENOSPC (or EDQUOT) and ``filename`` set, so handlers of
    the system error keep working.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        needed: int | None = None,
        free: int | None = None,
        err_no: int = errno.ENOSPC,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.errno = err_no
        self.strerror = os.strerror(err_no)
        self.filename = path
        self.needed = needed
        self.free = free

    def __str__(self) -> str:
        return self.message  # OSError's "[Errno 28] ..." form would hide the message

    def __reduce__(self) -> tuple[object, tuple[str]]:  # errno and filename survive pickling
        fields = {"path": self.filename, "needed": self.needed, "free": self.free, "err_no": self.errno}
        return functools.partial(DiskFullError, **fields), (self.message,)
