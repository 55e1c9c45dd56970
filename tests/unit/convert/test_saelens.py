"""convert.saelens: SAELens activation caches -> cache: rows, hooks, token ids and layer numbers."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

import saev_shards as ss
from saev_shards.convert import Options, convert
from saev_shards.convert.saelens import layer_of
from saev_shards.errors import ConvertOptionError

from ...support.sources import assert_converted, saelens_source

pytest.importorskip("zarr")


warnings.filterwarnings("ignore", message="Consolidated metadata")


def _convert(src: Path, root: Path, **kwargs: object) -> tuple[ss.Shards, object]:
    result = convert(src, root=root, durable=False, **kwargs)
    return ss.open(result.path), result


def test_saelens_rows_hooks_and_token_ids(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    expected = saelens_source(tmp_path / "cache")
    shards, _ = _convert(tmp_path / "cache", tmp_path / "root")
    assert_converted(shards, expected)
    assert shards.metadata.layers == (3, 1)  # column order, numbers from the hook names
    assert shards.lengths is None
    cut, _ = _convert(tmp_path / "cache", tmp_path / "cut", options=Options(max_tokens=4, layers=(30, 10)))
    assert cut.metadata.layers == (30, 10)
    np.testing.assert_array_equal(cut[:], expected.acts[:, :, :4].astype(np.float16))
    np.testing.assert_array_equal(cut.columns["token_ids"], expected.columns["token_ids"][:, :4])


def test_saelens_layer_numbers(tmp_path: Path) -> None:
    assert layer_of("blocks.5.hook_resid_post") == 5
    assert layer_of("blocks.12.attn.hook_z") == 12
    assert layer_of("model.layers.7.mlp") == 7
    assert layer_of("hook_embed") is None
    pytest.importorskip("datasets")
    saelens_source(tmp_path / "dup", hooks=("blocks.2.hook_resid_pre", "blocks.2.hook_mlp_out"))
    with pytest.raises(ConvertOptionError, match="give them with --layers"):
        convert(tmp_path / "dup", root=tmp_path / "root")
    shards, _ = _convert(tmp_path / "dup", tmp_path / "root", options=Options(layers=(2, 102)))
    assert shards.metadata.layers == (2, 102)
