"""``stage`` and ``pull`` say what they did in one summary (`cli.transfer.say_copied`): the same
words for what was kept, re-copied and left unverified, whichever of the two copied."""

from __future__ import annotations

from pathlib import Path

import pytest

from saev_shards import store
from saev_shards.cli.transfer import say_copied

from ...support.caches import small_metadata, write_cache


@pytest.mark.parametrize(("verb", "already"), [("copied", "already staged"), ("downloaded", "already here")])
def test_stage_and_pull_say_the_same(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], verb: str, already: str
) -> None:
    md = small_metadata()
    write_cache(tmp_path / "shards", md)
    report = store.copy_cache(tmp_path / "shards" / md.hash, tmp_path / "copy", durable=False)
    name = md.hash[:12]
    say_copied(report, verb, already)
    out = capsys.readouterr()
    assert out.out == f"{report.path}\n"
    assert out.err.startswith(f"{name}: {verb} {report.copied_files} files (") and out.err.endswith(
        "; checksums verified\n"
    )
    report.unverified = ["acts000001.bin"]  # a cache without checksums: said so, never "verified"
    report.kept_files, report.resumed_files, report.kept_bytes = 1, 1, 2048
    say_copied(report, verb, already)
    err = capsys.readouterr().err
    assert "resumed: kept 1 complete and 1 half-written files" in err
    assert err.endswith("; 1 files had no checksum\n") and "verified\n" not in err
    report.already_there = True
    say_copied(report, verb, already)
    assert capsys.readouterr().err == f"{name}: {already}, nothing {verb}\n"
