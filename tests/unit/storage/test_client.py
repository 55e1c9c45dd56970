"""storage.client: the settings read from the environment (refused by name when they are not
numbers), the time a request is allowed, the one-line errors a server's refusals become, and
ranged reads copied into the caller's buffer, never more than one byte past what was asked."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from saev_shards.errors import (
    CacheRefError,
    RemoteAccessDeniedError,
    RemoteBucketError,
    RemoteCredentialsError,
    RemoteError,
    RemoteRegionError,
    RemoteTimeoutError,
)
from saev_shards.storage import client
from saev_shards.storage.client import Client, allowance, remote_error, requests_in_flight, timeout


class Pieces(Client):
    """Answers every read with ``body`` (whatever was asked), in pieces of ``piece`` bytes,
    cut one byte past the end asked for as `Client.stream` cuts a body."""

    def __init__(self, body: bytes, piece: int) -> None:
        super().__init__("s3://bucket/root")
        self.body, self.piece = body, piece

    def stream(self, name: str, start: int, end: int, chunk: int = 0) -> Iterator[Any]:
        body = self.body[: end - start + 1]
        for i in range(0, len(body), self.piece):
            yield body[i : i + self.piece]


def test_requests_in_flight_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(client.REQUESTS_ENV, raising=False)
    assert requests_in_flight() == client.DEFAULT_REQUESTS
    monkeypatch.setenv(client.REQUESTS_ENV, "3")
    assert requests_in_flight() == 3
    monkeypatch.setenv(client.REQUESTS_ENV, "0")
    assert requests_in_flight() == 1  # at least one
    monkeypatch.setenv(client.REQUESTS_ENV, "many")
    with pytest.raises(RemoteError, match=r"^\$SAEV_SHARDS_REMOTE_REQUESTS: expected an integer, found 'many'"):
        requests_in_flight()


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon", "1e999"])
def test_a_timeout_that_is_no_number_of_seconds_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(client.TIMEOUT_ENV, value)
    with pytest.raises(RemoteError, match=r"^\$SAEV_SHARDS_REMOTE_TIMEOUT: expected a number of seconds > 0"):
        timeout()


@given(st.integers(0, 1 << 40), st.sampled_from(["", "2.5", " 30 "]))
def test_a_request_is_allowed_a_power_of_two_of_timeouts(nbytes: int, value: str) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(client.TIMEOUT_ENV, value)
        seconds = float(value) if value.strip() else client.DEFAULT_TIMEOUT
        multiple = allowance(nbytes) / seconds
    assert multiple == int(multiple) and int(multiple).bit_count() == 1
    # Enough timeouts for its bytes, and fewer than twice as many as it needs.
    need = max(1, -(-nbytes // client.TIMEOUT_BYTES))
    assert need <= multiple < 2 * need


def test_a_client_checks_its_root_and_joins_names() -> None:
    c = Client("s3://bucket/root/")
    assert c.root == "s3://bucket/root" and c.url("3f2a/shards.json") == "s3://bucket/root/3f2a/shards.json"
    assert c.can_list and not Client("https://host/p").can_list
    copy = pickle.loads(pickle.dumps(c))
    assert copy.root == c.root and copy._stores == {}
    with pytest.raises(CacheRefError):
        Client("s3://bucket/../root")


@given(st.binary(max_size=40), st.integers(0, 45), st.integers(1, 9))
def test_read_into_copies_what_came_and_says_when_more_came(body: bytes, want: int, piece: int) -> None:
    view = memoryview(bytearray(want))
    hasher = xxhash.xxh3_128()
    got = Pieces(body, piece).read_into("f", 0, view, hasher)
    if len(body) > want:
        assert got == want + 1 and bytes(view) == body[:want]
    else:
        assert got == len(body) and bytes(view[:got]) == body
        # Hashed as it came: the digest of the whole of what was copied.
        assert hasher.hexdigest() == xxhash.xxh3_128_hexdigest(body)


def test_a_missing_object_or_bucket_is_named() -> None:
    c = Client("s3://bucket/root")
    err = c.error(FileNotFoundError("gone"), "read", "x.json")
    assert isinstance(err, FileNotFoundError) and str(err) == "s3://bucket/root/x.json: no such object"
    err = c.error(FileNotFoundError("<Code>NoSuchBucket</Code>"), "read", "x.json")
    assert isinstance(err, RemoteBucketError) and str(err).startswith("s3://bucket: no such bucket")
    other = ValueError("not the server's")
    assert c.error(other, "read", "x") is other  # not obstore's: as it is


class PermissionDeniedError(Exception):
    pass


class UnauthenticatedError(Exception):
    pass


@pytest.mark.parametrize(
    ("err", "kind", "words"),
    [
        (OSError("<Code>NoSuchBucket</Code>"), RemoteBucketError, "s3://bucket: no such bucket"),
        (OSError("<Code>SignatureDoesNotMatch</Code>"), RemoteCredentialsError, "credentials rejected"),
        (UnauthenticatedError("who"), RemoteCredentialsError, "credentials rejected (unauthenticated)"),
        (OSError("<Code>PermanentRedirect</Code>"), RemoteRegionError, "not in region"),
        (OSError("request: operation timed out"), RemoteTimeoutError, "read timed out"),
        (PermissionDeniedError("403"), RemoteAccessDeniedError, "these credentials may not read here"),
        (OSError("<Code>AccessDenied</Code>"), RemoteAccessDeniedError, "access denied"),
        (OSError("GET http://169.254.169.254/latest/api/token"), RemoteCredentialsError, "no credentials found"),
        (OSError("connection reset\n  by peer   \nmore"), RemoteError, "read failed: connection reset"),
    ],
)
def test_a_servers_refusal_is_one_of_ours_in_one_line(err: Exception, kind: type[Exception], words: str) -> None:
    found = remote_error(err, Client("s3://bucket/root"), "read", "x.bin")
    assert type(found) is kind
    assert words in str(found) and "\n" not in str(found)
    if kind is not RemoteBucketError:
        assert str(found).startswith("s3://bucket/root/x.bin: ")
