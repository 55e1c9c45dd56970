"""float8_e4m3 with a scale per vector (protocol.md section 5): the rule, its error bound, and
the two implementations (torch's cast and ml_dtypes') giving the same bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import saev_shards as ss
from saev_shards.codecs import _float8_passes, float8
from saev_shards.codecs.bfloat16 import float32_to_bf16
from saev_shards.protocol.float8 import FLOAT8_DTYPE, reference_dequantize, reference_quantize

from ...support.caches import small_metadata

#: Every finite E4M3 value (ml_dtypes'), for the reference checks.
FINITE = np.arange(256, dtype=np.uint8)[(np.arange(256) & 0x7F) != 0x7F].view(FLOAT8_DTYPE).astype(np.float32)


@st.composite
def activations(draw: st.DrawFn) -> np.ndarray[Any, np.dtype[np.float32]]:
    """Vectors of random shapes whose scales span many orders of magnitude, with zero vectors,
    values far below their vector's largest (E4M3's subnormal range after scaling), float32
    subnormals, and values that are exactly 448 times a power of two."""
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=9))
    base = draw(hnp.arrays(np.float32, shape, elements=st.floats(-1, 1, width=32)))
    vectors = int(np.prod(shape[:-1]))
    magnitude = draw(
        hnp.arrays(np.float64, (vectors,), elements=st.sampled_from([0.0, 1e-38, 1e-30, 1e-6, 1.0, 7.5, 1e4, 1e30]))
    )
    values = base.reshape(vectors, shape[-1]) * magnitude[:, None]
    kind = draw(st.sampled_from(["plain", "tiny", "at448", "subnormal32"]))
    if kind == "tiny":  # most values far below the largest: E4M3 subnormals once scaled
        values[:, 0] = magnitude
        values[:, 1:] *= 1e-4
    elif kind == "at448":  # E4M3 values, largest 448: stored exactly (scale a power of two)
        codes = draw(hnp.arrays(np.float32, values.shape, elements=st.sampled_from(FINITE.tolist())))
        codes[:, -1] = 448.0
        values = codes * np.float32(2.0) ** draw(st.integers(-20, 20))
    elif kind == "subnormal32":
        values = values * np.float32(1e-38) * np.float32(1e-3)
    out: np.ndarray[Any, np.dtype[np.float32]] = values.astype(np.float32).reshape(shape)
    return out


@given(activations())
def test_round_trip_is_within_the_bound_per_element(x: np.ndarray[Any, Any]) -> None:
    q, s = float8.quantize(x)
    assert q.dtype == FLOAT8_DTYPE and q.shape == x.shape and s.shape == x.shape[:-1] and s.dtype == np.float32
    assert np.isfinite(s).all() and (s >= 0).all()
    back = float8.dequantize(q, s, "float32")
    err = np.abs(back.astype(np.float64) - x)
    assert (err <= float8.error_bound(x, s)).all(), float(np.max(err - float8.error_bound(x, s)))
    # The rule: s = max|x| / 448 in float32, and the largest |value| of a vector is stored as 448.
    largest = np.abs(x).max(axis=-1)
    np.testing.assert_array_equal(s, largest / np.float32(448))
    stored = np.abs(q.astype(np.float32))
    normal = s >= np.float32(2.0**-126)
    assert (stored.max(axis=-1)[normal] == 448).all()
    zero = s == 0
    assert (q.view(np.uint8)[zero] == 0).all()  # all-zero vectors (or below float32's range): zeros
    # float16 and bfloat16 are the float32 values rounded once more.
    if float(np.float32(448) * (s.max() if s.size else 0)) < 65520:
        np.testing.assert_array_equal(float8.dequantize(q, s, "float16"), back.astype(np.float16))
    bf16 = ss.codecs.dtypes.convert(q, "float8_e4m3", "bfloat16", s)
    np.testing.assert_array_equal(bf16, float32_to_bf16(back))


@given(activations())
def test_torch_and_ml_dtypes_give_the_same_bytes(x: np.ndarray[Any, Any]) -> None:
    q_torch, s_torch = float8.quantize(torch.from_numpy(x.copy()))
    q_numpy, s_numpy = float8.quantize_numpy(x)
    np.testing.assert_array_equal(q_torch.view(np.uint8), q_numpy.view(np.uint8))
    np.testing.assert_array_equal(s_torch, s_numpy)
    with np.errstate(over="ignore"):  # float16 input (inf where x is too large: stored as NaN vectors)
        half = x.astype(np.float16)
    q_half, s_half = float8.quantize(torch.from_numpy(half))  # widened to float32 first
    ref_q, ref_s = float8.quantize_numpy(half)
    np.testing.assert_array_equal(q_half.view(np.uint8), ref_q.view(np.uint8))
    np.testing.assert_array_equal(s_half, ref_s)  # NaN where NaN


@given(activations(), st.sampled_from(["float32", "float16", "float64"]), st.booleans())
def test_every_engine_gives_the_bytes_of_the_rule_written_out(x: np.ndarray[Any, Any], dtype: str, nan: bool) -> None:
    """`protocol.float8.reference_quantize` (whole-array numpy, the rule as protocol.md 5 states
    it) against the engines: torch's cast, ml_dtypes' in chunks on threads, numba's kernel."""
    with np.errstate(over="ignore"):
        x = x.astype(dtype)
    if nan and x.size:
        x.reshape(-1)[x.size // 2] = np.inf if x.size % 2 else np.nan  # a vector stored as NaN
    want_q, want_s = reference_quantize(x)
    engines = {"numpy": float8.quantize_numpy(x), "torch": float8.quantize(torch.from_numpy(x.copy()))}
    engines["default"] = float8.quantize(x)  # numba's kernel where it is in use
    for engine, (q, s) in engines.items():
        np.testing.assert_array_equal(q.view(np.uint8), want_q.view(np.uint8), err_msg=engine)
        np.testing.assert_array_equal(s.view(np.uint32), want_s.view(np.uint32), err_msg=engine)  # NaN bits too


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_every_dequantizing_engine_gives_the_values_of_the_rule_written_out(dtype: str) -> None:
    """Every byte times scales across float32's range (zero, subnormal, two multiplies, NaN), by
    `protocol.float8.reference_dequantize` and by each engine, bit for bit."""
    scales = np.array([0, 2.0**-140, 3e-39, 1.5e-30, 0.37, 1, 127.99, 128, 300, 1e30, 7e35, np.nan], np.float32)
    codes = np.tile(np.arange(256, dtype=np.uint8), (len(scales), 1))
    want = reference_dequantize(codes, scales, dtype)
    with np.errstate(over="ignore"):
        got = {"default": float8.dequantize(codes, scales, dtype, checked=True)}
        with float8.numpy_only():
            got["numpy"] = float8.dequantize(codes, scales, dtype, checked=True)
        rows = np.arange(len(scales))[::-1]
        taken = np.empty((len(rows), 256), got["numpy"].dtype)
        float8.take_dequantize(codes, scales, rows, taken, dtype, checked=True)
        got["take"] = taken[::-1]
    for engine, values in got.items():
        bits = values.view(np.uint16 if values.itemsize == 2 else np.uint32)
        nan = np.isnan(want) if dtype != "bfloat16" else np.zeros(want.shape, bool)
        expected = want.view(bits.dtype)
        np.testing.assert_array_equal(bits[~nan], expected[~nan], err_msg=engine)
        assert np.isnan(values[nan]).all(), engine  # NaN of either sign where the byte is a NaN code


def test_the_reference_refuses_what_the_rule_does_not_define() -> None:
    with pytest.raises(TypeError, match="floating-point"):
        reference_quantize(np.arange(4))
    with pytest.raises(ValueError, match="dtype: expected one of"):
        reference_dequantize(np.zeros((1, 2), np.uint8), np.ones(1, np.float32), "float64")


@given(activations())
def test_dequantize_is_the_float32_product_of_ml_dtypes_values(x: np.ndarray[Any, Any]) -> None:
    """`dequantize` (either engine, chunk by chunk) computes exactly RN32(float32(q) * s)."""
    q, s = float8.quantize(x)
    reference = q.astype(np.float32) * s[..., None]
    np.testing.assert_array_equal(float8.dequantize(q, s, "float32"), reference)
    np.testing.assert_array_equal(
        float8.dequantize_elementwise(q, np.broadcast_to(s[..., None], q.shape), "float32"), reference
    )


@given(activations(), st.sampled_from(["float32", "float16", "bfloat16"]))
def test_the_rule_in_torch_ops_gives_the_host_bytes(x: np.ndarray[Any, Any], dtype: str) -> None:
    """`quantize_tensor`'s branch for a GPU (the rule in torch's ops on the tensor's device),
    run here on the CPU: the bytes and scales of the host rule, special vectors included.
    (On a GPU, tests/unit/loaders/test_cuda.py compares the two there.)"""
    specials = np.array([[0.0, -0.0], [1.0, np.nan], [np.inf, 1.0], [1e-44, 0.0], [3e-40, -2e-40]], np.float32)
    for values in (x, specials):
        t = torch.from_numpy(values.copy()).to(getattr(torch, dtype))
        q, s = _float8_passes.quantize_torch(t)
        ref_q, ref_s = float8.quantize_numpy(t.to(torch.float32).numpy())
        np.testing.assert_array_equal(q.numpy(), ref_q.view(np.uint8))
        np.testing.assert_array_equal(s.numpy().view(np.uint32), ref_s.view(np.uint32))


def test_every_byte_pair_and_odd_widths() -> None:
    codes = np.arange(65536, dtype="<u2").view(np.uint8).reshape(-1, 2)
    codes = codes[((codes & 0x7F) != 0x7F).all(axis=1)].view(FLOAT8_DTYPE)
    s = np.linspace(0.5, 2, len(codes), dtype=np.float32)
    np.testing.assert_array_equal(float8.dequantize(codes, s, "float32"), codes.astype(np.float32) * s[:, None])
    odd = codes[:999].reshape(333, 6)[:, :3].copy()  # D = 3: the single-byte table
    np.testing.assert_array_equal(float8.dequantize(odd, s[:333], "float32"), odd.astype(np.float32) * s[:333, None])


def test_special_vectors() -> None:
    x = np.array(
        [
            [0.0, -0.0, 0.0],  # zero: scale 0, bytes 0
            [448.0, -448.0, 1.0],  # scale 1: exact
            [1.0, np.nan, 2.0],  # not finite: NaN bytes, scale NaN
            [np.inf, 1.0, 2.0],
            [1e-44, -1e-44, 0.0],  # the quotient underflows: stored as zeros
            [3e-40, 1e-40, -2e-40],  # a subnormal scale: the clamp of the rule keeps it finite
        ],
        np.float32,
    )
    q, s = float8.quantize_numpy(x)
    b = q.view(np.uint8)
    assert b[0].tolist() == [0, 0, 0] and s[0] == 0 and not np.signbit(s[0])
    assert q[1].astype(np.float32).tolist() == [448.0, -448.0, 1.0] and s[1] == 1
    assert b[2].tolist() == b[3].tolist() == [0x7F] * 3 and np.isnan(s[2:4]).all()
    assert np.isnan(s[2:4].view(np.uint32) == 0x7FC00000).sum() == 0 and (s[2:4].view(np.uint32) == 0x7FC00000).all()
    assert b[4].tolist() == [0, 0, 0] and s[4] == 0
    assert 0 < s[5] < 2.0**-126 and np.isfinite(q[5].astype(np.float32)).all()
    back = float8.dequantize(q, s, "float32")
    ok = np.isfinite(s)
    assert (np.abs(back - x)[ok] <= float8.error_bound(x, s)[ok]).all()
    assert np.isnan(back[2:4]).all()
    q_t, s_t = float8.quantize(torch.from_numpy(x))
    assert q_t.view(np.uint8).tolist() == b.tolist() and np.array_equal(s_t, s, equal_nan=True)


def test_float16_overflow_is_an_error_at_the_exact_threshold() -> None:
    """A vector whose dequantized values exceed float16 raises `DtypeRangeError` (float32 and
    bfloat16 hold them); the threshold is where float16 rounds to infinity, not earlier."""
    above = np.float32(65520.0 / 448)  # the smallest scale whose 448 * s (float32) reaches 65520
    while np.float32(448) * np.nextafter(above, np.float32(0)) >= 65520:
        above = np.nextafter(above, np.float32(0))
    while np.float32(448) * above < 65520:
        above = np.nextafter(above, np.float32(1e9))
    below = np.nextafter(above, np.float32(0))
    q = np.full((2, 4), 448, np.float32).astype(FLOAT8_DTYPE)
    ok = float8.dequantize(q[:1], np.array([below], np.float32), "float16")
    assert np.isfinite(ok).all()
    with pytest.raises(ss.DtypeRangeError, match="do not fit float16") as info:
        float8.dequantize(q, np.array([below, above], np.float32), "float16")
    assert "float32" in str(info.value) and isinstance(info.value, ss.ShardsError)
    assert np.isfinite(float8.dequantize(q, np.array([below, above], np.float32), "float32")).all()


def test_nonfinite_activations_are_refused_or_stored_as_nan(tmp_path: Path) -> None:
    md = small_metadata(dtype="float8_e4m3", n_examples=3)
    x = np.ones(md.shape, np.float32)
    x[1, 0, 2, 3] = np.inf
    writer = ss.ShardWriter(tmp_path, md, durable=False)
    with pytest.raises(ss.NonFiniteError, match=r"1 values in 1 examples \(global indices 1\).*float8_e4m3") as info:
        writer.write(x)
    writer.abort()
    assert "allow_nonfinite=True" in str(info.value)
    with ss.ShardWriter(tmp_path, md, durable=False, allow_nonfinite=True, stats=True) as w:
        w.write(x)
    shards = ss.open(tmp_path / md.hash)
    assert shards.scales is not None
    assert np.isnan(shards.scales[1, 0, 2]) and np.isnan(shards[1, 0, 2]).all()
    assert np.isfinite(np.delete(shards[1, 0], 2, axis=0)).all()
    stats = shards.stats
    assert stats is not None and stats["nonfinite"].tolist() == [1, 0]


def test_the_table_is_ml_dtypes() -> None:
    assert np.dtype(ml_dtypes.float8_e4m3fn) == float8.FLOAT8_DTYPE
    assert float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max) == float8.FLOAT8_MAX == 448


