"""Disk full: on a small real filesystem, the writer (shards, parts, records, joins,
statistics, manifest), `dump` and `stage` raise `DiskFullError` naming the file and the
bytes needed and free, publish nothing, and complete after space is freed. `dump` and
`stage` refuse up front, before writing anything, when the size is known not to fit.

Needs root (to mount); skipped with the reason otherwise.
"""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path
from typing import Any

import pytest

import saev_shards as ss
from saev_shards import dump as dump_mod
from saev_shards import fileio, store
from saev_shards.cli import main as cli_main
from saev_shards.protocol.staging import lock_path, staging_dir
from saev_shards.writer import direct as direct_module

from ..support.caches import small_metadata, tree_bytes, write_cache
from ..support.dumps import make_config
from ..support.faults import (
    assert_published_once,
    clean_tree,
    fault_metadata,
    fill,
    small_filesystem,
    write_run,
)

#: 6 shards of 1,024,000 bytes (50 examples of 2 layers x 5 tokens x 1024 float16).
BIG = small_metadata(n_examples=300, d_model=1024, patches_per_shard=500)
SMALL = fault_metadata()
MIB = 1 << 20
MESSAGE = (
    r"no space left on device while writing it: it needs (at least [\d,]+ bytes|[\d,]+ bytes in all), "
    r"found [\d,]+ free on its filesystem"
)


def quiet(_: str) -> None:
    pass


