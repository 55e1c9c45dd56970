"""The one place requests reach a server: obstore (the ``[remote]`` extra), its retries, our errors.

Why obstore (docs/remote.md has the figures): its requests run in Rust with the GIL released,
so many ranged reads are in flight from a handful of Python threads; it does multipart
uploads with parts in parallel; it retries dropped connections, truncated bodies, throttling
(503 SlowDown) and other 5xx answers with exponential backoff and jitter; it reads the
standard AWS variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_REGION``, web
identity, container and instance roles); and it is one wheel with no dependencies.

What it does not do, this layer adds: it never checks what a server sends (a body cut short
but announced as complete, a flipped byte), so `units` checks every block against the
manifest's digests; and its errors are turned into ours, one line each: missing or rejected
credentials (`RemoteCredentialsError`), a missing bucket (`RemoteBucketError`), another
region (`RemoteRegionError`), a denied request (`RemoteAccessDeniedError`).
"""

from __future__ import annotations

import datetime
import math
import os
import re
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ..errors import (
    JSONFileError,
    RemoteAccessDeniedError,
    RemoteBucketError,
    RemoteCredentialsError,
    RemoteError,
    RemoteRegionError,
    RemoteTimeoutError,
)
from ..optional import require
from .url import check_url, join_url, scheme, strip

#: Requests in flight per process (ranged reads, uploaded parts); override with this variable.
REQUESTS_ENV = "SAEV_SHARDS_REMOTE_REQUESTS"
DEFAULT_REQUESTS = 16
#: Retries of one request (connection errors, dropped or truncated bodies, 5xx, 503 SlowDown).
RETRIES_ENV = "SAEV_SHARDS_REMOTE_RETRIES"
DEFAULT_RETRIES = 8
#: The first wait before a retry; each next one doubles, with jitter, up to `MAX_BACKOFF`.
FIRST_BACKOFF = datetime.timedelta(milliseconds=100)
MAX_BACKOFF = datetime.timedelta(seconds=10)
#: Seconds a request may take, from connecting to its body's last byte, per `TIMEOUT_BYTES` it
#: asks for (rounded up to a power of two of them, at least one): ``$SAEV_SHARDS_REMOTE_TIMEOUT``.
#: A unit of a read (`units`) gets as long in all, every fetch and wait included.
TIMEOUT_ENV = "SAEV_SHARDS_REMOTE_TIMEOUT"
DEFAULT_TIMEOUT = 30.0
TIMEOUT_BYTES = 16 << 20
#: The client's own retries of a request start no later than this many of its timeouts after
#: its first try (2 minutes for a request of up to 16 MiB, by default).
RETRY_TIMEOUTS = 4
#: Size of one uploaded part (and of one piece of a whole-file download).
PART_BYTES = 16 << 20
#: Pieces of a ranged read copied into the caller's buffer (`Client.read_into`): small enough
#: that obstore's pieces come from memory its allocator hands out again at once (a 16 MiB
#: response buffer of its own is fresh memory, and first touches cost more than the copy),
#: large enough that the Python loop over them costs nothing measurable.
READ_PIECE = 256 << 10

T = TypeVar("T")


def requests_in_flight() -> int:
    """Requests one process keeps in flight: ``$SAEV_SHARDS_REMOTE_REQUESTS``, else 16."""
    return _positive_env(REQUESTS_ENV, DEFAULT_REQUESTS)


def timeout() -> float:
    """``$SAEV_SHARDS_REMOTE_TIMEOUT`` (seconds per 16 MiB asked for), else 30; `RemoteError`
    naming the variable for anything but a number of seconds > 0."""
    value = os.environ.get(TIMEOUT_ENV, "")
    if not value.strip():
        return DEFAULT_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise RemoteError(f"${TIMEOUT_ENV}: expected a number of seconds > 0, found {value!r:.40}")
    return seconds