def test_every_read_path_dequantizes_and_refuses_float16_overflow(tmp_path: Path) -> None:
    """Values beyond float16's range: every read into float16 (the default) raises
    `DtypeRangeError` naming float32; float32 and bfloat16 reads give them."""
    md = small_metadata(dtype="float8_e4m3", n_examples=6)
    x = np.random.default_rng(0).standard_normal(md.shape).astype(np.float32)
    x[4, 1, 2] *= 1e6  # one vector of example 4 beyond 65504
    with ss.ShardWriter(tmp_path, md, durable=False) as w:
        w.write(x)
    shards = ss.open(tmp_path / md.hash)
    wide = shards.with_dtype("float32")
    q, s = float8.quantize_numpy(x)
    want = q.astype(np.float32) * s[..., None]
    np.testing.assert_array_equal(wide[:], want)
    reads = [
        lambda sh: sh[4],
        lambda sh: sh[:, 1],
        lambda sh: sh.example(4, md.layers[1]),
        lambda sh: sh.get(4, md.layers[1], 2),
        lambda sh: sh.read_example(4, 1),
        lambda sh: sh.read_range(3, 6),
        lambda sh: sh.read_vectors([4], [1], [2]),
        lambda sh: sh.read_examples([4], [1]),
    ]
    for read in reads:
        with pytest.raises(ss.DtypeRangeError, match=r"values of up to [\d.e+]+ do not fit float16"):
            read(shards)
        assert np.isfinite(read(wide)).all()
    np.testing.assert_array_equal(shards.get(4, md.layers[1], 2, dtype="float32"), want[4, 1, 2])
    np.testing.assert_array_equal(shards.read_example(4, 1, dtype="float32"), want[4, 1])
    bf16 = shards.read_range(0, 6, dtype="bfloat16")
    np.testing.assert_array_equal(bf16, float32_to_bf16(want))
    np.testing.assert_array_equal(shards[:3], want[:3].astype(np.float16))  # the other examples fit
    assert shards.scales is not None
    np.testing.assert_array_equal(shards.scales[4, 1], s[4, 1])
    np.testing.assert_array_equal(shards.read_example_raw(4, 1).view(np.uint8), q[4, 1].view(np.uint8))
    np.testing.assert_array_equal(shards.read_example_scales(4, 1), s[4, 1])
    with pytest.raises(ValueError, match=r"dtype: expected one of \['float16', 'float32', 'bfloat16'\]"):
        shards.with_dtype("float8_e4m3")
    assert "read as float16" in repr(shards) and "read as float32" in repr(wide)
    pytest.importorskip("dask")
    np.testing.assert_array_equal(shards.to_dask(dtype="float32").compute(), want)
    with pytest.raises(ss.DtypeRangeError):
        shards.to_dask().compute()
    np.testing.assert_array_equal(shards.to_xarray(dtype="float32").values, want)
    assert shards.to_xarray().attrs["read_dtype"] == "float16"