@pytest.fixture(scope="module")
def big_expected(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    return clean_tree(tmp_path_factory.mktemp("clean-big"), BIG)


@pytest.fixture(scope="module")
def small_expected(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    return clean_tree(tmp_path_factory.mktemp("clean-small"), SMALL)


def assert_names_file(err: ss.DiskFullError, folder: Path) -> Path:
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert err.filename is not None
    path = Path(err.filename)
    assert path.parent == folder, f"{path} is not in {folder}"
    assert re.fullmatch(rf"{re.escape(str(path))}: {MESSAGE}.*", str(err), re.S), str(err)
    return path


@pytest.mark.parametrize("kind", ["tmpfs", "ext4"])
def test_shards_fill_the_disk(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch, big_expected: dict[str, bytes]
) -> None:
    """ext4 in a loop image goes through O_DIRECT (its block shrunk to 64 KiB so 1 MB shards
    use it), tmpfs through the page cache: both name the shard and keep the sealed ones."""
    if kind == "ext4":
        monkeypatch.setattr(direct_module, "DIRECT_BLOCK", 64 << 10)
    with small_filesystem(tmp_path / "fs", 8 if kind == "tmpfs" else 16, kind) as fs:
        root = fs / "shards"
        filler = fill(fs, leave=3 * MIB)
        with pytest.raises(ss.DiskFullError) as info:
            write_run(root, BIG, resume=False)
        path = assert_names_file(info.value, staging_dir(root, BIG))
        assert "free some space and resume" in str(info.value)
        assert path.name.startswith(("acts", "part"))
        assert not (root / BIG.hash).exists()
        sealed = sorted(p.name for p in staging_dir(root, BIG).glob("part*.json"))
        assert sealed, "nothing was sealed before the disk filled up"
        filler.unlink()
        write_run(root, BIG, resume=True)
        assert_published_once(root, BIG, big_expected)


# Where the disk fills up (completely, from a test hook) and the file that cannot be written.
STEPS = [
    ("record-written", 2, "part000003.text.prompt.jsonl"),  # the rest of the batch that sealed shard 2
    ("finalize-checked", -1, "column.lengths.bin"),  # the first join
    ("joined", 2, "stats.json"),
    ("stats-written", -1, "blocks.json"),
    ("blocks-written", -1, "shards.json"),
]


@pytest.mark.parametrize(("point", "index", "culprit"), STEPS, ids=[s[0] for s in STEPS])
def test_disk_full_at_each_step_names_the_file_and_resumes(
    tmp_path: Path,
    point: str,
    index: int,
    culprit: str,
    monkeypatch: pytest.MonkeyPatch,
    small_expected: dict[str, bytes],
) -> None:
    with small_filesystem(tmp_path / "fs", 8) as fs:
        root = fs / "shards"
        fillers: list[Path] = []

        def hook(name: str, at: int) -> None:
            if (name, at) == (point, index) and not fillers:
                fillers.append(fill(fs))

        monkeypatch.setattr(fileio, "fault_hook", hook)
        with pytest.raises(ss.DiskFullError) as info:
            write_run(root, SMALL, resume=False)
        monkeypatch.setattr(fileio, "fault_hook", None)
        path = assert_names_file(info.value, staging_dir(root, SMALL))
        assert path.name == culprit
        assert not (root / SMALL.hash).exists()
        assert not list(staging_dir(root, SMALL).glob("*.tmp"))
        fillers[0].unlink()
        if point == "record-written":
            write_run(root, SMALL, resume=True)
        else:  # every shard is sealed: finalize alone completes
            ss.finalize(root, SMALL)
        assert_published_once(root, SMALL, small_expected)


def test_dump_refuses_up_front_then_names_the_file_then_resumes(tmp_path: Path, capsys: Any) -> None:
    cfg = make_config(tmp_path, n=30)
    reference = dump_mod.dump(cfg, root=tmp_path / "reference", log=quiet, progress=False)
    assert reference is not None
    with small_filesystem(tmp_path / "fs", 8) as fs:
        root = fs / "shards"
        the_plan = dump_mod.plan(cfg, weights=False)
        md = the_plan.metadata
        needed = dump_mod.space_needed(the_plan, root, 0, 1)
        assert needed > md.nbytes
        filler = fill(fs, leave=needed // 2)
        with pytest.raises(ss.DiskFullError, match=r"dumping shards \[0, 6\) of 6 needs [\d,]+ bytes, found") as info:
            dump_mod.dump(cfg, root=root, log=quiet, progress=False)
        assert "--no-space-check" in str(info.value) and info.value.needed == needed
        assert not root.exists()  # refused before writing anything
        cfg_file = tmp_path / "dump.json"
        cfg_file.write_text(json.dumps(cfg))
        assert cli_main(["dump", str(cfg_file), "--root", str(root), "--no-progress"]) == 4
        err = capsys.readouterr().err
        assert err.startswith("saev-shards: error: ") and "needs" in err and "--no-space-check" in err
        assert not root.exists()

        with pytest.raises(ss.DiskFullError) as info:
            dump_mod.dump(cfg, root=root, log=quiet, progress=False, check_space=False)
        assert_names_file(info.value, staging_dir(root, md))
        assert not (root / md.hash).exists()
        filler.unlink()
        path = dump_mod.dump(cfg, root=root, log=quiet, progress=False)
        assert path == root / md.hash
        assert tree_bytes(path) == tree_bytes(reference)
        assert sorted(p.name for p in root.iterdir()) == [md.hash]


def test_stage_refuses_up_front_then_names_the_file_then_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = Path(write_run(tmp_path / "source", BIG, resume=False))
    with small_filesystem(tmp_path / "fs", 8) as fs:
        dest = fs / "local"
        filler = fill(fs, leave=3 * MIB)
        with pytest.raises(ss.DiskFullError, match=rf"staging {re.escape(str(source))} needs [\d,]+ bytes, found"):
            store.stage(source, dest)
        assert not (dest / f".copying-{BIG.hash}").exists()  # refused before writing anything

        monkeypatch.setenv(fileio.NO_SPACE_CHECK_ENV, "1")  # the override the CLI user has
        with pytest.raises(ss.DiskFullError) as info:
            store.stage(source, dest)
        assert_names_file(info.value, dest / f".copying-{BIG.hash}")
        assert "stage again to resume" in str(info.value)
        assert not (dest / BIG.hash).exists()
        monkeypatch.delenv(fileio.NO_SPACE_CHECK_ENV)

        filler.unlink()
        report = store.copy_cache(source, dest)
        assert report.kept_files + report.resumed_files > 0
        store.open_quietly(dest / BIG.hash).verify()
        assert tree_bytes(dest / BIG.hash) == tree_bytes(source)
        assert sorted(p.name for p in dest.iterdir()) == [BIG.hash]


def test_lock_file_of_a_refused_write_is_not_left_behind(tmp_path: Path) -> None:
    """The lock file beside a staging folder goes when the cache is published, and a
    `finalize` with nothing to finalize leaves none."""
    root = tmp_path / "shards"
    root.mkdir()
    with pytest.raises(ss.WriterError, match="nothing to finalize"):
        ss.finalize(root, SMALL)
    assert not lock_path(root, SMALL).exists()


def test_shuffle_scatter_fills_the_disk_names_the_run_then_resumes(tmp_path: Path) -> None:
    """The scratch runs on a small tmpfs (``work_dir``) filled after the first sealed run:
    `DiskFullError` naming the next run file in the scratch folder, no unfinished run left,
    nothing published; after freeing space the same shuffle resumes after its sealed runs
    and writes the bytes of an uninterrupted shuffle. Before the fix: a bare
    ``OSError: [Errno 28]`` naming no file."""
    from saev_shards.shuffle import plan_shuffle, run_plan

    md = small_metadata(n_examples=60, d_model=256)  # 60 x 5 tokens x 256 float16: 150 KiB a run of 6
    write_cache(tmp_path / "src", md, labels=True)
    source = tmp_path / "src" / md.hash
    settings: dict[str, Any] = {"seed": 0, "n_buckets": 4, "examples_per_chunk": 6, "memory_bytes": 1 << 20}
    reference = run_plan(plan_shuffle(source, tmp_path / "reference", **settings), durable=False)
    with small_filesystem(tmp_path / "fs", 8) as fs:
        plan = plan_shuffle(source, tmp_path / "out", work_dir=fs, **settings)
        fillers: list[Path] = []

        def step(kind: str, index: int) -> None:
            if kind == "run" and not fillers:
                fillers.append(fill(fs))

        with pytest.raises(ss.DiskFullError) as info:
            run_plan(plan, durable=False, after_step=step)
        path = assert_names_file(info.value, plan.work)
        assert path.name.startswith("run")
        assert "run the shuffle again: it resumes after the last sealed run" in str(info.value)
        assert not plan.path.exists()
        runs = sorted(p.name for p in plan.work.glob("run*.bin"))
        records = sorted(p.name for p in plan.work.glob("run*.json"))
        assert runs and [r.removesuffix(".bin") for r in runs] == [r.removesuffix(".json") for r in records]
        assert not list(plan.work.glob("*.tmp"))
        fillers[0].unlink()
        resumed: list[int] = []

        def record(kind: str, index: int) -> None:
            if kind == "run":
                resumed.append(index)

        shuffled = run_plan(plan, durable=False, after_step=record)
        assert 0 not in resumed and resumed  # the sealed runs were kept, the rest scattered
        assert tree_bytes(shuffled.path) == tree_bytes(reference.path)
        assert not plan.work.exists()


def test_convert_refuses_up_front_then_names_the_file_then_resumes(tmp_path: Path, capsys: Any) -> None:
    """`convert` checks free space before it writes, from the plan (as dump, stage and shuffle
    do); before the fix it had no check and wrote until the disk was full."""
    from saev_shards import cli
    from saev_shards.convert import convert

    from ..support.sources import npy_source

    src = tmp_path / "acts.npy"
    npy_source(src, shape=(200, 2, 8, 512))  # 3.3 MB of float16 output
    reference = convert(src, root=tmp_path / "reference", durable=False).path
    with small_filesystem(tmp_path / "fs", 8) as fs:
        root = fs / "shards"
        filler = fill(fs, leave=2 * MIB)
        with pytest.raises(ss.DiskFullError, match=rf"converting {re.escape(str(src))} needs [\d,]+ bytes, found"):
            convert(src, root=root, durable=False)
        assert not root.exists() or not any(root.iterdir())  # refused before writing anything
        assert cli.main(["convert", str(src), "--root", str(root), "--no-progress"]) == 4
        err = capsys.readouterr().err
        assert err.startswith("saev-shards: error: ") and "--no-space-check" in err
        with pytest.raises(ss.DiskFullError) as info:
            convert(src, root=root, durable=False, check_space=False)
        md = ss.open(reference).metadata
        assert_names_file(info.value, staging_dir(root, md))
        assert not (root / md.hash).exists()
        filler.unlink()
        path = convert(src, root=root, durable=False).path
        assert tree_bytes(path) == tree_bytes(reference)
        assert sorted(p.name for p in root.iterdir()) == [md.hash]


def test_stats_on_a_full_disk_names_the_sidecar_and_leaves_nothing(tmp_path: Path) -> None:
    from saev_shards.store import compute_stats, write_sidecar

    md = small_metadata()
    with small_filesystem(tmp_path / "fs", 8) as fs:
        write_cache(fs, md)
        shards = ss.open(fs / md.hash)
        stats = compute_stats(shards)
        filler = fill(fs)
        with pytest.raises(ss.DiskFullError) as info:
            write_sidecar(shards, stats)
        assert Path(str(info.value.filename)).parent in (fs / ".stats", fs)
        assert not list((fs / ".stats").glob("*.tmp")) if (fs / ".stats").exists() else True
        filler.unlink()
        path = write_sidecar(shards, stats)
        assert path == fs / ".stats" / f"{md.hash}.json" and shards.stats is not None
