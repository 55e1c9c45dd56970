"""protocol.staging: the names in and around a staging directory (protocol.md section 6)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from saev_shards.protocol import staging

from ...support.caches import small_metadata


def test_the_staging_folder_and_its_lock_sit_side_by_side(tmp_path: Path) -> None:
    md = small_metadata()
    folder, lock = staging.staging_dir(tmp_path, md), staging.lock_path(tmp_path, md)
    assert folder == tmp_path / f".staging-{md.hash}"
    assert lock == tmp_path / f".staging-{md.hash}.lock"
    assert lock.parent == folder.parent


@given(st.integers(0, 999_999))
def test_a_part_record_names_its_shard(k: int) -> None:
    name = staging.part_record(k)
    assert staging.part_record_shard(name) == k
    assert staging.is_staging_only(name)


def test_other_names_are_no_part_record() -> None:
    for name in ["part1.json", "part0000003.json", "acts000003.bin", "part000003.json.tmp", "part000003.lengths.bin"]:
        assert staging.part_record_shard(name) is None


def test_part_files_of_each_stream() -> None:
    assert staging.part_file(3, staging.ACTS) == "acts000003.bin"
    assert staging.part_file(3, staging.SCALES) == "scales000003.bin"
    assert staging.part_file(3, "column.lengths") == "part000003.column.lengths.bin"
    assert staging.part_file(3, "text.prompt") == "part000003.text.prompt.jsonl"


def test_what_exists_only_while_writing() -> None:
    rank_lock = staging.range_lock(range(4, 12))
    assert rank_lock == ".shards-000004-000012.lock"
    for name in [rank_lock, ".lock", "part000001.lengths.bin", "shards.json.123.tmp", "part000000.json"]:
        assert staging.is_staging_only(name), name
    for name in ["acts000000.bin", "scales000000.bin", "shards.json", "metadata.json", "column.lengths.bin"]:
        assert not staging.is_staging_only(name), name
