"""store.doctor: what is wrong with a run folder or with the configured roots, one finding a line."""

from __future__ import annotations

from pathlib import Path

import pytest

from saev_shards import store

from ...support.caches import small_metadata, write_cache


def test_a_healthy_run_has_no_error_and_a_dangling_link_is_one(root: Path, tmp_path: Path) -> None:
    md = small_metadata(n_examples=3)
    write_cache(root, md)
    run = store.create_run(md.hash, run_id="r", runs_root=tmp_path / "runs", roots=root)
    assert [f for f in store.doctor(run) if f.level == "error"] == []
    link = run.links_dir / "train-shards"
    link.unlink()
    link.symlink_to(tmp_path / "gone")
    errors = [f for f in store.doctor(run) if f.level == "error"]
    assert len(errors) == 1 and "train-shards" in errors[0].subject + errors[0].message


def test_doctor_environment_checks_each_configured_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAEV_SHARDS_ROOT", str(tmp_path / "missing"))
    findings = store.doctor_environment()
    about = [f for f in findings if str(tmp_path / "missing") in f.subject + f.message]
    assert about and {f.level for f in about} & {"warning", "error"}
    (tmp_path / "missing").mkdir()
    about = [f for f in store.doctor_environment() if str(tmp_path / "missing") in f.subject + f.message]
    assert about and {f.level for f in about} <= {"ok", "note"}
