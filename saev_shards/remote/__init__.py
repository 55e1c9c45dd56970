"""Caches in object stores and on HTTP servers: URLs, the client, the block cache, verified reads.

* `url`: which references are URLs (``s3://``, ``gs://``, ``az://``, ``https://``, ``http://``)
  and how their parts join;
* `client`: the one module that talks to a server (obstore, the ``[remote]`` extra, imported
  on the first request): requests, retries, and the errors that name what went wrong
  (credentials, bucket, region, a denied request);
* `blockcache`: the bounded on-disk cache of verified blocks that the processes of a node
  share;
* `files`: `RemoteFiles`, the reader's storage for a remote cache: ranged reads, each block
  checked against the manifest's digests before a byte of it is handed out.

This package sits below the reader (`reader.open` imports it for a URL only) and never
imports the reader, the store or the command line. docs/remote.md describes the design.
"""

from __future__ import annotations

from .url import REMOTE_SCHEMES, is_url, join_url, split_url

__all__ = ["REMOTE_SCHEMES", "is_url", "join_url", "split_url"]
