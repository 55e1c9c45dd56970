"""Protocol 2.1 as saev's protocol document describes it (protocol.md section 9): read only.

The document's metadata.json has 3.0's twelve keys (``patches_per_ex``,
``patches_per_shard``, no ``pixel_agg``), and its directory name is all 64 digits of the
sha256 of ``json.dumps(metadata, sort_keys=True, separators=(',', ':'))`` (non-ASCII as
``\\uXXXX`` escapes), as for 3.0. saev's own code disagrees with its document
(`saev_code`) and rejects these caches, so this library reads them (earlier versions of it
wrote them) and no longer writes them: a cache for saev is written in saev's code's dialect.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .common import LEGACY_PROTOCOL
from .v3 import KEYS, content_hash, pretty_json
from .v21 import V21Files

if TYPE_CHECKING:
    from ..errors import Problems
    from .metadata import Metadata


class SaevSpec(V21Files):
    """saev's protocol document."""

    name = "saev-spec"
    summary = "protocol 2.1 as saev's protocol document describes it"
    protocols = (LEGACY_PROTOCOL,)
    keys = KEYS
    data_types = (dict, str)

    def metadata_bytes(self, md: Metadata) -> bytes:
        return pretty_json(self.to_json(md))

    def directory_name(self, md: Metadata) -> str:
        return content_hash(self.to_json(md))

    def check_writable(self, md: Metadata, problems: Problems) -> None:
        problems.add(
            "dialect: saev's code does not read caches of its protocol document ('saev-spec'); "
            "write protocol '2.1' in dialect 'saev' (the default), which saev reads as its own",
            field="dialect",
        )


DIALECT = SaevSpec()
