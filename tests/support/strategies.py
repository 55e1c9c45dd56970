"""Hypothesis strategies reused by every property test."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

import saev_shards as ss


@st.composite
def metadata(
    draw: st.DrawFn,
    *,
    max_examples: int = 40,
    dtypes: tuple[str, ...] = ("float16", "bfloat16", "float32", "float8_e4m3"),
    min_examples: int = 0,
    sites: bool = False,
) -> ss.Metadata:
    """Small but varied configurations: 1-3 layers in any order, CLS on/off, budgets giving
    one example per shard up to a dozen, partial last shards, empty caches; with ``sites``,
    every other one records sites (protocol 3.2, any module names, inputs and outputs)."""
    n_layers = draw(st.integers(1, 3))
    layers = tuple(draw(st.lists(st.integers(-2, 40), min_size=n_layers, max_size=n_layers, unique=True)))
    cls_token = draw(st.booleans())
    patches = draw(st.integers(0 if cls_token else 1, 5))
    tokens = patches + int(cls_token)
    eps = draw(st.integers(1, 12))
    slack = draw(st.integers(0, tokens * n_layers - 1))
    return ss.Metadata(
        family=draw(st.sampled_from(["clip", "siglip", "dinov2", "minilm"])),
        ckpt="ckpt",
        layers=layers,
        patches_per_ex=patches,
        cls_token=cls_token,
        d_model=draw(st.integers(1, 6)),
        n_examples=draw(st.integers(min_examples, max_examples)),
        patches_per_shard=eps * tokens * n_layers + slack,
        data={"seed": draw(st.integers(0, 3))},
        dataset="/data",
        dtype=draw(st.sampled_from(dtypes)),
        sites=draw(st.none() | site_lists(n_layers)) if sites else None,
    )


def site_lists(n: int) -> st.SearchStrategy[tuple[ss.Site, ...]]:
    """``n`` distinct sites: module names of any text (the model itself too), either end."""
    one = st.builds(ss.Site, st.text(max_size=12), st.sampled_from(["input", "output"]))
    return st.lists(one, min_size=n, max_size=n, unique=True).map(tuple)


def batch_sizes() -> st.SearchStrategy[list[int]]:
    """Batch sizes cycled over the examples (see helpers.split)."""
    return st.lists(st.integers(1, 13), min_size=1, max_size=5)


@st.composite
def index_component(draw: st.DrawFn, size: int, allow_arrays: bool = True) -> Any:
    """One component of a numpy index for an axis of length ``size``."""
    kinds = ["int", "slice", "full"] + (["array", "bool"] if allow_arrays else [])
    kind = draw(st.sampled_from(kinds if size else ["slice", "full"] + (["array"] if allow_arrays else [])))
    if kind == "int":
        return draw(st.integers(-size, size - 1))
    if kind == "full":
        return slice(None)
    if kind == "slice":
        bound = st.none() | st.integers(-size - 2, size + 2)
        step = draw(st.none() | st.integers(-4, 4).filter(lambda s: s != 0))
        return slice(draw(bound), draw(bound), step)
    if kind == "bool":
        return draw(st.lists(st.booleans(), min_size=size, max_size=size))
    if size == 0:
        return []
    return draw(st.lists(st.integers(-size, size - 1), min_size=0, max_size=6))


# --------------------------------------------------------------------------------------
# hostile input (the catalogue and the mutation engine are in hostile.py)


def json_scalars() -> st.SearchStrategy[Any]:
    """Any JSON scalar Python's json writes, NaN and infinities (as NaN/Infinity) included."""
    return st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30)


def hostile_values() -> st.SearchStrategy[Any]:
    """Values to put in a cache's JSON: the catalogue of `hostile.HOSTILE_VALUES`, arbitrary
    scalars, and small structures of both."""
    from .hostile import HOSTILE_VALUES

    leaf = st.sampled_from(HOSTILE_VALUES) | json_scalars()
    return st.recursive(
        leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
        max_leaves=5,
    )  # fmt: skip


@st.composite
def hostile_cases(draw: st.DrawFn, n_caches: int, n_files: int) -> tuple[int, int, str, int, Any, int]:
    """``(cache index, JSON file index, mutation kind, node number, value, seed)``: one damage
    for `hostile.mutate` to apply (indices are taken modulo what the cache has)."""
    from .hostile import MUTATIONS

    return (
        draw(st.integers(0, n_caches - 1)),
        draw(st.integers(0, n_files - 1)),
        draw(st.sampled_from(MUTATIONS)),
        draw(st.integers(0, 1 << 30)),
        draw(hostile_values()),
        draw(st.integers(0, 2**32 - 1)),
    )
