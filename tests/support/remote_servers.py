"""Servers the remote tests and benchmarks talk to, all on 127.0.0.1 and started by the tests
themselves: moto's S3-compatible server (a real separate process), an HTTP server that
honours Range requests, and a proxy in front of either that injects faults.

Faults (`Faults.add`) fire on the responses to requests whose path contains a given text:

* ``drop``: the headers and half the body, then the connection is reset (RST);
* ``truncate``: the headers announce the whole body, half of it comes, then a clean close;
* ``short``: a shorter body announced and sent as if complete (a server that lies);
* ``corrupt``: the whole body with one byte flipped;
* ``slowdown``: S3's ``503 SlowDown`` throttling answer; ``error500``: ``500 InternalError``;
* ``denied``: ``403 AccessDenied``; ``region``: ``301 PermanentRedirect`` naming another region;
* ``nocreds``: ``403 InvalidAccessKeyId``;
* ``long``: the body, then `Faults.long_bytes` more (zeros, made as they are sent), all
  announced in Content-Length (a server answering an 800-byte file with 256 MiB); the bytes
  of it the client took before dropping the connection are counted in `Faults.extra_sent`;
* ``drip``: the body one byte every `Faults.drip_seconds` (a stalled or throttled link).

Nothing here sends a byte anywhere but 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

#: The S3 error bodies of the faults that answer with an error.
_ERRORS = {
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "error500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "denied": (403, "AccessDenied", "Access Denied"),
    "region": (
        301,
        "PermanentRedirect",
        "The bucket you are attempting to access must be addressed using the specified endpoint.",
    ),
    "nocreds": (403, "InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist in our records."),
}
FAULT_KINDS = ("drop", "truncate", "short", "corrupt", "long", "drip", *_ERRORS)
_BODY_FAULTS = ("drop", "truncate", "short", "corrupt", "long", "drip")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s") from None
            time.sleep(0.05)


class Faults:
    """Fault rules and request counts, shared by a server's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rules: list[list[Any]] = []  # [kind, match, method, times left]
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request
        self.fired: list[tuple[str, str]] = []  # (kind, path) of every fault given
        #: ``long``: bytes sent past the body; how many of them went out before the client hung up.
        self.long_bytes = 256 << 20
        self.extra_sent = 0
        #: ``drip``: seconds between two bytes of the body.
        self.drip_seconds = 0.25

    def count_extra(self, n: int) -> None:
        with self._lock:
            self.extra_sent += n

    def add(self, kind: str, match: str = "", *, times: int = 1, method: str = "GET") -> None:
        """Answer the next ``times`` requests (``-1``: all) whose path contains ``match`` with ``kind``."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault kind: expected one of {FAULT_KINDS}, found {kind!r}")
        with self._lock:
            self._rules.append([kind, match, method, times])

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()
            self.requests.clear()
            self.fired.clear()

    def take(self, method: str, path: str) -> str | None:
        with self._lock:
            self.requests.append((method, path))
            for rule in self._rules:
                kind, match, want, left = rule
                if left != 0 and want == method and match in path:
                    rule[3] = left - 1 if left > 0 else left
                    self.fired.append((kind, path))
                    return str(kind)
        return None

    def count(self, match: str = "", method: str = "GET") -> int:
        with self._lock:
            return sum(1 for m, p in self.requests if m == method and match in p)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: clients hold connections open
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def _respond(self, status: int, headers: list[tuple[str, str]], body: bytes, fault: str | None) -> None:
        if fault in _ERRORS:
            code, name, message = _ERRORS[fault]
            body = (
                f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{name}</Code><Message>{message}</Message>'
                f"<RequestId>test</RequestId></Error>"
            ).encode()
            status = code
            headers = [("Content-Type", "application/xml")]
            if fault == "region":
                headers.append(("x-amz-bucket-region", "eu-west-3"))
        elif fault == "corrupt" and body:
            flipped = bytearray(body)
            flipped[len(body) // 2] ^= 0x5A
            body = bytes(flipped)
        elif fault == "short" and len(body) > 1:
            body = body[: len(body) // 2]
        length = str(len(body) + (self.server.faults.long_bytes if fault == "long" else 0))
        if self.command == "HEAD":  # a HEAD answer announces the length of what a GET would send
            length = next((v for k, v in headers if k.lower() == "content-length"), length)
        headers = [(k, v) for k, v in headers if k.lower() not in ("content-length", "connection", "transfer-encoding")]
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", length)
        self.end_headers()
        if self.command == "HEAD":
            return
        if fault == "long":
            self._send_long(body)
            return
        if fault == "drip":
            self._drip(body)
            return
        if fault in ("drop", "truncate") and len(body) > 1:
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            if fault == "drop":  # RST, not FIN: SO_LINGER with a zero timeout
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        self.wfile.write(body)

    def _send_long(self, body: bytes) -> None:
        faults = self.server.faults
        piece = bytes(64 << 10)
        try:
            self.wfile.write(body)
            left = faults.long_bytes
            while left > 0:
                n = min(left, len(piece))
                self.wfile.write(piece[:n])
                faults.count_extra(n)
                left -= n
            self.wfile.flush()
        except OSError:  # the client stopped reading and dropped the connection
            pass
        self.close_connection = True

    def _drip(self, body: bytes) -> None:
        try:
            for i in range(len(body)):
                self.wfile.write(body[i : i + 1])
                self.wfile.flush()
                time.sleep(self.server.faults.drip_seconds)
        except OSError:
            pass
        self.close_connection = True

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    faults: Faults


_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


class _RangeHandler(_Handler):
    server: _RangeServer

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        fault = self.server.faults.take(self.command, self.path)
        rel = self.path.split("?", 1)[0].lstrip("/")
        path = (self.server.folder / rel).resolve()
        if self.server.folder.resolve() not in path.parents or not path.is_file():
            self._respond(404, [("Content-Type", "text/plain")], b"not found", None)
            return
        size = path.stat().st_size
        headers = [("Accept-Ranges", "bytes"), ("Content-Type", "application/octet-stream")]
        if self.command == "HEAD":
            self._respond(200, [*headers, ("Content-Length", str(size))], b"", fault)
            return
        want = self.headers.get("Range")
        if want is None:
            self._respond(200, headers, path.read_bytes(), fault)
            return
        m = _RANGE.match(want.strip())
        if m is None or (not m.group(1) and not m.group(2)):
            self._respond(416, [("Content-Range", f"bytes */{size}")], b"", None)
            return
        if m.group(1):
            start = int(m.group(1))
            end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
        else:  # the last N bytes
            start, end = max(0, size - int(m.group(2))), size - 1
        if start >= size or end < start:
            self._respond(416, [("Content-Range", f"bytes */{size}")], b"", None)
            return
        with open(path, "rb") as f:  # only the bytes asked for
            f.seek(start)
            body = f.read(end + 1 - start)
        headers.append(("Content-Range", f"bytes {start}-{end}/{size}"))
        self._respond(206, headers, body, fault)


class _RangeServer(_Server):
    folder: Path


class _ProxyHandler(_Handler):
    server: _ProxyServer

    def _forward(self) -> None:
        body = self._body()
        fault = self.server.faults.take(self.command, self.path)
        conn = getattr(self.server.local, "conn", None)
        if conn is None:
            conn = self.server.local.conn = http.client.HTTPConnection("127.0.0.1", self.server.upstream, timeout=120)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "connection")}
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException):
            conn.close()
            self.server.local.conn = None
            raise
        keep = [(k, v) for k, v in response.getheaders() if k.lower() != "transfer-encoding"]
        if fault in _BODY_FAULTS and (self.command != "GET" or not data):
            fault = None  # body faults only apply to downloads
        self._respond(response.status, keep, data, fault)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward


class _ProxyServer(_Server):
    upstream: int
    local: threading.local


@contextlib.contextmanager
def _serving(server: _Server) -> Iterator[None]:
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@contextlib.contextmanager
def range_server(folder: Path) -> Iterator[tuple[str, Faults]]:
    """Serve ``folder`` over HTTP with Range requests: ``(base URL, faults)``."""
    server = _RangeServer(("127.0.0.1", 0), _RangeHandler)
    server.folder = Path(folder)
    server.faults = Faults()
    with _serving(server):
        yield f"http://127.0.0.1:{server.server_address[1]}", server.faults


@contextlib.contextmanager
def fault_proxy(upstream_port: int) -> Iterator[tuple[str, Faults]]:
    """A proxy to ``127.0.0.1:upstream_port`` that injects faults: ``(its URL, faults)``."""
    server = _ProxyServer(("127.0.0.1", 0), _ProxyHandler)
    server.upstream = upstream_port
    server.local = threading.local()
    server.faults = Faults()
    with _serving(server):
        yield f"http://127.0.0.1:{server.server_address[1]}", server.faults


@contextlib.contextmanager
def moto_server() -> Iterator[int]:
    """moto's S3 server in a process of its own on 127.0.0.1; yields its port."""
    with moto_process() as (port, _):
        yield port


