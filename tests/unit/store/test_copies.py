"""`store.copies`: the options `stage`, `pull` and `copy_cache` share (one dataclass, also
taken as keywords), and the earlier module and report names."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from saev_shards import store
from saev_shards.store.copies import CopyKeywords, CopyOptions

from ...support.caches import small_metadata, write_cache


def test_the_keywords_are_the_options_fields() -> None:
    fields = {f.name: f.type for f in dataclasses.fields(CopyOptions)}
    assert typing.get_type_hints(CopyKeywords).keys() == fields.keys()


def test_options_and_keywords_copy_alike(tmp_path: Path) -> None:
    md = small_metadata()
    write_cache(tmp_path / "shards", md)
    source = tmp_path / "shards" / md.hash
    ticks: list[int] = []
    report = store.copy_cache(source, tmp_path / "a", options=CopyOptions(durable=False, on_bytes=ticks.append))
    assert sum(ticks) == report.copied_bytes > 0 and (tmp_path / "a" / md.hash).is_dir()
    # Keywords override the options given.
    again = store.copy_cache(source, tmp_path / "b", options=CopyOptions(durable=True), durable=False)
    assert again.copied_bytes == report.copied_bytes
    shards = store.stage(source, tmp_path / "a", durable=False)
    assert shards.path == tmp_path / "a" / md.hash
    with pytest.raises(TypeError, match="durible"):
        store.copy_cache(source, tmp_path / "c", durible=False)  # type: ignore[call-arg]


def test_earlier_names_still_import() -> None:
    from saev_shards.store import remote, runs, staging

    assert staging.StageReport is store.TransferReport is remote.PushReport
    assert remote.locate is store.find_cache is store.locate
    assert runs.Run is store.Run and staging.copy_cache is store.copy_cache
