"""Where a cache's files live, behind one interface: local folders and remote object stores
as two peers, and the verified transfers between them.

* `base`: `Files`, everything the reader, the store and the transfers ask of a storage;
* `local`: `LocalFiles` (a folder of this machine: descriptors, ``os.preadv``, memory maps)
  and `FolderLock`, the shared lock readers hold on it;
* `remote`: `RemoteFiles` (an object store or an HTTP server), over `units` (verified
  pieces: blocks of blocks.json, or whole files, fetched, checked, held), `blockcache` (the
  bounded on-disk cache of verified blocks the processes of a node share, in `folders`
  opened without following links) and `remote_json` (a remote cache's JSON files on this node);
* `client`: the one module that talks to a server (obstore, the ``[remote]`` extra,
  imported on the first request): requests, retries, and the errors that name what went
  wrong (credentials, bucket, region, a denied request);
* `url`: which references are URLs (``s3://``, ``gs://``, ``az://``, ``https://``,
  ``http://``) and how their parts join;
* `transfer`: every byte of a stage, pull or push hashed on its way (`StreamDigest`),
  checked, resumable (`copy_file`, `resume_file`, `upload_file`), and `TransferReport`.

This package sits below the reader (`reader.open` gives a cache its storage) and never
imports the reader, the store or the command line. docs/remote.md describes the remote design.
"""

from __future__ import annotations

from .base import Files
from .local import FolderLock, LocalFiles
from .transfer import TransferReport
from .url import REMOTE_SCHEMES, is_url, join_url, split_url

__all__ = [
    "REMOTE_SCHEMES",
    "Files",
    "FolderLock",
    "LocalFiles",
    "TransferReport",
    "is_url",
    "join_url",
    "split_url",
]
