"""A loader's resumable state (`TokenLoader.state_dict`): a small documented dict, checked when
loaded (`check_state`), naming each setting that differs when it is another loader's."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from ..errors import LoaderError, Problems
from ..protocol.jsonfile import is_int, short_repr, type_name

if TYPE_CHECKING:
    from .token_loader import TokenLoader

#: The keys of a state (``settings`` is optional: states saved before it still load).
KEYS = frozenset({"epoch", "batch", "seed", "fingerprint"})
_HEX = frozenset("0123456789abcdef")


def settings_of(loader: TokenLoader) -> dict[str, Any]:
    """Everything that decides ``loader``'s batches (the cache's hash included), as JSON values
    (`TokenLoader.settings`); the options added later only when set, so that states saved
    before them still load."""
    md = loader.shards.metadata
    sel = loader.selection
    config = {
        "cache": md.hash,
        "batch_size": loader.batch_size,
        "layers": list(sel.layer_values),
        "tokens": sel.tokens,
        "ignore_labels": sel.ignore_labels.tolist(),
        "skip_padding": sel.skip_padding,
        "drop_last": loader.drop_last,
        "rank": loader.rank,
        "world_size": loader.world_size,
        **loader.order.fingerprint(loader.buffer_bytes, loader.block_bytes),
    }
    if loader.stack_layers:  # only when set: states saved before the option still load
        config["stack_layers"] = True
    if loader.sites is not None:  # the order asked decides the batches too
        config["sites"] = [str(site) for site in loader.sites]
    if len(sel.exclude_token_ids):  # the token masks too: only when set
        config["exclude_token_ids"] = sel.exclude_token_ids.tolist()
    if sel.norm_filter is not None:
        config["max_norm_multiple"] = sel.norm_filter.multiple
    return config


def fingerprint_of(settings: dict[str, Any]) -> str:
    """16 hex digits of a digest of ``settings`` (`TokenLoader.fingerprint`)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def check_state(state: object, n_batches: int) -> tuple[int, int]:
    """``(epoch, batch)`` of ``state`` once every field is what `state_dict` gives: ``epoch`` an
    integer >= 0, ``batch`` an integer in ``[0, n_batches]`` (never a float, a bool or a string:
    1.9 would replay a batch), ``seed`` an integer, ``fingerprint`` 16 hex digits, ``settings``
    an object; `LoaderError` names every field that is not."""
    if not isinstance(state, dict) or not KEYS <= set(state) <= KEYS | {"settings"}:
        found = [short_repr(k) for k in state] if isinstance(state, dict) else type_name(state)
        raise LoaderError(f"state: expected keys {sorted(KEYS | {'settings'})}, found {found}")
    with Problems(LoaderError, head="state: ") as problems:
        epoch, batch = state["epoch"], state["batch"]
        if not (is_int(epoch) and 0 <= epoch < 2**63):
            problems.expected("epoch", "an integer >= 0", short_repr(epoch))
        if not (is_int(batch) and 0 <= batch <= n_batches):
            problems.expected("batch", f"an integer in [0, {n_batches}]", short_repr(batch))
        if not is_int(state["seed"]):
            problems.expected("seed", "an integer", short_repr(state["seed"]))
        fingerprint = state["fingerprint"]
        if not (isinstance(fingerprint, str) and len(fingerprint) == 16 and set(fingerprint) <= _HEX):
            problems.expected("fingerprint", "16 hex digits", short_repr(fingerprint))
        if "settings" in state and not isinstance(state["settings"], dict):
            problems.expected("settings", "an object", short_repr(state["settings"]))
    return int(epoch), int(batch)


def check_same(state: dict[str, Any], seed: int, fingerprint: str, settings: dict[str, Any]) -> None:
    """`LoaderError` when ``state`` (checked) is another loader's: another seed or fingerprint,
    naming each setting that differs."""
    if state["fingerprint"] == fingerprint and state["seed"] == seed:
        return
    differ = _differences({**_as_dict(state.get("settings")), "seed": state["seed"]}, {**settings, "seed": seed})
    raise LoaderError(
        f"state: expected a state of this loader (seed {seed}, fingerprint {fingerprint}), "
        f"found seed {state['seed']}, fingerprint {state['fingerprint']} (different cache or settings"
        + (f": {differ}" if differ else "")
        + ")"
    )


def _as_dict(value: object) -> dict[str, Any]:
    return dict(value) if isinstance(value, dict) else {}


def _differences(state: dict[str, Any], here: dict[str, Any]) -> str:
    """``"batch_size 8 in the state, 9 here; ..."`` for each setting that differs (the state's
    settings are absent from states saved before they were recorded: then nothing is named)."""
    if set(state) == {"seed"}:
        return "" if state["seed"] == here["seed"] else f"seed {state['seed']} in the state, {here['seed']} here"
    names = sorted(set(state) | set(here), key=lambda k: (k != "cache", str(k)))
    return "; ".join(
        f"{short_repr(k)[1:-1] if isinstance(k, str) else short_repr(k)} {short_repr(state.get(k, 'unset'))} "
        f"in the state, {short_repr(here.get(k, 'unset'))} here"
        for k in names
        if state.get(k) != here.get(k)
    )
