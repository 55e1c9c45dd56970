"""Crashes: a writer SIGKILLed at any point never leaves a partial cache at ``<root>/<hash>``,
and resuming ends byte-identical to an uninterrupted write.

The writer runs as an unprivileged user (uid 65534) where the machine allows it: root
ignores file modes, and a kill after finalize froze the files (0444) once made resume fail
only for everyone else. `make test` kills at a sample of points; the slow suite at every
named point of a run (75) plus timed kills, and the multi-writer and finalize-alone cases.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import numpy as np
import pytest

import saev_shards as ss
from saev_shards import store
from saev_shards.protocol.staging import lock_path, staging_dir

from ..support.caches import tree_bytes
from ..support.faults import (
    Child,
    assert_nothing_partial,
    assert_published_once,
    clean_tree,
    fault_metadata,
    finalize_run,
    kill_at,
    nobody_folder,
    record_points,
    run_child,
    write_rank,
    write_run,
)

MD = fault_metadata()
#: The same cache in float8_e4m3 (protocol 3.1): scale files sealed with their shards.
MD8 = fault_metadata(dtype="float8_e4m3")


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    return clean_tree(tmp_path_factory.mktemp("clean"), MD)


@pytest.fixture(scope="module")
def points(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, int]]:
    """Every named point of one write, in order (the n-th is where kill_at(n) stops)."""
    root = tmp_path_factory.mktemp("points")
    return record_points(lambda: write_run(root, MD, resume=False))


@pytest.fixture(scope="module")
def expected8(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    return clean_tree(tmp_path_factory.mktemp("clean8"), MD8)


@pytest.fixture(scope="module")
def points8(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, int]]:
    root = tmp_path_factory.mktemp("points8")
    return record_points(lambda: write_run(root, MD8, resume=False))


def kill_and_resume(
    folder: Path, n: int, expected: dict[str, bytes], by_finalize: bool = False, md: ss.Metadata = MD
) -> str:
    """Kill a write at its n-th point, check what is published, resume, check the result.

    Returns what the resumed run did (for the failure message)."""
    MD = md
    root = folder / f"kill-{n}"
    root.mkdir()
    os.chown(root, folder.stat().st_uid, folder.stat().st_gid)
    killed = run_child(write_run, root, MD, False, hook=kill_at(n), as_nobody=True)
    assert killed.killed, f"the write was not killed at point {n}: {killed}"
    assert_nothing_partial(root, MD)
    if by_finalize:
        resumed = run_child(finalize_run, root, MD, as_nobody=True)
    else:
        resumed = run_child(write_run, root, MD, True, as_nobody=True)
    assert resumed.kind in ("ok", "AlreadyPublishedError"), f"resume after a kill at point {n}: {resumed}"
    if resumed.kind == "AlreadyPublishedError":  # killed after the rename: published and complete
        assert not staging_dir(root, MD).exists()
    assert_published_once(root, MD, expected)
    return resumed.kind


def point_number(points: list[tuple[str, int]], name: str, index: int = -1) -> int:
    return points.index((name, index)) + 1


# The fast sample: sealed shards mid-run, inside finalize before and after its commit
# point (shards.json), between the chmod and the rename (the state that broke resume for
# non-root users), and after the rename.
SAMPLE = [
    ("record-written", 5),
    ("joined", 1),
    ("blocks-written", -1),
    ("manifest-written", -1),
    ("staging-cleaned", -1),
    ("publish-frozen", -1),
    ("published", -1),
]


@pytest.mark.parametrize(("name", "index"), SAMPLE, ids=[f"{n}{'' if i < 0 else i}" for n, i in SAMPLE])
def test_kill_at_a_named_point_then_resume(
    name: str, index: int, points: list[tuple[str, int]], expected: dict[str, bytes]
) -> None:
    with nobody_folder() as folder:
        kill_and_resume(folder, point_number(points, name, index), expected)


# float8_e4m3: a shard and its scale file sealed, a scale file written before its shard's
# record, and finalize between blocks.json and shards.json.
SAMPLE8 = [("part-written", 2), ("record-written", 3), ("blocks-written", -1)]


@pytest.mark.parametrize(("name", "index"), SAMPLE8, ids=[f"{n}{'' if i < 0 else i}" for n, i in SAMPLE8])
def test_kill_a_float8_write_at_a_named_point_then_resume(
    name: str, index: int, points8: list[tuple[str, int]], expected8: dict[str, bytes]
) -> None:
    assert any(n.startswith("scales") for n in expected8)
    with nobody_folder() as folder:
        kill_and_resume(folder, point_number(points8, name, index), expected8, md=MD8)


def test_finalize_alone_completes_a_killed_finalize(points: list[tuple[str, int]], expected: dict[str, bytes]) -> None:
    """`finalize()` on its own (as a dependent job would) finishes a finalize killed
    between freezing the files and the rename."""
    with nobody_folder() as folder:
        kill_and_resume(folder, point_number(points, "publish-frozen"), expected, by_finalize=True)


def test_a_kill_after_the_rename_leaves_only_a_lock_file_that_the_next_writer_removes(
    points: list[tuple[str, int]],
) -> None:
    with nobody_folder() as folder:
        root = folder / "root"
        root.mkdir()
        os.chown(root, folder.stat().st_uid, folder.stat().st_gid)
        assert run_child(
            write_run, root, MD, False, hook=kill_at(point_number(points, "published")), as_nobody=True
        ).killed
        assert lock_path(root, MD).exists()
        ss.open(root / MD.hash).verify()
        again = run_child(write_run, root, MD, False, as_nobody=True)
        assert again.kind == "AlreadyPublishedError"
        assert sorted(os.listdir(root)) == [MD.hash]


@pytest.mark.slow
def test_kill_at_every_named_point_then_resume(points: list[tuple[str, int]], expected: dict[str, bytes]) -> None:
    """All 75 named points of a run; kills inside finalize are resumed by `finalize()` alone
    every other time, else by a writer with ``resume=True``."""
    assert len(points) >= 50
    last_record = max(i for i, (name, _) in enumerate(points) if name == "record-written") + 1
    failures = []
    with nobody_folder() as folder:
        for n in range(1, len(points) + 1):
            by_finalize = n > last_record and n % 2 == 0
            try:
                kill_and_resume(folder, n, expected, by_finalize=by_finalize)
            except AssertionError as err:
                failures.append(f"point {n} {points[n - 1]}: {err}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_kill_a_float8_write_at_every_named_point_then_resume(
    points8: list[tuple[str, int]], expected8: dict[str, bytes]
) -> None:
    """The float8_e4m3 cache at every named point of its run (scale files included)."""
    last_record = max(i for i, (name, _) in enumerate(points8) if name == "record-written") + 1
    failures = []
    with nobody_folder() as folder:
        for n in range(1, len(points8) + 1):
            try:
                kill_and_resume(folder, n, expected8, by_finalize=n > last_record and n % 2 == 0, md=MD8)
            except AssertionError as err:
                failures.append(f"point {n} {points8[n - 1]}: {err}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_timed_kills_then_resume(expected: dict[str, bytes]) -> None:
    """SIGKILL after 12 delays spread over a durable run (measured first, slowed a little
    so the kills spread over writing and finalizing): the same invariants."""
    with nobody_folder() as folder:
        t0 = time.monotonic()
        run = functools.partial(write_run, durable=True, pause=0.01)
        done = run_child(run, folder / "timing", MD, False, as_nobody=True)
        assert done.kind == "ok", done
        duration = time.monotonic() - t0
        failures = []
        for i, fraction in enumerate(np.linspace(0.05, 1.1, 12)):
            root = folder / f"timed-{i}"
            child = Child(run, root, MD, False, as_nobody=True)
            time.sleep(duration * float(fraction))
            child.process.kill()  # SIGKILL; nothing if it has finished
            child.wait()
            try:
                if root.exists():
                    assert_nothing_partial(root, MD)
                resumed = run_child(write_run, root, MD, True, as_nobody=True)
                assert resumed.kind in ("ok", "AlreadyPublishedError"), resumed
                assert_published_once(root, MD, expected)
            except AssertionError as err:
                failures.append(f"kill after {fraction:.2f} of a run: {err}")
        assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_kill_one_of_several_writers_or_their_finalize(expected: dict[str, bytes]) -> None:
    """Two ranks: rank 1 killed at each of its points (rank 0 completes), then rank 1
    resumes and `finalize` publishes; and `finalize` alone killed at each of its points,
    then run again."""
    with nobody_folder() as folder:
        rank_points = record_points(lambda: write_rank(folder / "points", MD, 1, 2))
        failures = []
        for n in range(1, len(rank_points) + 1):
            root = folder / f"rank-{n}"
            try:
                assert run_child(write_rank, root, MD, 0, 2, as_nobody=True).kind == "ok"
                assert run_child(write_rank, root, MD, 1, 2, hook=kill_at(n), as_nobody=True).killed
                assert not (root / MD.hash).exists()
                assert run_child(write_rank, root, MD, 1, 2, True, as_nobody=True).kind == "ok"
                assert run_child(finalize_run, root, MD, as_nobody=True).kind == "ok"
                assert_published_once(root, MD, expected)
            except AssertionError as err:
                failures.append(f"rank 1 killed at point {n} {rank_points[n - 1]}: {err}")
        for n in range(1, 30):  # until finalize passes fewer points than n and completes
            root = folder / f"finalize-{n}"
            try:
                for rank in (0, 1):
                    assert run_child(write_rank, root, MD, rank, 2, as_nobody=True).kind == "ok"
                killed = run_child(finalize_run, root, MD, hook=kill_at(n), as_nobody=True)
                if not killed.killed:  # fewer points than n: finalize completed
                    assert killed.kind == "ok", killed
                    break
                assert_nothing_partial(root, MD)
                again = run_child(finalize_run, root, MD, as_nobody=True)
                assert again.kind in ("ok", "AlreadyPublishedError"), again
                assert_published_once(root, MD, expected)
            except AssertionError as err:
                failures.append(f"finalize killed at point {n}: {err}")
        assert not failures, "\n".join(failures)


def stage_run(source: Path, dest: Path) -> str:
    return str(store.copy_cache(source, dest, durable=False).path)


def test_stage_killed_at_each_step_resumes(tmp_path: Path) -> None:
    """`stage` killed after copying a file, between freezing the copy and its rename, and
    after the rename; run again (as uid 65534), it completes a verified copy."""
    with nobody_folder() as folder:
        source = Path(write_run(folder / "source", MD, resume=False))
        steps = record_points(lambda: stage_run(source, tmp_path / "points"))
        chosen = [1, steps.index(("stage-copied", -1)) + 5, steps.index(("publish-frozen", -1)) + 1, len(steps)]
        for n in chosen:
            dest = folder / f"dest-{n}"
            dest.mkdir()
            os.chown(dest, folder.stat().st_uid, folder.stat().st_gid)
            assert run_child(stage_run, source, dest, hook=kill_at(n), as_nobody=True).killed, steps[n - 1]
            assert_nothing_partial(dest, MD)
            again = run_child(stage_run, source, dest, as_nobody=True)
            assert again.kind == "ok", f"stage after a kill at {steps[n - 1]}: {again}"
            assert sorted(os.listdir(dest)) == [MD.hash]
            assert tree_bytes(dest / MD.hash) == tree_bytes(source)
