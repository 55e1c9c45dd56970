"""convert.npy: a plain .npy -> cache, memory-mapped and copied exactly; bad shapes refused."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

import saev_shards as ss
from saev_shards.convert import Options, convert
from saev_shards.errors import ConvertError, ConvertOptionError

from ...support.sources import assert_converted, npy_source

pytest.importorskip("zarr")


warnings.filterwarnings("ignore", message="Consolidated metadata")


def _convert(src: Path, root: Path, **kwargs: object) -> tuple[ss.Shards, object]:
    result = convert(src, root=root, durable=False, **kwargs)
    return ss.open(result.path), result


@pytest.mark.parametrize("fortran", [False, True])
def test_npy_is_memmapped_and_copied_exactly(tmp_path: Path, fortran: bool) -> None:
    expected = npy_source(tmp_path / "acts.npy", fortran=fortran)
    shards, _ = _convert(tmp_path / "acts.npy", tmp_path / "root", dtype="float32", patches_per_shard=3 * 5 * 4)
    assert shards.n_shards == 3
    assert_converted(shards, expected, "float32")
    shards, _ = _convert(
        tmp_path / "acts.npy",
        tmp_path / "named",
        options=Options(layers=(2, 4, 6), cls_token=True, family="clip", ckpt="x"),
    )
    md = shards.metadata
    assert (md.layers, md.cls_token, md.patches_per_ex, md.family, md.ckpt) == ((2, 4, 6), True, 4, "clip", "x")


def test_npy_bad_shapes(tmp_path: Path) -> None:
    np.save(tmp_path / "three.npy", np.zeros((4, 5, 6), np.float32))
    with pytest.raises(ConvertError, match=r"expected shape \(N, L, T, D\).*np.expand_dims"):
        convert(tmp_path / "three.npy", root=tmp_path / "root")
    np.save(tmp_path / "ints.npy", np.zeros((4, 1, 5, 6), np.int32))
    with pytest.raises(ConvertError, match="expected floating-point activations, found dtype int32"):
        convert(tmp_path / "ints.npy", root=tmp_path / "root")
    npy_source(tmp_path / "ok.npy")
    with pytest.raises(ConvertOptionError, match="expected 3 layer numbers"):
        convert(tmp_path / "ok.npy", root=tmp_path / "root", options=Options(layers=(1, 2)))
