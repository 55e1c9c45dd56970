"""shuffle.options: a shuffle's keywords are the token selection's and `ShuffleOptions`' fields."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import saev_shards as ss
from saev_shards.selection import SelectionSpec
from saev_shards.shuffle import (
    ShuffleOptions,
    make_plan,
    plan_shuffle,
    shuffle_cache,
)

from ...support.caches import small_metadata, write_cache


def source(root: Path, **changes: Any) -> tuple[ss.Shards, np.ndarray[Any, Any], dict[str, Any]]:
    """A small source cache (23 examples, CLS + 4 tokens, 2 layers); returns it, its data and write kwargs."""
    kwargs: dict[str, Any] = {k: changes.pop(k) for k in ("labels", "lengths") if k in changes}
    md = small_metadata(**changes)
    logical = write_cache(root, md, **kwargs)
    return ss.open(root / md.hash), logical, kwargs


def test_the_keywords_are_the_selection_and_the_options(root: Path) -> None:
    """`plan_shuffle` and `shuffle_cache` take the fields of `SelectionSpec` and `ShuffleOptions` as
    keywords (their signatures say so), refuse any other as Python does, and plan what `make_plan`
    plans from the two objects."""
    src, _, _ = source(root)
    fields = [f.name for cls in (SelectionSpec, ShuffleOptions) for f in dataclasses.fields(cls)]
    for fn, own in ((plan_shuffle, ["progress"]), (shuffle_cache, ["progress", "durable"])):
        names = list(inspect.signature(fn).parameters)
        assert names == ["source", "root", *fields, *own]
        with pytest.raises(TypeError, match=rf"^{fn.__name__}\(\) got an unexpected keyword argument 'seeds'$"):
            fn(src, seeds=1)
    made = make_plan(src, src.path.parent, SelectionSpec(layers=[11]), ShuffleOptions(seed=3, dtype="float32"))
    assert made.to_json() == plan_shuffle(src, layers=[11], seed=3, dtype="float32").to_json()
    with pytest.raises(ss.ShuffleError, match="workers: expected an integer >= 1, found 0"):
        ShuffleOptions(workers=0)
