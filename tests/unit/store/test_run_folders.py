"""store.run_folders: a training run's folder, its links to the caches, and what train and val
must share."""

from __future__ import annotations

from pathlib import Path

import pytest

import saev_shards as ss
from saev_shards import store
from saev_shards.store.run_folders import compare_caches

from ...support.caches import small_metadata, write_cache


def test_create_run_links_the_caches_and_open_run_reads_them(root: Path, tmp_path: Path) -> None:
    train, val = small_metadata(n_examples=6), small_metadata(n_examples=4)
    write_cache(root, train)
    write_cache(root, val)
    runs = tmp_path / "runs"
    run = store.create_run(train.hash[:8], val.hash, run_id="sae-1", runs_root=runs, roots=root)
    assert run.id == "sae-1"
    assert run.train_shards.resolve() == root / train.hash and run.val_shards.resolve() == root / val.hash
    assert run.checkpoint_dir.is_dir() and run.inference_root.is_dir()
    assert run.inference_dir(train.hash) == run.inference_root / train.hash
    again = store.open_run("sae-1", runs)
    assert again.open_train().metadata == train and again.open_val().metadata == val
    assert [f.level for f in store.doctor(again) if f.level == "error"] == []


def test_a_bad_run_id_is_refused(root: Path, tmp_path: Path) -> None:
    md = small_metadata(n_examples=3)
    write_cache(root, md)
    with pytest.raises(ss.RunError, match=r"bad run id '\.\./x'"):
        store.create_run(md.hash, run_id="../x", runs_root=tmp_path, roots=root)


def test_compare_caches_names_what_train_and_val_do_not_share() -> None:
    a = small_metadata()
    assert compare_caches(a, a) == ["the val cache is the train cache"]
    assert compare_caches(a, small_metadata(n_examples=5)) == []
    assert compare_caches(a, small_metadata(d_model=16, dtype="float32")) == [
        "train and val caches differ: d_model 8 vs 16; dtype 'float16' vs 'float32'"
    ]
