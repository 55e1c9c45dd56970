"""convert.base: what every source kind shares: the options, field names and column dtypes,
token counts and layers, and checksums named in a source's index."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from saev_shards.convert import base
from saev_shards.errors import ConvertError, ConvertOptionError
from saev_shards.protocol.common import FIELD_NAME_RE


@given(st.text(max_size=80))
def test_field_names_are_valid_or_none(raw: str) -> None:
    name = base.field_name(raw)
    assert name is None or FIELD_NAME_RE.fullmatch(name)


def test_field_names_of_common_keys() -> None:
    assert base.field_name("Prompt Len") == "prompt_len"
    assert base.field_name("3d") == "f_3d"
    assert base.field_name("---") is None


@pytest.mark.parametrize(
    ("dtype", "column"), [(">i4", "<i4"), ("<f8", "<f8"), ("|b1", "|b1"), ("<c8", None), ("<U3", None), ("<f2", "<f2")]
)
def test_column_dtypes_are_little_endian_numbers(dtype: str, column: str | None) -> None:
    got = base.column_dtype(np.dtype(dtype))
    assert (got.str if got is not None else None) == column


@given(st.integers(1, 6), st.integers(1, 6))
def test_fit_tokens_cuts_or_pads_with_zeros(have: int, tokens: int) -> None:
    acts = np.arange(2 * 1 * have * 3, dtype=np.float32).reshape(2, 1, have, 3) + 1
    out = base.fit_tokens(acts, tokens)
    assert out.shape == (2, 1, tokens, 3)
    keep = min(have, tokens)
    np.testing.assert_array_equal(out[:, :, :keep], acts[:, :, :keep])
    assert (out[:, :, keep:] == 0).all()


def test_layers_and_tokens_come_from_the_options_first() -> None:
    assert base.pick_layers([4, 7], 2, base.Options(), "the source") == (4, 7)
    assert base.pick_layers(None, 3, base.Options(), "the source") == (0, 1, 2)
    assert base.pick_layers([4, 7], 2, base.Options(layers=(1, 2)), "the source") == (1, 2)
    with pytest.raises(ConvertOptionError, match=r"--layers: expected 2 layer numbers \(the source has 2 layers\)"):
        base.pick_layers(None, 2, base.Options(layers=(1,)), "the source")
    assert base.token_count(12, base.Options()) == 12 and base.token_count(0, base.Options()) == 1
    assert base.token_count(12, base.Options(max_tokens=5)) == 5


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(max_tokens=0), "max_tokens: expected a positive number of tokens"),
        (dict(layers=(1, 1)), "layers: expected distinct layer numbers"),
        (dict(layers=("a",)), "layers: expected integers"),
        (dict(memory_bytes=10), "memory_bytes"),
    ],
)
def test_bad_options_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConvertOptionError, match=message):
        base.Options(**options)


def test_checksums_name_a_known_algorithm_and_its_digits() -> None:
    digest = hashlib.sha256(b"x").hexdigest()
    assert base.parse_checksum(f"SHA256:{digest.upper()}", "index") == ("sha256", digest)
    assert base.parse_checksum(None, "index") is None
    with pytest.raises(ConvertError, match="index: expected a checksum like 'sha256:<hex digits>'"):
        base.parse_checksum(digest, "index")
    with pytest.raises(ConvertError, match="index: unknown checksum algorithm 'crc32'"):
        base.parse_checksum("crc32:abcd", "index")
    with pytest.raises(ConvertError, match="index: expected 64 hex digits after 'sha256:'"):
        base.parse_checksum("sha256:abc", "index")
