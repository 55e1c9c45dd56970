"""The one place requests reach a server: obstore (the ``[remote]`` extra), its retries, our errors.

Why obstore (docs/remote.md has the figures): its requests run in Rust with the GIL released,
so many ranged reads are in flight from a handful of Python threads; it does multipart
uploads with parts in parallel; it retries dropped connections, truncated bodies, throttling
(503 SlowDown) and other 5xx answers with exponential backoff and jitter; it reads the
standard AWS variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_REGION``, web
identity, container and instance roles); and it is one wheel with no dependencies.

What it does not do, this layer adds: it never checks what a server sends (a body cut short
but announced as complete, a flipped byte), so `files` checks every block against the
manifest's digests; and its errors are turned into ours, one line each: missing or rejected
credentials (`RemoteCredentialsError`), a missing bucket (`RemoteBucketError`), another
region (`RemoteRegionError`), a denied request (`RemoteAccessDeniedError`).
"""

from __future__ import annotations

import datetime
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
)
from ..optional import require
from .url import join_url, scheme, strip

#: Requests in flight per process (ranged reads, uploaded parts); override with this variable.
REQUESTS_ENV = "SAEV_SHARDS_REMOTE_REQUESTS"
DEFAULT_REQUESTS = 16
#: Retries of one request (connection errors, dropped or truncated bodies, 5xx, 503 SlowDown).
RETRIES_ENV = "SAEV_SHARDS_REMOTE_RETRIES"
DEFAULT_RETRIES = 8
#: The first wait before a retry; each next one doubles, with jitter, up to `MAX_BACKOFF`.
FIRST_BACKOFF = datetime.timedelta(milliseconds=100)
MAX_BACKOFF = datetime.timedelta(seconds=10)
#: No retry starts later than this after the request was first sent.
RETRY_TIMEOUT = datetime.timedelta(minutes=2)
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
        self.root = strip(root)
        self._store: Any = None
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
        if self._store is None or self._pid != os.getpid():
            self._store = self._make_store()
            self._pid = os.getpid()
        return self._store

    def _make_store(self) -> Any:
        _obstore()
        from obstore.store import HTTPStore, S3Store, from_url

        retries = _positive_env(RETRIES_ENV, DEFAULT_RETRIES)
        retry: Any = {
            "max_retries": retries,
            "backoff": {"init_backoff": FIRST_BACKOFF, "max_backoff": MAX_BACKOFF, "base": 2},
            "retry_timeout": RETRY_TIMEOUT,
        }
        kind = scheme(self.root)
        try:
            if kind in ("s3", "s3a"):
                bucket, _, prefix = self.root.split("://", 1)[1].partition("/")
                endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
                options: Any = {"allow_http": True} if endpoint.startswith("http://") else None
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
                return HTTPStore.from_url(self.root, client_options={"allow_http": kind == "http"}, retry_config=retry)
            return from_url(self.root, retry_config=retry)
        except Exception as err:  # a configuration obstore refuses (a bad variable, a bad URL)
            raise RemoteError(f"{self.root}: cannot use this location: {_first_line(str(err))}") from None

    # -- requests ----------------------------------------------------------------------------
    def call(self, what: str, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(store, key, *args, **kwargs)`` with obstore's errors turned into ours."""
        try:
            return fn(self.store, name, *args, **kwargs)
        except Exception as err:
            raise self.error(err, what, name) from None

    def error(self, err: Exception, what: str, name: str) -> Exception:
        """Ours for an error obstore raised (others are returned as they are)."""
        if isinstance(err, FileNotFoundError) and not isinstance(err, RemoteError):
            return _not_found(err, self, name)
        if not _is_obstore_error(err):
            return err
        return remote_error(err, self, what, name)

    def stream(self, name: str, start: int = 0, chunk: int = PART_BYTES, end: int | None = None) -> Iterator[Any]:
        """The bytes of ``name`` from ``start`` on (to ``end``, else to its end), in pieces of
        about ``chunk`` bytes, in order (one request; an error while the body comes is raised
        as ours, as the request's)."""
        ob = _obstore()
        options: Any = None
        if end is not None:
            options = {"range": (start, end)}
        elif start:
            options = {"range": {"offset": start}}
        result = self.call("read", name, ob.get, options=options)
        pieces = iter(result.stream(min_chunk_size=chunk))
        while True:
            try:
                piece = next(pieces)
            except StopIteration:
                return
            except Exception as err:
                raise self.error(err, "read", name) from None
            yield piece

    def get_range(self, name: str, start: int, end: int) -> Any:
        """Bytes ``[start, end)`` of ``name`` (a buffer; not checked: `files` checks them)."""
        ob = _obstore()
        return self.call("read", name, ob.get_range, start=start, end=end)

    def read_into(self, name: str, start: int, view: memoryview) -> int:
        """Bytes ``[start, start + len(view))`` of ``name`` copied into ``view`` as they arrive
        (not checked: `files` checks them). Returns how many bytes the server sent: fewer than
        asked for when its body was short; one more than asked for, with ``view`` full, when it
        sent more (the rest is not read)."""
        got = 0
        for piece in self.stream(name, start, READ_PIECE, start + view.nbytes):
            data = memoryview(piece)
            if got + data.nbytes > view.nbytes:
                view[got:] = data[: view.nbytes - got]
                return view.nbytes + 1
            view[got : got + data.nbytes] = data
            got += data.nbytes
        return got

    def get_bytes(self, name: str, max_bytes: int) -> bytes:
        """The whole of ``name`` when it is at most ``max_bytes`` long (`JSONFileError` otherwise,
        before its body is read); `FileNotFoundError` when it does not exist."""
        ob = _obstore()
        result = self.call("read", name, ob.get)
        size = int(result.meta["size"])
        if size > max_bytes:
            raise JSONFileError(f"{self.url(name)}: expected at most {max_bytes:,} bytes, found {size:,}")
        data = bytes(self.call("read", name, lambda _s, _k: result.bytes()))
        if len(data) > max_bytes:
            raise JSONFileError(f"{self.url(name)}: expected at most {max_bytes:,} bytes, found more")
        return data

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
