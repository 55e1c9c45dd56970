"""loaders.selection: which token vectors a loader yields. The chosen positions of each example
(labels ignored, padding skipped) against numpy's filtering of the cache's own columns, and
the counts and offsets computed from them; the layers, sites and output dtype checked, each
mistake a `LoaderError` naming it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import saev_shards as ss
from saev_shards.errors import LoaderError
from saev_shards.loaders.selection import (
    SiteChoice,
    TokenSelection,
    as_shards,
    check_layers_not_mixed,
    choose_sites,
    parse_layers,
    parse_out_dtype,
)

from ...support.caches import labels_for, small_metadata, write_cache

MD = small_metadata(n_examples=13, patches_per_shard=5 * 2 * 5)  # CLS + 4 content tokens, layers (6, 11)
LENGTHS = (np.arange(MD.n_examples, dtype=np.int32) * 5) % 6  # 0 to 5 tokens, CLS counted


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> ss.Shards:
    root = tmp_path_factory.mktemp("selection")
    write_cache(root, MD, labels=True, lengths=LENGTHS)
    return ss.open(root / MD.hash)


def expected_mask(tokens: str, ignore: set[int], skip_padding: bool) -> np.ndarray[Any, Any]:
    """The chosen positions, by numpy, from the columns as written."""
    t = np.arange(MD.tokens_per_ex)
    base = {"content": t >= 1, "cls": t == 0, "all": t >= 0}[tokens]
    mask = np.broadcast_to(base, (MD.n_examples, MD.tokens_per_ex)).copy()
    if ignore and tokens != "cls":
        mask[:, 1:] &= ~np.isin(labels_for(MD), sorted(ignore))
    if skip_padding:
        mask &= t[None, :] < LENGTHS[:, None]
    return mask


@settings(max_examples=40)
@given(
    tokens=st.sampled_from(["content", "cls", "all"]),
    ignore=st.sets(st.integers(0, 255), max_size=200),
    skip_padding=st.booleans(),
)
def test_the_chosen_positions_are_numpys_filtering(
    shards: ss.Shards, tokens: str, ignore: set[int], skip_padding: bool
) -> None:
    sel = TokenSelection(shards, tokens=tokens, ignore_labels=ignore, skip_padding=skip_padding)
    want = expected_mask(tokens, ignore, skip_padding)
    examples = np.arange(MD.n_examples, dtype=np.int64)
    assert np.array_equal(sel.mask(examples), want)
    for e in (0, 5, MD.n_examples - 1):
        assert sel.tokens_of(e).tolist() == np.flatnonzero(want[e]).tolist()
    before = np.concatenate([[0], np.cumsum(want.sum(axis=1))])
    assert sel.tokens_before(examples).tolist() == before[:-1].tolist()
    if sel.varies:
        assert sel.counts is not None and sel.counts.tolist() == want.sum(axis=1).tolist()
        assert sel.cumulative().tolist() == before.tolist()
    else:
        assert sel.counts is None and want.all(axis=0).sum() == len(sel.base_tokens)
    assert sel.dropped == {}  # no token masks


def test_labels_of_reads_runs_and_scattered_examples(shards: ss.Shards) -> None:
    sel = TokenSelection(shards)
    labels = labels_for(MD)
    # A run, scattered, none, and orders whose ends span as many examples as they hold but
    # which are not one ascending run (read as one slice, they gave the run's rows).
    for examples in ([3, 4, 5], [2, 7, 9], [], [0, 2, 1, 3], [4, 4, 6], [5, 4, 3]):
        got = sel.labels_of(np.array(examples, dtype=np.int64))
        assert got.tolist() == labels[examples].tolist()


@settings(max_examples=60)
@given(
    examples=st.one_of(
        st.lists(st.integers(0, MD.n_examples - 1), max_size=20),
        st.integers(0, MD.n_examples - 1).flatmap(lambda a: st.permutations(range(a, min(MD.n_examples, a + 6)))),
    )
)
def test_labels_of_is_numpys_indexing_in_any_order(shards: ss.Shards, examples: list[int]) -> None:
    sel = TokenSelection(shards, ignore_labels={1, 2}, skip_padding=True)
    index = np.array(examples, dtype=np.int64)
    assert sel.labels_of(index).tolist() == labels_for(MD)[examples].tolist()
    want = expected_mask("content", {1, 2}, True)[examples]
    assert np.array_equal(sel.mask(index), want)


def test_selection_arguments_are_checked(shards: ss.Shards, tmp_path: Path) -> None:
    with pytest.raises(LoaderError, match=r"ignore_labels: expected uint8 label values 0\.\.255, found \[256\]"):
        TokenSelection(shards, ignore_labels=[256])
    md = small_metadata()
    write_cache(tmp_path, md)
    plain = ss.open(tmp_path / md.hash)
    with pytest.raises(LoaderError, match=r"ignore_labels=\[3\]: expected a cache with labels\.bin"):
        TokenSelection(plain, ignore_labels=[3])
    with pytest.raises(LoaderError, match=r"labels: expected a cache with labels\.bin"):
        TokenSelection(plain).labels_of(np.arange(2))
    assert as_shards(plain) is plain
    assert as_shards(tmp_path / md.hash).metadata.hash == md.hash


def test_layers_are_values_checked_against_the_cache(shards: ss.Shards) -> None:
    assert parse_layers(shards, None) == (6, 11)
    assert parse_layers(shards, 11) == (11,)
    with pytest.raises(LoaderError):
        parse_layers(shards, 7)


def test_layers_are_never_mixed_by_accident(shards: ss.Shards) -> None:
    check_layers_not_mixed(shards, [6], stack_layers=False, mix_layers=False)
    check_layers_not_mixed(shards, [6, 11], stack_layers=True, mix_layers=False)
    check_layers_not_mixed(shards, [6, 11], stack_layers=False, mix_layers=True)
    with pytest.raises(LoaderError, match=r"this cache records layers \[6, 11\], and a batch would mix them") as info:
        check_layers_not_mixed(shards, [6, 11], stack_layers=False, mix_layers=False)
    assert "layers=11" in str(info.value) and "stack_layers=True" in str(info.value)
    with pytest.raises(LoaderError, match=r"records layers \[6, 11\]; you chose \[11, 6\]"):
        check_layers_not_mixed(shards, [11, 6], stack_layers=False, mix_layers=False)


def test_the_output_dtype(shards: ss.Shards) -> None:
    import torch

    assert parse_out_dtype(shards, None) == shards.read_dtype == "float16"
    assert parse_out_dtype(shards, torch.bfloat16) == "bfloat16"
    assert parse_out_dtype(shards, "float32") == "float32"
    for bad in ("float64", torch.int8, 3):
        with pytest.raises(
            LoaderError, match=r"out_dtype: expected None or one of \['float16', 'bfloat16', 'float32'\]"
        ):
            parse_out_dtype(shards, bad)


def test_sites_asked_of_a_cache(shards: ss.Shards) -> None:
    assert choose_sites(shards, None) is None
    with pytest.raises(LoaderError, match="give layers or sites, not both"):
        choose_sites(shards, "b.0:input", layers=[6])
    for bad in (b"b.0:input", {"b": 1}, 3):
        with pytest.raises(LoaderError, match="sites: expected a site such as"):
            choose_sites(shards, bad)
    with pytest.raises(LoaderError, match="sites: expected at least one site, found none"):
        choose_sites(shards, [])


def test_a_site_choice_says_where_its_sites_sit() -> None:
    choice = SiteChoice(sites=(), layers=(3, 1), stacked=True)
    assert choice.order([1, 2, 3]) == (2, 0)
    assert SiteChoice(sites=(), layers=(1, 3), stacked=True).order([1, 2, 3]) == (0, 2)
    assert SiteChoice(sites=(), layers=(1, 2), stacked=True).order([1, 2, 3]) is None
