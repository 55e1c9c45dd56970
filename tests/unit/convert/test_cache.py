"""``convert --to saev|3.0`` of caches: saev's code's dialect both ways (protocol.md section 9)."""

from __future__ import annotations

import base64
import pickle
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

import saev_shards as ss
from saev_shards.convert import Options, convert
from saev_shards.errors import ConvertOptionError, SourceChecksumError

from ...support.caches import small_metadata, tree_bytes, write_cache

DATA = Path(__file__).resolve().parents[2] / "data"
PARTIAL = DATA / "saev-code-partial" / "saev" / "shards" / "e2f8cd3a"
EXACT = DATA / "saev-code-exact" / "saev" / "shards" / "3a3c1749"


def open_quiet(path: Path) -> ss.Shards:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ss.ProtocolWarning)
        return ss.open(path)


@pytest.mark.parametrize("source", [PARTIAL, EXACT])
def test_saev_to_3_and_back_gives_the_original_bytes(tmp_path: Path, source: Path) -> None:
    v3 = convert(source, root=tmp_path / "v3", durable=False)
    shards = ss.open(v3.path)
    assert (shards.metadata.protocol, shards.metadata.dtype) == (ss.PROTOCOL, "float32")  # the source's dtype kept
    assert shards.metadata.data == {
        "saev": {
            "data": open_quiet(source).metadata.data,
            "pixel_agg": "majority",
            "protocol": "2.1",
            "dialect": "saev",
        }
    }
    np.testing.assert_array_equal(shards[:], open_quiet(source)[:])
    back = convert(v3.path, to="saev", root=tmp_path / "saev" / "shards", durable=False)
    assert back.path.name == source.name
    ours = tree_bytes(back.path)
    assert ours.pop("checksums.json")
    assert ours == tree_bytes(source)


def test_float16_to_saev_and_back_keeps_the_float16_values(tmp_path: Path) -> None:
    md = small_metadata(n_examples=9, dtype="float16", family="clip")
    lengths = np.full(md.n_examples, md.tokens_per_ex, np.int32)
    write_cache(tmp_path / "src", md, labels=True, lengths=lengths, text=True, stats=True)
    source = ss.open(tmp_path / "src" / md.hash)
    saev = convert(source.path, to="saev", root=tmp_path / "saev" / "shards", durable=False)
    lines = saev.report.lines()
    assert any("float16 activations widened to float32" in line for line in lines)
    assert any("column lengths" in line and "text prompt" in line for line in lines)
    assert any("stats.json" in line for line in lines)
    assert any("base64 of its pickle" in line for line in lines)
    widened = open_quiet(saev.path)
    assert (widened.metadata.dialect, widened.dtype, len(widened.metadata.hash)) == ("saev", "float32", 8)
    np.testing.assert_array_equal(widened[:], source[:].astype(np.float32))
    assert widened.labels is not None and source.labels is not None
    np.testing.assert_array_equal(widened.labels, source.labels)
    # data (an object) is stored as saev stores its config: base64 of a pickle, here of the same object.
    assert pickle.loads(base64.b64decode(widened.metadata.data)) == md.data
    again = convert(saev.path, root=tmp_path / "v3", dtype="float16", durable=False)
    np.testing.assert_array_equal(ss.open(again.path)[:], source[:])


def test_saev_needs_a_family_it_knows(tmp_path: Path) -> None:
    md = small_metadata(n_examples=3, dtype="float32", family="vit-b")
    write_cache(tmp_path / "src", md)
    with pytest.raises(ConvertOptionError) as info:
        convert(tmp_path / "src" / md.hash, to="saev", root=tmp_path / "saev" / "shards", durable=False)
    assert str(info.value).startswith("--family: saev knows only vision model families (bird-mae, clip, ")
    assert "family 'vit-b' is not one of them" in str(info.value)
    assert str(info.value).endswith(
        "matches this cache, a [CLS] token first: --family clip (the activations are written unchanged)"
    )
    done = convert(
        tmp_path / "src" / md.hash,
        to="saev",
        root=tmp_path / "saev" / "shards",
        options=Options(family="siglip"),
        durable=False,
    )
    assert open_quiet(done.path).metadata.family == "siglip"
    with pytest.raises(ConvertOptionError, match="--dtype: target saev stores float32"):
        convert(tmp_path / "src" / md.hash, to="saev", dtype="float16", root=tmp_path / "x", durable=False)
    with pytest.raises(ConvertOptionError, match="--dtype: target saev stores float32; found 'float8_e4m3'"):
        convert(tmp_path / "src" / md.hash, to="saev", dtype="float8_e4m3", root=tmp_path / "x", durable=False)


