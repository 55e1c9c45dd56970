"""writer.inputs: what `ShardWriter` accepts, checked and cast in the caller's thread: shapes,
floating-point activations, non-finite values, the columns' declaration and values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import saev_shards as ss
from saev_shards.codecs.bfloat16 import float32_to_bf16

from ...support.caches import small_metadata, tree_bytes


@pytest.mark.parametrize(
    ("shape", "message"),
    [((2, 2, 5), r"expected shape \(B, 2, 5, 8\)"), ((2, 3, 5, 8), r"found \(2, 3, 5, 8\)"), ((2, 2, 5, 9), "d_model")],
)
def test_wrong_shapes(root: Path, shape: tuple[int, ...], message: str) -> None:
    w = ss.ShardWriter(root, small_metadata(), durable=False)
    with pytest.raises(ss.WriterError, match=message):
        w.write(np.zeros(shape, np.float16))
    w.abort()


def test_integer_input_is_rejected(root: Path) -> None:
    w = ss.ShardWriter(root, small_metadata(), durable=False)
    with pytest.raises(ss.WriterError, match="expected floating-point activations, found dtype int64"):
        w.write(np.zeros((1, 2, 5, 8), np.int64))
    w.abort()


def test_nonfinite_raises_with_count_and_examples(root: Path) -> None:
    md = small_metadata()
    acts = np.ones(md.shape, np.float32)
    acts[3, 0, 0, 0] = 70000.0  # above float16's 65504
    acts[12, 1, 2, 3] = -1e9
    acts[12, 1, 2, 4] = np.inf
    w = ss.ShardWriter(root, md, durable=False)
    w.write(acts[:2])
    with pytest.raises(ss.NonFiniteError) as info:
        w.write(acts[2:23])
    message = str(info.value)
    assert "3 values in 2 examples (global indices 3, 12)" in message
    assert "float16 holds at most 65504, the largest |value| was inf" in message
    assert "allow_nonfinite=True" in message
    w.abort()


def test_nonfinite_from_torch_bf16(root: Path) -> None:
    md = small_metadata(dtype="bfloat16")
    acts = torch.ones(md.shape)
    acts[5, 0, 0, 0] = float("nan")
    w = ss.ShardWriter(root, md, durable=False)
    with pytest.raises(ss.NonFiniteError, match=r"1 values in 1 examples \(global indices 5\)"):
        w.write(acts)
    w.abort()


def test_allow_nonfinite_stores_inf(root: Path) -> None:
    md = small_metadata(n_examples=1)
    acts = np.zeros(md.shape, np.float32)
    acts[0, 0, 0, 0] = 1e5
    with ss.ShardWriter(root, md, allow_nonfinite=True, durable=False) as w:
        w.write(acts)
    assert ss.open(root / md.hash).get(0, 6, 0)[0] == np.inf


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_torch_and_numpy_inputs_give_identical_bytes(tmp_path: Path, dtype: str) -> None:
    md = small_metadata(dtype=dtype)
    rng = np.random.default_rng(5)
    values = (rng.standard_normal(md.shape) * 100).astype(np.float32)
    values.flat[:6] = [0.0, -0.0, 65504.0, 1e-8, 3.0e38, -3.0e38]
    allow = dtype != "float32"
    for name, source in (("numpy", values), ("torch", torch.from_numpy(values)), ("f64", values.astype(np.float64))):
        with ss.ShardWriter(tmp_path / name, md, allow_nonfinite=allow, durable=False) as w:
            w.write(source)
    assert tree_bytes(tmp_path / "numpy" / md.hash) == tree_bytes(tmp_path / "torch" / md.hash)
    if dtype != "bfloat16":  # float64 -> bfloat16 rounds once in torch, twice via float32 in numpy
        assert tree_bytes(tmp_path / "numpy" / md.hash) == tree_bytes(tmp_path / "f64" / md.hash)


def test_bf16_rounding_matches_torch() -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.standard_normal(10_000).astype(np.float32) * 1e3,
            np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-40, 1.00390625, 1.01171875], np.float32),
            rng.integers(0, 2**32, 10_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
        ]
    )
    ours = float32_to_bf16(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(ours[~nan], theirs[~nan])
    assert np.isnan(ss.bf16_to_float32(ours[nan])).all()


def test_columns_dtype_and_shape_checks(root: Path) -> None:
    md = small_metadata()
    w = ss.ShardWriter(root, md, durable=False)
    w.write_columns(token_ids=np.zeros((2, 5), np.int32))
    with pytest.raises(ss.WriterError, match=r"column.token_ids: expected shape \(B, 5\) dtype int32"):
        w.write_columns(token_ids=np.zeros((2, 4), np.int32))
    w.write_columns(token_ids=np.ones((1, 5), np.int64))  # values fit: cast to the column's dtype
    with pytest.raises(ss.WriterError, match=r"lengths: values must lie in \[0, 5\]"):
        w.write_columns(lengths=np.array([6]))
    with pytest.raises(ss.WriterError, match="bad column/text name 'Bad-Name'"):
        w.write_columns(**{"Bad-Name": np.zeros(1)})
    with pytest.raises(ss.WriterError, match="found a string"):
        w.write_text(prompt="not a list")
    w.abort()


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        ("lengths", "columns: expected a mapping of column name -> (dtype, shape) such as {'lengths': ('int32', ())"),
        (
            {"lengths": "int32"},
            "columns['lengths']: expected (dtype, shape) such as ('int32', ()) or ('int32', (64,)), found 'int32'",
        ),
        ({"lengths": np.int32}, "columns['lengths']: expected (dtype, shape)"),
        ({"lengths": ("int32", (), 0)}, "columns['lengths']: expected (dtype, shape)"),
        ({"lengths": ("int33", ())}, "columns['lengths'] dtype: expected a numpy dtype of ['|b1', "),
        (
            {"ids": ("int32", 64)},
            "columns['ids'] shape: expected a tuple of sizes, () for one value per example, found 64",
        ),
        ({"ids": ("int32", (-1,))}, "columns['ids'] shape: expected sizes >= 0, found (-1,)"),
        ({"ids": ("complex64", ())}, "column.ids: dtype complex64 is not allowed"),
    ],
)
def test_columns_declaration_is_checked_with_a_clear_error(root: Path, columns: Any, message: str) -> None:
    """docs/dump.md's ``ShardWriter(..., columns=...)``: a wrong value once gave 'too many values to unpack'."""
    with pytest.raises(ss.WriterError) as info:
        ss.ShardWriter(root, small_metadata(), columns=columns, durable=False)
    assert message in str(info.value)
    assert not (root / small_metadata().hash).exists()


def test_columns_declared_as_documented(root: Path) -> None:
    md = small_metadata(n_examples=2)
    columns = {"lengths": ("int32", ()), "token_ids": (np.int32, [md.tokens_per_ex])}
    with ss.ShardWriter(root, md, columns=columns, durable=False) as w:
        w.write(np.zeros(md.shape, np.float16), columns={"lengths": [5, 3], "token_ids": np.ones((2, 5), np.int32)})
    shards = ss.open(root / md.hash)
    assert shards.columns["token_ids"].shape == (2, 5) and shards.columns["lengths"].tolist() == [5, 3]


def test_legacy_protocol_refuses_columns(root: Path) -> None:
    md = small_metadata(dtype="float32", protocol="2.1", data="x")
    with pytest.raises(ss.WriterError, match=r"protocol 2\.1 caches .* hold activations and labels only"):
        ss.ShardWriter(root, md, stats=True)