def test_large_batches_quantized_on_several_threads_give_the_same_bytes() -> None:
    """A batch of many chunks is shared among threads: the same bytes as one thread of
    ml_dtypes, special vectors included, for float32, float16 and torch input."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3000, 768)) * 10.0 ** rng.uniform(-20, 20, (3000, 1))).astype(np.float32)
    x[5] = 0
    x[77, 3] = np.nan
    x[1500:1510] *= np.float32(1e-40)  # subnormal scales
    with np.errstate(over="ignore"):  # float16 input: inf where x is too large (stored as NaN vectors)
        half = x.astype(np.float16)
    for source in (x, half, torch.from_numpy(x)):
        q, s = float8.quantize(source)
        want_q, want_s = float8.quantize_numpy(np.asarray(source))
        np.testing.assert_array_equal(q.view(np.uint8), want_q.view(np.uint8))
        np.testing.assert_array_equal(s, want_s)


SLOW_READ = """
import sys, warnings
import numpy as np
import saev_shards as ss
from saev_shards.loaders import ShuffledLoader

if sys.argv[2] == "no-numba":
    sys.modules["numba"] = None  # what a process without the fast extra sees: ImportError
shards = ss.open(sys.argv[1])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    shards[0]
    shards[:, 0]
    for _ in ShuffledLoader(shards, batch_size=8, layers=shards.metadata.layers[0], seed=0, out_dtype="float32"):
        pass
