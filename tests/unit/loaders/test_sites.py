"""``sites=``: the loaders and datasets yield one recorded site, or every listed site of each
token stacked in the order listed (a transcoder's pair ``(B, 2, D)``, all sites ``(B, S, D)``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import saev_shards as ss
from saev_shards.loaders import ExampleDataset, OrderedLoader, ShuffledLoader, TokenDataset

from ...support.caches import small_metadata, write_cache

#: A transcoder cache of two spans: each block's MLP input and output (slots 0-3).
SITES = ("b.0.mlp:input", "b.0.mlp:output", "b.1.mlp:input", "b.1.mlp:output")


@pytest.fixture
def cache(tmp_path: Path) -> tuple[ss.Shards, np.ndarray[Any, Any]]:
    md = small_metadata(layers=(0, 1, 2, 3), sites=SITES, dtype="float32", patches_per_shard=5 * 4 * 5)
    logical = write_cache(tmp_path, md, lengths=np.arange(md.n_examples, dtype=np.int32) % 6)
    return ss.open(tmp_path / md.hash), logical


def rows(batches: list[Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    acts = torch.cat([b.acts for b in batches]).numpy()
    return acts, torch.cat([b.examples for b in batches]).numpy(), torch.cat([b.tokens for b in batches]).numpy()


@pytest.mark.parametrize("order", ["shuffled", "ordered"])
@pytest.mark.parametrize(
    "asked",
    [
        ["b.1.mlp:input", "b.1.mlp:output"],  # a transcoder's pair, stored in this order
        ["b.1.mlp:output", "b.1.mlp:input"],  # the other way round: reordered
        ["b.1.mlp:output", "b.0.mlp:input", "b.1.mlp:input", "b.0.mlp:output"],  # every site
    ],
)
def test_stacked_sites_come_in_the_order_listed(
    cache: tuple[ss.Shards, np.ndarray[Any, Any]], order: str, asked: list[str]
) -> None:
    shards, logical = cache
    slots = [SITES.index(s) for s in asked]
    loader_type = ShuffledLoader if order == "shuffled" else OrderedLoader
    loader = loader_type(shards, batch_size=7, sites=asked, block_bytes=64, buffer_bytes=400)
    batches = list(loader)
    acts, examples, tokens = rows(batches)
    assert acts.shape[1:] == (len(asked), 8)
    np.testing.assert_array_equal(acts, logical[examples[:, None], slots, tokens[:, None]])
    assert batches[0].layers[0].tolist() == slots  # the layer values, here the slot numbers
    assert loader.sites == tuple(ss.Site(*s.split(":")) for s in asked)
    lengths = np.arange(23) % 6
    assert len(examples) == int(np.maximum(lengths - 1, 0).sum())  # content tokens, padding skipped: each once
    assert len(set(zip(examples.tolist(), tokens.tolist(), strict=True))) == len(examples)


def test_one_site_gives_single_vectors(cache: tuple[ss.Shards, np.ndarray[Any, Any]]) -> None:
    shards, logical = cache
    batches = list(OrderedLoader(shards, batch_size=5, sites="b.0.mlp:output"))
    acts, examples, tokens = rows(batches)
    assert acts.shape[1:] == (8,)
    np.testing.assert_array_equal(acts, logical[examples, 1, tokens])
    listed = list(OrderedLoader(shards, batch_size=5, sites=[ss.Site("b.0.mlp", "output")]))
    assert listed[0].acts.shape[1:] == (1, 8)  # a list of one: stacked, like layers=[v] with stack_layers


def test_the_order_asked_is_part_of_the_state(cache: tuple[ss.Shards, np.ndarray[Any, Any]]) -> None:
    """Resuming mid-epoch gives the rest of the same epoch; a loader of the other order is
    another loader, and says so by the setting that differs."""
    shards, _ = cache
    pair = ["b.1.mlp:output", "b.1.mlp:input"]
    loader = ShuffledLoader(shards, batch_size=6, sites=pair, seed=3, block_bytes=64, buffer_bytes=400)
    everything = list(loader)
    first = ShuffledLoader(shards, batch_size=6, sites=pair, seed=3, block_bytes=64, buffer_bytes=400)
    it = iter(first)
    next(it), next(it)
    state = first.state_dict()
    first.close()
    again = ShuffledLoader(shards, batch_size=6, sites=pair, seed=3, block_bytes=64, buffer_bytes=400)
    again.load_state_dict(state)
    rest = list(again)
    assert len(rest) == len(everything) - 2
    for a, b in zip(rest, everything[2:], strict=True):
        assert torch.equal(a.acts, b.acts)
    other = ShuffledLoader(shards, batch_size=6, sites=pair[::-1], seed=3, block_bytes=64, buffer_bytes=400)
    with pytest.raises(ss.LoaderError, match="sites"):
        other.load_state_dict(state)


def test_datasets_take_sites(cache: tuple[ss.Shards, np.ndarray[Any, Any]]) -> None:
    shards, logical = cache
    pair = ["b.0.mlp:output", "b.0.mlp:input"]
    tokens = TokenDataset(shards, sites=pair)
    item = tokens[4]
    np.testing.assert_array_equal(item["acts"].numpy(), logical[item["example"], [1, 0], item["token"]])
    assert item["layers"].tolist() == [1, 0] and len(tokens) == int(np.maximum(np.arange(23) % 6 - 1, 0).sum())
    one = TokenDataset(shards, sites="b.0.mlp:output")[4]
    np.testing.assert_array_equal(one["acts"].numpy(), item["acts"][0].numpy())
    examples = ExampleDataset(shards, sites=pair)
    np.testing.assert_array_equal(examples[3]["acts"].numpy(), logical[3, [1, 0]])
    assert examples[3]["layers"].tolist() == [1, 0] and len(examples) == 23


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sites": "b.2.mlp:input"}, r"sites: site 'b\.2\.mlp:input' was not recorded; recorded sites are 'b\.0"),
        ({"sites": ["b.0.mlp:input", "b.0.mlp:input"]}, "expected each site once"),
        ({"sites": "b.0.mlp"}, r"expected 'module:input' or 'module:output'"),
        ({"sites": 3}, "sites: expected a site such as"),
        ({"sites": []}, "expected at least one site"),
        ({"sites": "b.0.mlp:input", "layers": 0}, "give layers or sites, not both"),
    ],
)
def test_bad_sites_are_loader_errors(
    cache: tuple[ss.Shards, np.ndarray[Any, Any]], kwargs: dict[str, Any], message: str
) -> None:
    shards, _ = cache
    for make in (ShuffledLoader, ExampleDataset, TokenDataset):
        args = dict(kwargs)
        if make is TokenDataset and "layers" in args:
            args["layer"] = args.pop("layers")
        with pytest.raises(ss.LoaderError, match=message):
            make(shards, **args)


def test_a_cache_without_sites_says_so(tmp_path: Path) -> None:
    md = small_metadata()
    write_cache(tmp_path, md)
    with pytest.raises(ss.LoaderError, match=r"this cache records no sites \(protocol 3\.1\).*\[6, 11\]"):
        ShuffledLoader(ss.open(tmp_path / md.hash), sites="spans.6:output")


def test_a_shuffled_cache_keeps_the_sites_it_holds(
    cache: tuple[ss.Shards, np.ndarray[Any, Any]], tmp_path: Path
) -> None:
    shards, logical = cache
    shuffled = ss.shuffle_cache(shards, tmp_path / "shuffled", layers=[3, 2], progress=False, durable=False)
    md = shuffled.metadata
    assert (md.protocol, md.layers) == ("3.2", (2, 3))
    assert md.sites == (ss.Site("b.1.mlp", "input"), ss.Site("b.1.mlp", "output"))
    batch = next(iter(OrderedLoader(shuffled, batch_size=4, sites=["b.1.mlp:input", "b.1.mlp:output"])))
    source_example = shuffled.columns["source_example"][batch.examples.numpy()]
    source_token = shuffled.columns["source_token"][batch.examples.numpy()]
    np.testing.assert_array_equal(batch.acts.numpy(), logical[source_example[:, None], [2, 3], source_token[:, None]])
