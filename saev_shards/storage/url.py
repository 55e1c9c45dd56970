"""Remote references: which strings are URLs, and how a root, a cache and a file name join.

A remote shards root is a URL (``s3://bucket/prefix``, ``https://host/path``); a cache in it
is ``<root>/<HASH>`` and a file of that cache ``<root>/<HASH>/<name>``, as on a local disk
(protocol.md 6.1).
"""

from __future__ import annotations

import os
import re

from ..errors import CacheRefError

#: URL schemes opened through the object store client (obstore): S3 and S3-compatible stores,
#: Google Cloud Storage, Azure, and plain HTTP(S) servers that honour Range requests.
REMOTE_SCHEMES = ("s3", "s3a", "gs", "az", "abfs", "abfss", "http", "https")
_URL_RE = re.compile(r"([a-z][a-z0-9+.-]*)://[^/]", re.IGNORECASE)


def is_url(ref: object) -> bool:
    """True for a string naming a remote location this library reads (``s3://bucket/...``)."""
    if isinstance(ref, os.PathLike) or not isinstance(ref, str):
        return False
    m = _URL_RE.match(ref)
    return m is not None and m.group(1).lower() in REMOTE_SCHEMES


#: Path segments a URL parser resolves (WHATWG URL: ``.`` and ``..``, their ``%2e`` spellings too):
#: ``https://host/root/..`` is a request for ``https://host/``, and a local folder named ``..``
#: is the folder above.
_DOT_SEGMENT_RE = re.compile(r"(?:\.|%2e){1,2}", re.IGNORECASE)
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


def check_url(url: str) -> str:
    """``url`` if every segment of its path may name a remote object and a local folder:
    `CacheRefError` for a ``.`` or ``..`` segment (``%2e`` spellings included) or a control
    character (NUL among them). Checked before a request is sent or a local path is made
    from a segment (`remote_json.local_folder` names folders after them)."""
    rest = url.split("://", 1)[1] if "://" in url else url
    bad = _CONTROL_RE.search(url)
    if bad is not None:
        raise CacheRefError(f"{url!r}: a URL with a control character ({bad.group()!r}) names nothing here")
    for segment in rest.split("?", 1)[0].split("#", 1)[0].split("/")[1:]:
        if _DOT_SEGMENT_RE.fullmatch(segment):
            raise CacheRefError(
                f"{url}: a URL segment {segment!r} names a folder above or the same folder, not a cache: "
                "give the cache's URL without it"
            )
    return url


def scheme(url: str) -> str:
    return url.split("://", 1)[0].lower()


def strip(url: str) -> str:
    """``url`` without trailing slashes (``s3://b/p/`` -> ``s3://b/p``); a bare bucket keeps its name."""
    return url.rstrip("/")


def split_url(url: str) -> tuple[str, str]:
    """``(parent, last segment)``: ``s3://b/root/3f2a`` -> ``(s3://b/root, 3f2a)``."""
    head, _, last = strip(url).rpartition("/")
    if head.endswith(":/"):  # s3://bucket: the bucket itself has no parent
        return strip(url), ""
    return head, last


def join_url(url: str, *names: str) -> str:
    """``url/name/...`` with exactly one slash between parts."""
    return "/".join([strip(url), *(n.strip("/") for n in names if n)])


def split_roots(value: str) -> list[str]:
    """``$SAEV_SHARDS_ROOT`` split at ``:`` (``os.pathsep``) except where ``://`` follows a scheme:
    ``/scratch/shards:s3://bucket/shards`` -> ``["/scratch/shards", "s3://bucket/shards"]``."""
    parts: list[str] = []
    for piece in value.split(os.pathsep):
        if parts and piece.startswith("//") and parts[-1].lower() in REMOTE_SCHEMES:
            parts[-1] = f"{parts[-1]}:{piece}"
        else:
            parts.append(piece)
    return [p for p in parts if p]