@contextlib.contextmanager
def moto_process() -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """`moto_server`, yielding its port and its process (the benchmark reads its CPU time)."""
    port = free_port()
    env = {**os.environ, "MOTO_ALLOW_NONEXISTENT_REGION": "true"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        wait_for_port(port)
        yield port, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def s3_environment(endpoint: str, cache_dir: Path) -> dict[str, str]:
    """The variables a client needs for the test server, and none that reach beyond 127.0.0.1:
    the instance-metadata lookup (credentials of last resort) points at a closed local port."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_METADATA_ENDPOINT": f"http://127.0.0.1:{closed_port()}",
        "AWS_EC2_METADATA_DISABLED": "true",
        "SAEV_SHARDS_BLOCK_CACHE": str(cache_dir),
    }


_CLOSED: list[int] = []


def closed_port() -> int:
    """A local port nothing listens on (the same one for the whole run)."""
    if not _CLOSED:
        _CLOSED.append(free_port())
    return _CLOSED[0]


def create_bucket(endpoint: str, bucket: str) -> None:
    """Create ``bucket`` on the server at ``endpoint`` (moto takes unsigned requests)."""
    host, port = endpoint.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("PUT", f"/{bucket}", body=b"", headers={"Content-Length": "0"})
        response = conn.getresponse()
        response.read()
        if response.status not in (200, 409):
            raise RuntimeError(f"creating bucket {bucket}: HTTP {response.status}")
    finally:
        conn.close()
