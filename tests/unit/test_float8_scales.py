"""float8_e4m3 scale files holding scales the rule cannot give, with every digest recomputed
(so the checksums pass): inf, -inf, a negative number, -0.0, a number above float32's max
over 448 (1e38: its values overflow float32 and bfloat16), NaNs of other bits, and the NaN
of a vector stored as NaN on a vector whose bytes are not NaN's. Every read path, the loaders
(host, in place and read into buffers, and the device path on the CPU), the datasets and
`verify` raise `ScaleError` naming the scale file, the vector and the scale; before the fix
float32 and bfloat16 reads gave inf silently and float16 reads sent the user to float32."""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

import saev_shards as ss
from saev_shards.cli import main
from saev_shards.codecs import float8
from saev_shards.loaders import (
    ExampleDataset,
    LayerPairDataset,
    OrderedLoader,
    ShuffledLoader,
    TokenDataset,
    mapped,
    windows,
)

from ..support.caches import small_metadata

#: The damaged vector: example 7 (shard 1, its third example), layer 11 (position 1), token 2.
EXAMPLE, LAYER, POSITION, TOKEN = 7, 11, 1, 2
SHARD, VECTOR = 1, (2 * 2 + 1) * 5 + 2


def _bits(value: int) -> np.float32:
    return np.float32(np.array([value], np.uint32).view(np.float32)[0])


#: Scales the rule never gives, as the float32 written.
BAD = {
    "inf": np.float32(np.inf),
    "-inf": np.float32(-np.inf),
    "negative": np.float32(-2.5),
    "negative zero": np.float32(-0.0),
    "1e38": np.float32(1e38),
    "just above the largest": np.nextafter(float8.MAX_SCALE, np.float32(np.inf)),
    "NaN of other bits": _bits(0x7FC00001),
    "negative NaN": _bits(0xFFC00000),
    "NaN on a finite vector": _bits(float8.NAN_SCALE_BITS),
}
FOUND = {
    "inf": r"scale inf",
    "-inf": r"scale -inf",
    "negative": r"scale -2\.5 \(negative\)",
    "negative zero": r"scale -0\.0 \(negative zero\)",
    "1e38": r"scale 1e\+38 \(above 7\.595588e\+35\)",
    "just above the largest": r"scale 7\.595589e\+35 \(above 7\.595588e\+35\)",
    "NaN of other bits": r"scale NaN 0x7fc00001",
    "negative NaN": r"scale NaN 0xffc00000",
    "NaN on a finite vector": r"scale NaN 0x7fc00000, the scale of a vector stored as NaN, but the vector's bytes",
}


def rewrite(cache: Path, name: str, data: bytes) -> None:
    """Replace data file ``name`` of a published cache and recompute every digest that covers
    it (shards.json's, blocks.json's, and blocks.json's own): what a careful attacker, or a
    tool that "repairs" checksums, leaves behind."""
    for entry in (cache / name, cache / "shards.json", cache / "blocks.json"):
        os.chmod(entry, stat.S_IRUSR | stat.S_IWUSR)
    (cache / name).write_bytes(data)
    blocks = json.loads((cache / "blocks.json").read_text())
    size = blocks["block_size"]
    blocks["files"][name] = [xxhash.xxh3_128_hexdigest(data[i : i + size]) for i in range(0, len(data), size)]
    blocks_bytes = json.dumps(blocks, indent=2).encode()
    (cache / "blocks.json").write_bytes(blocks_bytes)
    manifest = json.loads((cache / "shards.json").read_text())
    for entry in (*manifest["shards"], *manifest["scales"]):
        if entry["name"] == name:
            entry["xxh3_128"] = xxhash.xxh3_128_hexdigest(data)
    manifest["blocks"].update(nbytes=len(blocks_bytes), xxh3_128=xxhash.xxh3_128_hexdigest(blocks_bytes))
    (cache / "shards.json").write_text(json.dumps(manifest))


def set_scale(cache: Path, value: np.float32, shard: int = SHARD, vector: int = VECTOR) -> None:
    name = f"scales{shard:06d}.bin"
    data = bytearray((cache / name).read_bytes())
    data[4 * vector : 4 * vector + 4] = np.array([value], np.float32).tobytes()
    rewrite(cache, name, bytes(data))


@pytest.fixture
def cache8(tmp_path: Path) -> Path:
    md = small_metadata(dtype="float8_e4m3")  # 23 examples (5 per shard) x layers (6, 11) x 5 tokens x 8
    x = np.random.default_rng(0).standard_normal(md.shape).astype(np.float32)
    with ss.ShardWriter(tmp_path, md, durable=False) as w:
        w.write(x)
    return tmp_path / md.hash