slow = [str(w.message) for w in caught if issubclass(w.category, ss.SlowPathWarning)]
print(len(slow))
print(slow[0] if slow else "")
"""


@pytest.mark.parametrize("how", ["no-numba", "numba-off", "numba"])
def test_reading_float8_without_the_fast_extra_says_so_once(tmp_path: Path, how: str) -> None:
    """Without numba a float8 cache is dequantized with numpy, several times slower: one
    `SlowPathWarning` per process, naming the pip command; none when numba is used or turned
    off on purpose (SAEV_SHARDS_NUMBA=0)."""
    import os
    import subprocess
    import sys

    from ...support.caches import write_cache

    md = small_metadata(dtype="float8_e4m3")
    write_cache(tmp_path, md)
    env = {**os.environ, "SAEV_SHARDS_NUMBA": "0" if how == "numba-off" else "1"}
    proc = subprocess.run(
        [sys.executable, "-c", SLOW_READ, str(tmp_path / md.hash), how],
        capture_output=True, text=True, timeout=300, check=False, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    count, message = proc.stdout.splitlines()[:2] if proc.stdout.count("\n") >= 2 else (proc.stdout.strip(), "")
    if how == "no-numba":
        assert count == "1", proc.stdout
        assert "dequantized with numpy" in message and "install it with: pip install -e " in message, message
        assert "[fast]" in message, message
    else:
        assert count == "0", proc.stdout