def test_a_damaged_source_shard_is_caught_before_use(tmp_path: Path) -> None:
    md = small_metadata(n_examples=9, dtype="float32")
    write_cache(tmp_path / "src", md)
    source = tmp_path / "copy" / md.hash
    shutil.copytree(tmp_path / "src" / md.hash, source)
    shard = source / "acts000001.bin"
    shard.chmod(0o644)
    data = bytearray(shard.read_bytes())
    data[5] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(SourceChecksumError, match=r"acts000001\.bin"):
        convert(source, root=tmp_path / "out", dtype="float16", durable=False)
    assert not any(p.name == md.hash for p in (tmp_path / "out").iterdir() if not p.name.startswith("."))


def test_float16_to_float8_to_float16_is_within_the_bound(tmp_path: Path) -> None:
    """A cache to float8_e4m3 and back: every value within the rule's bound (and float16's last
    rounding); the way back is dequantized data, so it never takes the original's name."""
    md = small_metadata()
    lengths = (np.arange(md.n_examples) % md.tokens_per_ex + 1).astype(np.int32)
    logical = write_cache(tmp_path, md, labels=True, lengths=lengths, text=True, stats=True)
    f8 = ss.open(convert(tmp_path / md.hash, root=tmp_path, dtype="float8_e4m3", durable=False).path)
    assert (f8.dtype, f8.metadata.data) == ("float8_e4m3", md.data)
    assert list(f8.text["prompt"]) == list(ss.open(tmp_path / md.hash).text["prompt"])
    back = convert(f8.path, root=tmp_path, dtype="float16", durable=False)
    assert not back.already_published and back.path.name != md.hash
    f16 = ss.open(back.path)
    assert f16.metadata.data == {"dequantized_from": {"cache": f8.metadata.hash, "dtype": "float8_e4m3"},
                                 "source_data": md.data}  # fmt: skip
    x = logical.astype(np.float32)
    q, scales = ss.codecs.float8.quantize_numpy(x)
    np.testing.assert_array_equal(f16[:], ss.codecs.float8.dequantize(q, scales, "float16"))
    bound = ss.codecs.float8.error_bound(x, scales) + np.abs(x) * 2.0**-11 + 2.0**-25
    assert (np.abs(f16[:].astype(np.float64) - x) <= bound).all()
    np.testing.assert_array_equal(f16.columns["lengths"], lengths)
    # float8_e4m3 to float8_e4m3 (another shard budget): the bytes and scales copied exactly.
    resharded = ss.open(convert(f8.path, root=tmp_path / "r", patches_per_shard=30, durable=False).path)
    assert resharded.n_shards != f8.n_shards and resharded.scales is not None and f8.scales is not None
    np.testing.assert_array_equal(resharded.raw[:].view(np.uint8), f8.raw[:].view(np.uint8))
    np.testing.assert_array_equal(resharded.scales[:], f8.scales[:])
    # To protocol 3.0, which has no float8_e4m3: float16 unless said otherwise; to saev: float32.
    v30 = ss.open(convert(f8.path, root=tmp_path / "v30", to="3.0", durable=False).path)
    assert (v30.metadata.protocol, v30.dtype) == ("3.0", "float16")
    np.testing.assert_array_equal(v30[:], f16[:])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ss.ProtocolWarning)
        saev = open_quiet(convert(f8.path, root=tmp_path / "saev" / "shards", to="saev", durable=False).path)
    np.testing.assert_array_equal(saev[:], ss.codecs.float8.dequantize(q, scales, "float32"))


@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3"])
def test_a_cache_of_sites_keeps_them_and_no_target_drops_them(tmp_path: Path, dtype: str) -> None:
    """Sites say what the slots hold (protocol 3.2): converting keeps them (the result is 3.2);
    a target that cannot hold them is refused before anything is written."""
    sites = ("blocks.1.mlp:input", "blocks.1.mlp:output")
    md = small_metadata(n_examples=5, layers=(0, 1), sites=sites, dtype="float16")
    write_cache(tmp_path / "src", md)
    converted = ss.open(convert(tmp_path / "src" / md.hash, root=tmp_path / "out", dtype=dtype, durable=False).path)
    assert converted.metadata.protocol == "3.2" and [str(s) for s in converted.metadata.sites or ()] == list(sites)
    for target in ("3.0", "saev"):
        with pytest.raises(ConvertOptionError, match=rf"--to {target}: this cache records what each layer slot holds"):
            convert(tmp_path / "src" / md.hash, to=target, root=tmp_path / target, durable=False)
        assert not (tmp_path / target).exists() or not any((tmp_path / target).iterdir())
