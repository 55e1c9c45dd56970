"""Protocol 3.2 (protocol.md sections 2.1.1 and 8): protocol 3.1 plus the optional
metadata.json key ``sites``.

``sites`` says what each layer slot holds: the input or the output of a named module of the
model (`sites.Site`), one per slot, in storage order. Without it a 3.2 cache is a 3.1 cache
with another version string. Everything else (shards.json, scale files, blocks.json, the
hash formula) is 3.1's (`v31`). This library writes 3.2 only for a cache that has sites, so
every cache without them is written, byte for byte, as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import Problems
from . import v31
from .checks import check_keys
from .common import PROTOCOL_32
from .sites import parse_sites_json
from .v3 import KEYS

if TYPE_CHECKING:
    from .metadata import Metadata

#: The optional key 3.2 adds to metadata.json.
SITES_KEY = "sites"


class V32(v31.V31):
    """Protocol 3.2."""

    name = PROTOCOL_32
    summary = "protocol 3.2"
    protocols = (PROTOCOL_32,)
    keys: tuple[str, ...] = (*KEYS, SITES_KEY)
    has_sites = True

    def fields(self, obj: dict[str, Any], problems: Problems) -> dict[str, Any]:
        # ``sites`` is optional: never reported missing.
        check_keys(problems, {*obj, SITES_KEY}, self.keys, show_allowed=True)
        fields = {k: v for k, v in obj.items() if k in KEYS}
        fields["dialect"] = self.name
        if SITES_KEY in obj:
            sites, found = parse_sites_json(obj[SITES_KEY])
            for message in found:
                problems.add(message, field=SITES_KEY)
            fields[SITES_KEY] = sites
        return fields

    def to_json(self, md: Metadata) -> dict[str, Any]:
        out = {key: list(md.layers) if key == "layers" else getattr(md, key) for key in KEYS}
        if md.sites is not None:
            out[SITES_KEY] = [site.to_json() for site in md.sites]
        return out


DIALECT = V32()