def message(cache: Path, case: str) -> str:
    where = re.escape(str(cache / f"scales{SHARD:06d}.bin"))
    return rf"{where}: vector {VECTOR} \(example {EXAMPLE}, layer {LAYER}, token {TOKEN}\): {FOUND[case]}"


READS: dict[str, Callable[[ss.Shards, str], Any]] = {
    "shards[i]": lambda sh, dt: sh.with_dtype(dt)[EXAMPLE],
    "shards[:, l]": lambda sh, dt: sh.with_dtype(dt)[:, POSITION],
    "shards[[i], l, t, :3]": lambda sh, dt: sh.with_dtype(dt)[[3, EXAMPLE], POSITION, TOKEN, :3],
    "example": lambda sh, dt: sh.example(EXAMPLE, LAYER, dtype=dt),
    "get": lambda sh, dt: sh.get(EXAMPLE, LAYER, TOKEN, dtype=dt),
    "read_example": lambda sh, dt: sh.read_example(EXAMPLE, POSITION, dtype=dt),
    "read_range": lambda sh, dt: sh.read_range(5, 10, dtype=dt),
    "read_vectors": lambda sh, dt: sh.read_vectors([0, EXAMPLE], [0, POSITION], [1, TOKEN], dtype=dt),
    "read_examples": lambda sh, dt: sh.read_examples([EXAMPLE], [POSITION], dtype=dt),
    "read_example_scales": lambda sh, dt: sh.read_example_scales(EXAMPLE, POSITION),
    "read_range_scales": lambda sh, dt: sh.read_range_scales(0, 23),
    "read_vectors_scales": lambda sh, dt: sh.read_vectors_scales([EXAMPLE], [POSITION], [TOKEN]),
    "to_dask": lambda sh, dt: sh.to_dask(dtype=dt).compute(),
}


@pytest.mark.parametrize("case", list(BAD))
def test_every_read_path_names_the_shard_and_vector(cache8: Path, case: str) -> None:
    set_scale(cache8, BAD[case])
    shards = ss.open(cache8)
    for name, read in READS.items():
        if name == "to_dask":
            pytest.importorskip("dask")
        for dtype in ("float16", "float32", "bfloat16"):
            with pytest.raises(ss.ScaleError, match=message(cache8, case)) as info:
                read(shards, dtype)
            assert "read them as float32" not in str(info.value), name  # not a range problem: the cache is damaged
            assert isinstance(info.value, ss.InvalidCacheError)
    # What does not hold the damaged vector reads as written.
    assert np.isfinite(shards.with_dtype("float32")[EXAMPLE, 0]).all()
    assert np.isfinite(shards.read_range(0, 5, dtype="float32")).all()
    assert np.isfinite(shards.read_example(EXAMPLE, 0, dtype="float32")).all()
    # The stored scales themselves stay readable as they are (raw access, like Shards.raw).
    assert shards.scales is not None
    assert shards.scales[EXAMPLE, POSITION, TOKEN].tobytes() == np.array([BAD[case]], np.float32).tobytes()


@pytest.mark.parametrize("case", ["inf", "1e38", "negative", "NaN on a finite vector"])
def test_verify_names_every_damaged_scale(cache8: Path, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    set_scale(cache8, BAD[case])
    set_scale(cache8, BAD[case], shard=4, vector=0)
    with pytest.raises(ss.ScaleError, match=message(cache8, case)) as info:
        ss.open(cache8).verify()
    assert len(info.value.problems) == 2  # one per damaged scale file
    assert str(cache8 / "scales000004.bin") in str(info.value)
    assert main(["verify", str(cache8)]) == 1
    assert f"vector {VECTOR} (example {EXAMPLE}, layer {LAYER}, token {TOKEN})" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["inf", "1e38", "NaN on a finite vector"])
