"""Sites (protocol 3.2, protocol.md 2.1.1): what a layer slot of a cache holds, the input or
the output of one module of the model.

A `Site` is ``(module, io)``: ``module`` the dotted name of a module of the model, as
`torch.nn.Module.named_modules` names it (``""`` is the model itself), and ``io``
``"input"`` or ``"output"``. metadata.json's optional key ``sites`` (protocol 3.2) lists one
site per layer slot, in storage order, as objects ``{"module": ..., "io": ...}``; a cache
without it holds the output of block ``layers[l]`` in slot ``l`` (the residual stream), as
every 3.0 and 3.1 cache does.

In configurations, messages and loader arguments a site is written ``"module:io"``:
``"encoder.layer.3.intermediate:input"`` (`as_site`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from .jsonfile import json_value_problem, short_repr, type_name

#: The two things a site can hold of its module.
IO = ("input", "output")
#: The keys of a site object in metadata.json, in the order written.
SITE_KEYS = ("module", "io")


class Site(NamedTuple):
    """One layer slot's meaning: the input or the output of the module called ``module``."""

    module: str
    io: str

    def __str__(self) -> str:
        return f"{self.module}:{self.io}"

    def to_json(self) -> dict[str, str]:
        """The object metadata.json holds for this site."""
        return {"module": self.module, "io": self.io}


def as_site(value: object) -> Site | None:
    """``value`` as a `Site` if it spells one: a `Site`, a ``(module, io)`` pair, an object
    ``{"module": ..., "io": ...}`` or a string ``"module:io"`` (split at the last colon);
    None otherwise (`site_problem` says why)."""
    if isinstance(value, Site):
        return value
    if isinstance(value, str):
        module, colon, io = value.rpartition(":")
        return Site(module, io) if colon and io in IO else None
    if isinstance(value, dict) and set(value) == set(SITE_KEYS):
        module, io = value["module"], value["io"]
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        module, io = value
    else:
        return None
    if isinstance(module, str) and isinstance(io, str) and io in IO:
        return Site(module, io)
    return None


def site_problem(value: object) -> str:
    """Why ``value`` is not a site (for messages)."""
    if isinstance(value, str):
        return (
            f"expected 'module:input' or 'module:output' (such as 'encoder.layer.3.intermediate:input'), "
            f"found {short_repr(value)}"
        )
    return (
        "expected a site: 'module:input' or 'module:output', a (module, io) pair or "
        f"{{'module': ..., 'io': ...}} with io {' or '.join(map(repr, IO))}, found {type_name(value)} "
        f"{short_repr(value, 60)}"
    )


def sites_problems(sites: object, n_layers: int) -> list[str]:
    """Every problem with a `Metadata.sites` value (normalised: None or a tuple of `Site`):
    one site per layer, each module a valid JSON string, no site twice."""
    if sites is None:
        return []
    if not isinstance(sites, tuple):
        return [f"sites: expected None or a list of sites (one per layer), found {type_name(sites)}"]
    problems = []
    for i, site in enumerate(sites):
        if not isinstance(site, Site):
            problems.append(f"sites[{i}]: {site_problem(site)}")
            continue
        problem = json_value_problem(site.module) if isinstance(site.module, str) else "expected a string"
        if problem:
            problems.append(f"sites[{i}].module: {problem}")
        if site.io not in IO:
            problems.append(f"sites[{i}].io: expected one of {list(IO)}, found {short_repr(site.io)}")
    if len(sites) != n_layers:
        problems.append(f"sites: expected one site per layer ({n_layers}), found {len(sites)}")
    seen: dict[Site, int] = {}
    for i, site in enumerate(sites):
        if isinstance(site, Site) and site in seen:
            problems.append(f"sites[{i}]: {str(site)!r} is sites[{seen[site]}] again (every slot holds another site)")
        elif isinstance(site, Site):
            seen[site] = i
    return problems


def normalise(sites: object) -> object:
    """A `Metadata.sites` value given in Python as a tuple of `Site` where every entry spells
    one (`as_site`); anything else unchanged, for `sites_problems` to report."""
    if sites is None or isinstance(sites, (str, bytes, dict)) or not isinstance(sites, Sequence):
        return sites
    converted = [as_site(s) for s in sites]
    return tuple(c if c is not None else s for c, s in zip(converted, sites, strict=True))


def parse_sites_json(value: Any) -> tuple[tuple[Site, ...] | None, list[str]]:
    """metadata.json's ``sites`` value, strictly: an array of objects with exactly the keys
    ``module`` (a string) and ``io`` (``"input"`` or ``"output"``). ``(sites, [])`` or
    ``(None, problems)``; the rules that need the rest of the metadata are `sites_problems`'."""
    if not isinstance(value, list):
        return None, [f"sites: expected an array of site objects, found {type_name(value)}"]
    out, problems = [], []
    for i, entry in enumerate(value):
        if not isinstance(entry, dict) or set(entry) != set(SITE_KEYS):
            keys = sorted(entry, key=str) if isinstance(entry, dict) else None
            found = f"an object with keys {short_repr(keys)}" if keys is not None else type_name(entry)
            problems.append(f"sites[{i}]: expected an object with exactly the keys {list(SITE_KEYS)}, found {found}")
            continue
        module, io = entry["module"], entry["io"]
        if not isinstance(module, str):
            problems.append(f"sites[{i}].module: expected a string, found {type_name(module)}")
        if not (isinstance(io, str) and io in IO):
            problems.append(f"sites[{i}].io: expected one of {list(IO)}, found {short_repr(io)}")
        if isinstance(module, str) and isinstance(io, str) and io in IO:
            out.append(Site(module, io))
    return (None, problems) if problems else (tuple(out), [])


def describe(site: Site | None, layer: int) -> str:
    """A slot for people: ``"encoder.layer.3.intermediate (input)"``, or ``"layer 3"`` for a
    cache without sites (the output of block 3)."""
    if site is None:
        return f"layer {layer}"
    return f"{site.module or '(the model)'} ({site.io})"


__all__ = [
    "IO",
    "SITE_KEYS",
    "Site",
    "as_site",
    "describe",
    "normalise",
    "parse_sites_json",
    "site_problem",
    "sites_problems",
]
