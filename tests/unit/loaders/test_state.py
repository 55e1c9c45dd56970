"""loaders.state: a loader's resumable state. Every state `check_state` accepts is what
`state_dict` can give (integers in range, 16 hex digits); every field that is not is named;
another loader's state names each setting that differs; the settings hold the later options
only when set, so that states saved before them still load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from saev_shards import loaders
from saev_shards.errors import LoaderError
from saev_shards.loaders.state import KEYS, check_same, check_state, fingerprint_of, settings_of

from .test_masks import BOS, masked_cache

hex16 = st.text("0123456789abcdef", min_size=16, max_size=16)


def state(**changes: Any) -> dict[str, Any]:
    return {"epoch": 2, "batch": 3, "seed": 0, "fingerprint": "0123456789abcdef", **changes}


@given(st.integers(0, 2**63 - 1), st.integers(0, 1000), st.data())
def test_every_state_within_range_is_accepted(epoch: int, n_batches: int, data: st.DataObject) -> None:
    batch = data.draw(st.integers(0, n_batches))
    seed = data.draw(st.integers(-(2**70), 2**70))
    fingerprint = data.draw(hex16)
    settings = data.draw(st.none() | st.dictionaries(st.text(max_size=5), st.integers()))
    given_state: dict[str, Any] = {"epoch": epoch, "batch": batch, "seed": seed, "fingerprint": fingerprint}
    if settings is not None:
        given_state["settings"] = settings
    assert check_state(given_state, n_batches) == (epoch, batch)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"batch": 1.9}, "batch: expected an integer in [0, 5], found 1.9"),
        ({"batch": True}, "batch: expected an integer in [0, 5], found True"),
        ({"batch": 6}, "batch: expected an integer in [0, 5], found 6"),
        ({"batch": -1}, "batch: expected an integer in [0, 5]"),
        ({"epoch": 2**63}, "epoch: expected an integer >= 0"),
        ({"epoch": "1"}, "epoch: expected an integer >= 0, found '1'"),
        ({"seed": 0.0}, "seed: expected an integer, found 0.0"),
        ({"fingerprint": "0123456789ABCDEF"}, "fingerprint: expected 16 hex digits"),
        ({"fingerprint": "0123"}, "fingerprint: expected 16 hex digits"),
        ({"settings": [1]}, "settings: expected an object, found [1]"),
    ],
)
def test_a_field_out_of_its_range_is_named(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(LoaderError) as info:
        check_state(state(**changes), 5)
    assert str(info.value).startswith("state: ") and field in str(info.value)


def test_every_bad_field_is_named_at_once() -> None:
    with pytest.raises(LoaderError) as info:
        check_state(state(epoch=-1, seed=None), 5)
    assert "epoch: expected" in str(info.value) and "seed: expected" in str(info.value)


@pytest.mark.parametrize(
    "bad", [[], "state", None, {"epoch": 0}, {**state(), "extra": 1}, {k: 0 for k in ("epoch", "batch", "seed")}]
)
def test_a_state_without_its_keys_is_refused(bad: object) -> None:
    with pytest.raises(
        LoaderError, match=r"^state: expected keys \['batch', 'epoch', 'fingerprint', 'seed', 'settings'\]"
    ):
        check_state(bad, 5)
    assert {"epoch", "batch", "seed", "fingerprint"} == KEYS


@given(st.dictionaries(st.text(max_size=6), st.integers() | st.text(max_size=4) | st.lists(st.integers(), max_size=3)))
def test_the_fingerprint_is_16_hex_digits_of_the_settings_in_any_order(settings: dict[str, Any]) -> None:
    fingerprint = fingerprint_of(settings)
    assert len(fingerprint) == 16 and set(fingerprint) <= set("0123456789abcdef")
    assert fingerprint_of(dict(reversed(list(settings.items())))) == fingerprint
    assert fingerprint_of({**settings, "another": 1}) != fingerprint  # a key longer than any drawn


def test_another_loaders_state_names_each_setting_that_differs() -> None:
    here = {"cache": "c" * 64, "batch_size": 9, "layers": [2]}
    saved = state(seed=1, settings={"cache": "c" * 64, "batch_size": 8, "layers": [2], "stack_layers": True})
    check_same(state(), 0, "0123456789abcdef", here)  # the same seed and fingerprint: this loader's
    with pytest.raises(LoaderError) as info:
        check_same(saved, 0, "fedcba9876543210", here)
    message = str(info.value)
    assert message.startswith("state: expected a state of this loader (seed 0, fingerprint fedcba9876543210)")
    assert "batch_size 8 in the state, 9 here; seed 1 in the state, 0 here; stack_layers True in the state, " in message
    assert "'unset' here" in message and "; layers" not in message and "'ccc" not in message  # the same: not named
    with pytest.raises(LoaderError, match=r"different cache or settings\)$"):
        check_same(state(), 0, "fedcba9876543210", here)  # saved before settings were: nothing to name
    with pytest.raises(LoaderError, match=r"different cache or settings: seed 0 in the state, 4 here\)$"):
        check_same(state(), 4, "fedcba9876543210", here)


def test_the_settings_hold_later_options_only_when_set(tmp_path: Path) -> None:
    shards, _ = masked_cache(tmp_path)
    plain = settings_of(loaders.TokenLoader(shards, batch_size=4, layers=[shards.metadata.layers[0]]))
    assert plain["cache"] == shards.metadata.hash and plain["batch_size"] == 4 and plain["shuffle"] is True
    assert not {"stack_layers", "sites", "exclude_token_ids", "max_norm_multiple"} & set(plain)
    stacked = settings_of(loaders.TokenLoader(shards, batch_size=4, stack_layers=True, exclude_token_ids=[BOS]))
    assert stacked["stack_layers"] is True and stacked["exclude_token_ids"] == [BOS]
    assert fingerprint_of(plain) != fingerprint_of(stacked)