@pytest.mark.parametrize("out_dtype", [None, "float32", "bfloat16"])
def test_the_loaders_and_datasets_name_the_shard_and_vector(
    cache8: Path, case: str, out_dtype: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_scale(cache8, BAD[case])
    shards = ss.open(cache8)
    kwargs: dict[str, Any] = dict(batch_size=4, layers=LAYER, out_dtype=out_dtype, block_bytes=64, buffer_bytes=400)
    in_place: list[bool] = []
    real = windows.WindowLoader.submit

    def submit(self: windows.WindowLoader, w: int) -> Any:
        done = real(self, w)
        in_place.append(self.in_place[w])
        return done

    monkeypatch.setattr(windows.WindowLoader, "submit", submit)
    for make in (ShuffledLoader, OrderedLoader):
        for device, mapped_bytes in ((None, 0), (None, 1 << 62), ("cpu", 0)):
            # Windows gathered in place from the page cache (the host path of a local cache whose
            # shards are large enough), or read into buffers (the device path always).
            monkeypatch.setattr(mapped, "MIN_SHARD_BYTES", mapped_bytes)
            with pytest.raises(ss.ScaleError, match=message(cache8, case)):
                list(make(shards, device=device, **kwargs))
    assert True in in_place and False in in_place
    with pytest.raises(ss.ScaleError, match=message(cache8, case)):
        ds = TokenDataset(shards, layer=LAYER, tokens="all", out_dtype=out_dtype)
        [ds[i] for i in range(len(ds))]
    with pytest.raises(ss.ScaleError, match=message(cache8, case)):
        ExampleDataset(shards, layers=LAYER, out_dtype=out_dtype)[EXAMPLE]
    with pytest.raises(ss.ScaleError, match=message(cache8, case)):
        LayerPairDataset(shards, out_dtype=out_dtype)[EXAMPLE]


def test_the_largest_scale_the_rule_gives_is_read(cache8: Path) -> None:
    """`MAX_SCALE` (a vector of float32's largest values) reads as float32's largest value; float16
    and bfloat16 cannot hold it (`DtypeRangeError` naming float32), as float8 gives inf nowhere."""
    set_scale(cache8, float8.MAX_SCALE)
    shards = ss.open(cache8)
    assert shards.verify() > 0
    values = shards.get(EXAMPLE, LAYER, TOKEN, dtype="float32")
    assert np.isfinite(values).all() and np.abs(values).max() <= np.finfo(np.float32).max
    for dtype in ("float16", "bfloat16"):
        with pytest.raises(ss.DtypeRangeError, match=rf"do not fit {dtype}.*read them as float32"):
            shards.get(EXAMPLE, LAYER, TOKEN, dtype=dtype)
        for device in (None, "cpu"):
            with pytest.raises(ss.DtypeRangeError, match=rf"do not fit {dtype}"):
                list(ShuffledLoader(shards, batch_size=4, layers=LAYER, out_dtype=dtype, device=device))
    batches = list(ShuffledLoader(shards, batch_size=4, layers=LAYER, out_dtype="float32"))
    assert all(b.acts.isfinite().all() for b in batches)


def test_a_vector_stored_as_nan_is_valid(tmp_path: Path) -> None:
    """The NaN scale with bytes 0x7F is rule 2's vector stored as NaN (allow_nonfinite): it reads as
    NaN everywhere, and `verify` passes."""
    md = small_metadata(dtype="float8_e4m3", n_examples=6)
    x = np.ones(md.shape, np.float32)
    x[4, 1, 2, 3] = np.nan
    with ss.ShardWriter(tmp_path, md, durable=False, allow_nonfinite=True) as w:
        w.write(x)
    shards = ss.open(tmp_path / md.hash)
    assert shards.verify() > 0
    assert np.isnan(shards[4, 1, 2]).all() and np.isnan(shards.read_range(4, 5, dtype="float32")[0, 1, 2]).all()
    assert np.isnan(shards.read_vectors_scales([4], [1], [2])).all()


def test_dequantize_refuses_such_scales_without_a_cache() -> None:
    """`float8.dequantize` of scales given by hand: the same rule, positions instead of a shard."""
    q = np.full((3, 4), 0x38, np.uint8).view(float8.FLOAT8_DTYPE)
    for dtype in ("float16", "float32", "bfloat16"):
        with pytest.raises(ss.ScaleError, match=r"found inf at position 1 of 3"):
            float8.dequantize(q, np.array([1, np.inf, 2], np.float32), dtype)
    assert np.isfinite(float8.dequantize(q, np.array([1, 0, float8.MAX_SCALE], np.float32), "float32")).all()


@pytest.mark.parametrize("case", list(BAD))
def test_the_writer_refuses_such_scales(tmp_path: Path, case: str) -> None:
    """Quantized values written with their scales (`ShardWriter.write(..., scales=)`, as convert and
    the shuffle copy a float8_e4m3 source): the same rule as the readers'. Before the fix 1e38,
    -0.0, other NaNs and a NaN scale on finite bytes were written, and read back as inf or NaN."""
    md = small_metadata(dtype="float8_e4m3", n_examples=3)
    q, s = float8.quantize(np.ones(md.shape, np.float32))
    s[1, 0, 3] = BAD[case]
    writer = ss.ShardWriter(tmp_path, md, durable=False, allow_nonfinite=True)
    with pytest.raises(ss.WriterError, match=r"scales: .*(\(1, 0, 3\)|0x7f)"):
        writer.write(q, scales=s)
    writer.abort()
    assert not (tmp_path / md.hash).exists()