def _multiple(nbytes: int) -> int:
    """How many timeouts a request of ``nbytes`` gets: a power of two, at least 1."""
    need = max(1, -(-nbytes // TIMEOUT_BYTES))
    return 1 << (need - 1).bit_length()


def allowance(nbytes: int) -> float:
    """Seconds a request of ``nbytes`` may take, and a unit of that many bytes in all."""
    return timeout() * _multiple(nbytes)


def _positive_env(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        return max(0 if name == RETRIES_ENV else 1, int(value)) if value else default
    except ValueError:
        raise RemoteError(f"${name}: expected an integer, found {value!r}") from None


def _obstore() -> Any:
    return require("obstore", "remote", "reading and writing caches in object stores")


class Client:
    """Requests to one remote root (a bucket and prefix, or an HTTP base URL), from this process.

    Pickles as its URL: a process that unpickles it builds its own connection pool.
    """

    def __init__(self, root: str) -> None:
        self.root = strip(check_url(root))
        self._stores: dict[int, Any] = {}
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        return {"root": self.root}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["root"])  # type: ignore[misc]

    def url(self, name: str = "") -> str:
        return join_url(self.root, name)

    @property
    def can_list(self) -> bool:
        """Whether the server lists its objects (object stores do; plain HTTP servers do not)."""
        return scheme(self.root) not in ("http", "https")

    @property
    def store(self) -> Any:
        """The store for requests of up to `TIMEOUT_BYTES` (JSON files, listings, parts)."""
        return self.store_for(0)

    def store_for(self, nbytes: int) -> Any:
        """The store whose requests may take `allowance` ``(nbytes)`` (one per power of two of
        `TIMEOUT_BYTES`, each with its own connections)."""
        if self._pid != os.getpid():
            self._stores = {}
            self._pid = os.getpid()
        m = _multiple(nbytes)
        store = self._stores.get(m)
        if store is None:
            store = self._stores[m] = self._make_store(timeout() * m)
        return store

    def _make_store(self, seconds: float) -> Any:
        _obstore()
        from obstore.store import HTTPStore, S3Store, from_url

        retries = _positive_env(RETRIES_ENV, DEFAULT_RETRIES)
        retry: Any = {
            "max_retries": retries,
            "backoff": {"init_backoff": FIRST_BACKOFF, "max_backoff": MAX_BACKOFF, "base": 2},
            "retry_timeout": datetime.timedelta(seconds=seconds * RETRY_TIMEOUTS),
        }
        limit: Any = {"timeout": datetime.timedelta(seconds=seconds)}
        kind = scheme(self.root)
        try:
            if kind in ("s3", "s3a"):
                bucket, _, prefix = self.root.split("://", 1)[1].partition("/")
                endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
                options: Any = {**limit, "allow_http": True} if endpoint.startswith("http://") else limit
                region: Any = {} if _env_region() else {"region": "us-east-1"}  # S3's default, as the AWS CLI
                return S3Store(
                    bucket,
                    prefix=prefix or None,
                    client_options=options,
                    retry_config=retry,
                    credential_provider=_profile_credentials(),
                    **region,
                )
            if kind in ("http", "https"):
                http: Any = {**limit, "allow_http": kind == "http"}
                return HTTPStore.from_url(self.root, client_options=http, retry_config=retry)
            return from_url(self.root, client_options=limit, retry_config=retry)
        except Exception as err:  # a configuration obstore refuses (a bad variable, a bad URL)
            raise RemoteError(f"{self.root}: cannot use this location: {_first_line(str(err))}") from None

    # -- requests ----------------------------------------------------------------------------
    def call(self, what: str, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(store, key, *args, **kwargs)`` with obstore's errors turned into ours."""
        return self.call_sized(0, what, name, fn, *args, **kwargs)

    def call_sized(self, nbytes: int, what: str, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`call` for a request of ``nbytes`` (its time allowed grows with it: `allowance`)."""
        try:
            return fn(self.store_for(nbytes), name, *args, **kwargs)
        except Exception as err:
            raise self.error(err, what, name) from None

    def error(self, err: Exception, what: str, name: str) -> Exception:
        """Ours for an error obstore raised (others are returned as they are)."""
        if isinstance(err, FileNotFoundError) and not isinstance(err, RemoteError):
            return _not_found(err, self, name)
        if not _is_obstore_error(err):
            return err
        return remote_error(err, self, what, name)

    def stream(self, name: str, start: int, end: int, chunk: int = PART_BYTES) -> Iterator[Any]:
        """The bytes ``[start, end)`` of ``name``, in pieces of about ``chunk`` bytes, in order
        (one request; an error while the body comes is raised as ours, as the request's).

        Never more than one byte past ``end``: a server that sends more than it was asked for
        (whatever it announced) gets its body cut there, so the caller sees one byte too many
        and stops, having read ``end - start + 1`` bytes at most."""
        ob = _obstore()
        want = max(0, end - start)
        # An empty range cannot be asked for: the whole object, of which one byte is too many.
        options: Any = {"range": (start, end)} if want else None
        result = self.call_sized(want, "read", name, ob.get, options=options)
        pieces = iter(result.stream(min_chunk_size=chunk))
        left = want + 1
        while left > 0:
            try:
                piece = next(pieces)
            except StopIteration:
                return
            except Exception as err:
                raise self.error(err, "read", name) from None
            view = memoryview(piece)
            if view.nbytes > left:
                view = view[:left]
            left -= view.nbytes
            yield view
        # One byte past the end: the rest of the body is never read (its connection is dropped).

    def get_range(self, name: str, start: int, end: int) -> Any:
        """Bytes ``[start, end)`` of ``name`` as one buffer (the benchmarks' plain ranged read; not
        checked, and unlike `stream` not cut at the size asked for: the reads use `read_into`)."""
        ob = _obstore()
        return self.call_sized(end - start, "read", name, ob.get_range, start=start, end=end)

    def read_into(self, name: str, start: int, view: memoryview, hasher: Any = None) -> int:
        """Bytes ``[start, start + len(view))`` of ``name`` copied into ``view`` as they arrive
        (not checked: `units` checks them), and each piece given to ``hasher.update`` while it
        is still in the processor's cache (the caller's digest of them, without reading the
        whole of ``view`` again). Returns how many bytes the server sent: fewer than asked for
        when its body was short; one more than asked for, with ``view`` full, when it sent more
        (the rest is not read)."""
        got = 0
        for piece in self.stream(name, start, start + view.nbytes, READ_PIECE):
            data = memoryview(piece)
            if got + data.nbytes > view.nbytes:
                view[got:] = data[: view.nbytes - got]
                return view.nbytes + 1
            view[got : got + data.nbytes] = data
            if hasher is not None:
                hasher.update(data)
            got += data.nbytes
        return got

    def get_bytes(self, name: str, max_bytes: int) -> bytes:
        """The whole of ``name`` when it is at most ``max_bytes`` long (`JSONFileError` otherwise:
        before its body is read when its announced size is larger, else once ``max_bytes + 1``
        bytes have come); `FileNotFoundError` when it does not exist."""
        ob = _obstore()
        result = self.call_sized(max_bytes, "read", name, ob.get)
        size = int(result.meta["size"])
        if size > max_bytes:
            raise JSONFileError(f"{self.url(name)}: expected at most {max_bytes:,} bytes, found {size:,}")
        pieces = iter(result.stream(min_chunk_size=min(PART_BYTES, max_bytes + 1)))
        data = bytearray()
        while len(data) <= max_bytes:
            try:
                piece = next(pieces)
            except StopIteration:
                break
            except Exception as err:
                raise self.error(err, "read", name) from None
            data += memoryview(piece)[: max_bytes + 1 - len(data)]
        if len(data) > max_bytes:
            raise JSONFileError(f"{self.url(name)}: expected at most {max_bytes:,} bytes, found more")
        return bytes(data)

    def head(self, name: str) -> int | None:
        """The size of ``name``, None when it does not exist."""
        ob = _obstore()
        try:
            return int(self.call("look up", name, ob.head)["size"])
        except RemoteBucketError:
            raise
        except FileNotFoundError:
            return None

    def list_objects(self, prefix: str = "") -> dict[str, int]:
        """Every object under ``prefix`` (relative names -> sizes), however many pages that takes."""
        ob = _obstore()
        out: dict[str, int] = {}
        for batch in self.call("list", prefix, lambda store, p: list(ob.list(store, p or None))):
            for meta in batch:
                out[meta["path"]] = int(meta["size"])
        return out

    def list_dirs(self, prefix: str = "") -> list[str]:
        """The names of the folders directly under ``prefix`` (one listing, no recursion)."""
        ob = _obstore()
        found = self.call("list", prefix, lambda store, p: ob.list_with_delimiter(store, p or None))
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in found["common_prefixes"])

    def put(self, name: str, data: bytes | Iterator[bytes | memoryview]) -> None:
        """Write ``name`` whole: ``data`` as one request, or an iterator's pieces as a multipart
        upload with parts in parallel. Atomic: the object appears complete or not at all."""
        ob = _obstore()
        self.call(
            "write",
            name,
            ob.put,
            data,
            chunk_size=PART_BYTES,
            max_concurrency=max(2, requests_in_flight() // 2),
        )

    def delete(self, name: str) -> None:
        ob = _obstore()
        try:
            self.call("delete", name, ob.delete)
        except RemoteBucketError:
            raise
        except FileNotFoundError:
            return


def _env_region() -> str:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or ""


def _profile_credentials() -> Any:
    """boto3's credentials for ``$AWS_PROFILE`` (``~/.aws``: profiles, SSO) when no keys are set."""
    if not os.environ.get("AWS_PROFILE") or os.environ.get("AWS_ACCESS_KEY_ID"):
        return None
    boto3 = require("boto3", "remote", f"AWS_PROFILE={os.environ['AWS_PROFILE']} (credentials from ~/.aws)")
    from obstore.auth.boto3 import Boto3CredentialProvider

    return Boto3CredentialProvider(boto3.Session())


def _is_obstore_error(err: BaseException) -> bool:
    return type(err).__module__.startswith("obstore")


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return re.sub(r"\s+", " ", line)[:300]


_CODE_RE = re.compile(r"<Code>([A-Za-z]+)</Code>")
_CREDENTIAL_CODES = (
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
)
_REGION_CODES = ("PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException")


def _not_found(err: Exception, client: Client, name: str) -> Exception:
    if "NoSuchBucket" in str(err):
        return _no_bucket(client)
    return FileNotFoundError(f"{client.url(name)}: no such object")


def _no_bucket(client: Client) -> RemoteBucketError:
    kind, rest = client.root.split("://", 1)
    return RemoteBucketError(
        f"{kind}://{rest.split('/', 1)[0]}: no such bucket (check the URL and AWS_ENDPOINT_URL, or create the bucket)"
    )


def remote_error(err: BaseException, client: Client, what: str, name: str) -> Exception:
    """One of our errors, one line, for an error obstore raised while ``what``-ing ``name``."""
    text = str(err)
    found = _CODE_RE.search(text)
    code = found.group(1) if found else ""
    where = client.url(name)
    kind = type(err).__name__
    if code == "NoSuchBucket":
        return _no_bucket(client)
    if code in _CREDENTIAL_CODES or kind == "UnauthenticatedError":
        return RemoteCredentialsError(
            f"{where}: credentials rejected ({code or 'unauthenticated'}): check AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
        )
    if code in _REGION_CODES or "incorrectly configured region" in text or "x-amz-bucket-region" in text:
        region = _env_region() or "us-east-1 (the default)"
        return RemoteRegionError(
            f"{where}: the bucket is not in region {region}: set AWS_REGION to the bucket's region"
        )
    if "TimedOut" in text or "kind: Timeout" in text or "operation timed out" in text:
        return RemoteTimeoutError(
            f"{where}: {what} timed out: the server did not answer in full within the time allowed "
            f"(${TIMEOUT_ENV}: {timeout():g} s per 16 MiB asked for)"
        )
    if kind == "PermissionDeniedError" or code == "AccessDenied":
        return RemoteAccessDeniedError(f"{where}: access denied: these credentials may not {what} here (403)")
    # No keys in the environment: the client asked the instance-metadata service (EC2's
    # credentials of last resort) and nothing answered.
    if "/latest/api/token" in text or "/latest/meta-data" in text or "credential" in text.lower():
        return RemoteCredentialsError(
            f"{where}: no credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), "
            "or AWS_SKIP_SIGNATURE=true for a public bucket"
        )
    return RemoteError(f"{where}: {what} failed: {_first_line(text)}")
