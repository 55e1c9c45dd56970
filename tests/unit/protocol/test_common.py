"""protocol.common: the names of a cache's files and the size limits of its JSON files."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from saev_shards.protocol import common


@given(st.integers(0, 999_999))
def test_shard_and_scales_names_are_six_digits_and_parse_back(index: int) -> None:
    name, scales = common.shard_name(index), common.scales_name(index)
    assert name == f"acts{index:06d}.bin" and scales == f"scales{index:06d}.bin"
    for pattern, file in ((common.SHARD_NAME_RE, name), (common.SCALES_NAME_RE, scales)):
        match = pattern.fullmatch(file)
        assert match is not None and int(match.group(1)) == index


@pytest.mark.parametrize("index", [-1, 1_000_000])
def test_an_index_beyond_six_digits_has_no_name(index: int) -> None:
    with pytest.raises(ValueError, match=f"shard index {index} does not fit the 6-digit name acts"):
        common.shard_name(index)
    with pytest.raises(ValueError, match=f"shard index {index} does not fit the 6-digit name scales"):
        common.scales_name(index)


def test_column_and_text_files() -> None:
    assert common.column_file("lengths") == "column.lengths.bin"
    assert common.text_file("prompt") == "text.prompt.jsonl"


@given(st.integers(0, 1 << 40), st.integers(1, 1 << 30))
def test_n_blocks_is_the_ceiling_of_the_division(nbytes: int, block_size: int) -> None:
    n = common.n_blocks(nbytes, block_size)
    assert (n - 1) * block_size < nbytes <= n * block_size or (n == 0 and nbytes == 0)


@given(st.integers(0, 10**6), st.integers(1, 3), st.lists(st.integers(0, 1 << 36), max_size=5))
def test_the_json_limits_grow_with_what_they_list(n_shards: int, per_shard: int, sizes: list[int]) -> None:
    assert common.manifest_max_bytes(n_shards + 1, per_shard) > common.manifest_max_bytes(n_shards, per_shard)
    assert common.manifest_max_bytes(n_shards, per_shard) >= common.JSON_SLACK_BYTES
    # every digest of blocks.json at the smallest block size fits
    digests = sum(common.n_blocks(n, common.MIN_BLOCK_SIZE) for n in sizes)
    assert common.blocks_max_bytes(sizes) >= common.JSON_SLACK_BYTES + 36 * digests
    assert common.blocks_max_bytes([*sizes, 1]) > common.blocks_max_bytes(sizes)


def test_stats_limit_counts_two_numbers_per_dimension_and_four_per_layer() -> None:
    assert common.stats_max_bytes(2, 8) - common.JSON_SLACK_BYTES == common.STATS_BYTES_PER_NUMBER * (2 * 2 * 8 + 4 * 2)


def test_every_protocol_a_cache_may_name_is_known() -> None:
    assert common.PROTOCOL in common.SUPPORTED_PROTOCOLS
    assert common.UNVERSIONED in common.METADATA_PROTOCOLS and common.UNVERSIONED not in common.SUPPORTED_PROTOCOLS
    assert set(common.DTYPES_BY_PROTOCOL) == set(common.METADATA_PROTOCOLS)
    assert common.DEFAULT_DTYPE in common.DTYPES
    for dtypes in common.DTYPES_BY_PROTOCOL.values():
        assert set(dtypes) <= set(common.DTYPES)
    assert common.MIN_BLOCK_SIZE <= common.BLOCK_SIZE <= common.MAX_BLOCK_SIZE
