"""The one token selection (`saev_shards.selection`): the loaders and the shuffle refuse a choice
with the same words (each with its own error class), accept the same spellings of ``layers``,
and choose the same positions; `Selection.mask` against a numpy reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import saev_shards as ss
from saev_shards import loaders, selection
from saev_shards.errors import LoaderError, ShuffleError
from saev_shards.selection import SelectionSpec, parse_selection
from saev_shards.shuffle import plan_shuffle

from ...support.caches import small_metadata, write_cache

RECORDED = (6, 11)


@pytest.fixture
def shards(root: Path) -> ss.Shards:
    md = small_metadata()
    write_cache(root, md, lengths=np.array([5, 3, 1, 0, 4] * 4 + [2, 5, 5], dtype=np.int32))
    return ss.open(root / md.hash)


BAD = [
    (dict(layers=7), r"layers: expected values among the recorded layers \[6, 11\], found 7"),
    (dict(layers=[]), r"layers: expected at least one of the recorded layers \[6, 11\], found none"),
    (dict(layers=[6, 6]), r"layers: expected distinct values, found \[6, 6\]"),
    (dict(layers="11"), r"layers: expected a list of layer values such as \[11\], found the string '11'"),
    (dict(layers=11.0), r"layers: expected None, a layer value or a list of them, found 11\.0"),
    (dict(layers={6: 1}), r"layers: expected None, a layer value or a list of them"),
    (dict(layers=[True]), r"layers: expected values among the recorded layers \[6, 11\], found True"),
    (dict(tokens="patches"), r"tokens: expected one of \['content', 'cls', 'all'\], found 'patches'"),
    (dict(exclude_token_ids=[3]), "exclude_token_ids: expected a cache with a token_ids column"),
    (dict(exclude_token_ids="3"), "exclude_token_ids: expected a list of token ids"),
    (dict(max_norm_multiple=0.5), "max_norm_multiple: expected a finite number above 1"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD)
def test_loaders_and_shuffle_refuse_with_one_wording(shards: ss.Shards, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(LoaderError, match=message) as from_loader:
        loaders.TokenSelection(shards, **kwargs)
    with pytest.raises(ShuffleError, match=message) as from_shuffle:
        plan_shuffle(shards, **kwargs)
    assert str(from_loader.value) == str(from_shuffle.value)


def test_cls_needs_a_cls_token(root: Path) -> None:
    md = small_metadata(cls_token=False)
    write_cache(root, md)
    shards = ss.open(root / md.hash)
    message = r"tokens='cls': expected a cache with a CLS token \(cls_token=true\), found cls_token=false at "
    for error in (LoaderError, ShuffleError):
        with pytest.raises(error, match=message):
            parse_selection(shards, SelectionSpec(tokens="cls"), error)


@pytest.mark.parametrize("layers", [None, 11, np.int64(6), [11, 6], (6,), np.array([11]), range(6, 12, 5)])
def test_every_spelling_of_layers_is_taken_alike(shards: ss.Shards, layers: Any) -> None:
    """The same layers (storage order) for the loaders' selection and the shuffle's plan."""
    chosen = loaders.TokenSelection(shards, layers=layers).layer_values
    planned = plan_shuffle(shards, layers=layers).selection.layers
    expected = RECORDED if layers is None else tuple(v for v in RECORDED if v in np.ravel(layers))
    assert chosen == planned == expected


@pytest.mark.parametrize("tokens", selection.TOKEN_CHOICES)
def test_the_loaders_and_the_shuffle_choose_the_same_positions(shards: ss.Shards, tokens: str) -> None:
    sel = loaders.TokenSelection(shards, tokens=tokens)
    plan = plan_shuffle(shards, tokens=tokens)
    assert tuple(sel.base_tokens.tolist()) == plan.selection.positions == sel.chosen.positions
    examples = np.arange(shards.n_examples, dtype=np.int64)
    lengths = np.asarray(shards.columns["lengths"][:]).astype(np.int64)
    from_shuffle = plan.selection.mask(examples, lengths=lengths)[0]
    assert np.array_equal(sel.mask(examples), from_shuffle)


@given(
    positions=st.lists(st.integers(0, 4), unique=True, min_size=1),
    lengths=st.lists(st.integers(0, 5), min_size=1, max_size=9),
    keep_seed=st.integers(0, 2**32 - 1),
    excluded=st.lists(st.integers(0, 9), max_size=3, unique=True),
)
def test_mask_matches_numpy(positions: list[int], lengths: list[int], keep_seed: int, excluded: list[int]) -> None:
    """The kind's positions, the caller's keep, the lengths, then the excluded ids (what they took counted)."""
    n, t = len(lengths), 5
    rng = np.random.default_rng(keep_seed)
    keep = rng.random((n, t)) < 0.8
    ids = rng.integers(0, 10, (n, t))
    sel = selection.Selection(
        layers=(6,),
        tokens="content",
        layer_positions=(0,),
        positions=tuple(sorted(positions)),
        tokens_per_ex=t,
        has_lengths=True,
        exclude_token_ids=tuple(sorted(excluded)),
    )
    mask, taken = sel.mask(
        np.arange(n, dtype=np.int64), lengths=np.array(lengths, dtype=np.int64), token_ids=lambda: ids, keep=keep
    )
    before = np.zeros((n, t), dtype=bool)
    before[:, sorted(positions)] = True
    before &= keep & (np.arange(t)[None, :] < np.array(lengths)[:, None])
    hit = before & np.isin(ids, excluded)
    assert np.array_equal(mask, before & ~hit)
    assert set(taken) == ({"exclude_token_ids"} if excluded else set())
    if excluded:
        assert np.array_equal(taken["exclude_token_ids"], hit)


def test_old_import_paths_still_work() -> None:
    from saev_shards import _layers, token_masks  # type: ignore[attr-defined]
    from saev_shards.loaders.selection import TOKEN_CHOICES as from_loaders
    from saev_shards.shuffle.source import TOKEN_CHOICES as from_shuffle

    assert _layers.string_layers_problem is selection.string_layers_problem
    assert token_masks.parse_exclude_token_ids is selection.token_masks.parse_exclude_token_ids
    assert from_loaders is from_shuffle is selection.TOKEN_CHOICES
