"""Races: two processes on one hash, in every timing, publish exactly one correct cache; the
other gets a documented error (`WriterBusyError`, `AlreadyPublishedError`), never an
`OSError`, never a half-published cache.

Process A is stopped at one of its named points (before the lock, holding it while
writing, at each step of finalize, after the rename) while process B runs start to end
(or to its own pause); then A goes on. `make test` runs a sample; the slow suite every
pause point of A (a writer, or `finalize` after two ranks) against every kind of B (a
fresh writer, a resuming writer, `finalize`, one of two ranks).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

import saev_shards as ss
from saev_shards import fileio
from saev_shards.shuffle import plan_shuffle, run_plan

from ..support.caches import small_metadata, write_cache
from ..support.faults import (
    Child,
    Outcome,
    Pause,
    assert_nothing_partial,
    assert_published_once,
    clean_tree,
    fault_metadata,
    finalize_run,
    record_points,
    write_rank,
    write_run,
)

MD = fault_metadata()
#: What the loser of a race may get: refused while the other holds the lock, or too late.
LOSING = {"WriterBusyError", "AlreadyPublishedError"}


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    return clean_tree(tmp_path_factory.mktemp("clean"), MD)


def b_fresh(root: Path) -> str:
    return write_run(root, MD, resume=False)


def b_resume(root: Path) -> str:
    return write_run(root, MD, resume=True)


def b_finalize(root: Path) -> str:
    return finalize_run(root, MD)


def b_rank(root: Path) -> str:
    return write_rank(root, MD, 0, 2)


B_KINDS: dict[str, Callable[[Path], str]] = {
    "fresh": b_fresh,
    "resume": b_resume,
    "finalize": b_finalize,
    "rank": b_rank,
}


def a_single(root: Path) -> str:
    return write_run(root, MD, resume=False)


def a_finalize(root: Path) -> str:
    return finalize_run(root, MD)


def two_ranks_written(root: Path) -> None:
    for rank in (0, 1):
        write_rank(root, MD, rank, 2)


#: What A runs, and what must be on disk before it starts.
A_KINDS: dict[str, tuple[Callable[[Path], str], Callable[[Path], None] | None]] = {
    "single": (a_single, None),
    "finalize": (a_finalize, two_ranks_written),
}


def a_points(tmp: Path, a_kind: str) -> list[tuple[str, int]]:
    run, prepare = A_KINDS[a_kind]
    root = tmp / f"points-{a_kind}"
    if prepare is not None:
        prepare(root)
    return record_points(lambda: run(root))


def race(tmp: Path, a_kind: str, n: int, b_kind: str, b_pause: int | None = None) -> tuple[Outcome, Outcome, str]:
    """A stops at its n-th point; B runs (stopping at its own ``b_pause``-th point, if given,
    while A goes on); returns both outcomes and where A stood."""
    root = tmp / "root"
    run_a, prepare = A_KINDS[a_kind]
    if prepare is not None:
        prepare(root)
    pause_a = Pause(tmp / "a", n)
    a = Child(run_a, root, hook=pause_a)
    assert pause_a.wait_reached(a), f"A ended before its point {n}: {a.wait()}"
    where = pause_a.reached_file.read_text()
    if b_pause is None:
        b_out = Child(B_KINDS[b_kind], root).wait()
        pause_a.release()
        a_out = a.wait()
    else:
        pause_b = Pause(tmp / "b", b_pause)
        b = Child(B_KINDS[b_kind], root, hook=pause_b)
        b_stopped = pause_b.wait_reached(b)
        pause_a.release()
        a_out = a.wait()
        if b_stopped:
            pause_b.release()
        b_out = b.wait()
    return a_out, b_out, where


def check(root: Path, a_out: Outcome, b_out: Outcome, b_kind: str, expected: dict[str, bytes], what: str) -> None:
    outcomes = {"A": a_out, "B": b_out}
    try:
        assert_nothing_partial(root, MD)
    except Exception as err:
        raise AssertionError(f"{what}: a broken cache was published ({outcomes}): {err}") from err
    published = [who for who, o in outcomes.items() if o.kind == "ok" and o.detail == str(root / MD.hash)]
    assert len(published) == 1, f"{what}: expected exactly one publisher, found {outcomes}"
    loser = outcomes["B" if published == ["A"] else "A"]
    allowed = set(LOSING)
    if loser is b_out and b_kind == "finalize":
        allowed.add("WriterError")  # nothing (complete) to finalize yet: A had not written it
    if loser is b_out and b_kind == "rank":
        allowed.add("ok")  # wrote its shards before A started afresh; publishes nothing
    assert loser.kind in allowed, f"{what}: the other process ended with {loser}"
    if loser.kind == "WriterError":
        assert "nothing to finalize" in loser.detail or "incomplete" in loser.detail, loser
    assert_published_once(root, MD, expected)


# A writer stopped before the lock, while writing, in finalize before and after its commit
# point (the moment that once let a second writer empty the staging folder) and after the
# rename; B a fresh writer (the reported race) or `finalize`.
SAMPLE = [
    ("writer-start", -1, "fresh"),
    ("record-written", 4, "fresh"),
    ("staging-cleaned", -1, "fresh"),
    ("publish-frozen", -1, "finalize"),
    ("published", -1, "resume"),
]


@pytest.mark.parametrize(("name", "index", "b_kind"), SAMPLE, ids=[f"{n}-{b}" for n, _, b in SAMPLE])
def test_two_writers_on_one_hash(
    tmp_path: Path, name: str, index: int, b_kind: str, expected: dict[str, bytes]
) -> None:
    points = a_points(tmp_path, "single")
    n = points.index((name, index)) + 1
    a_out, b_out, where = race(tmp_path / "race", "single", n, b_kind)
    check(tmp_path / "race" / "root", a_out, b_out, b_kind, expected, f"A at {where}, B {b_kind}")


def test_a_writer_starting_while_another_publishes_cannot_break_it(tmp_path: Path, expected: dict[str, bytes]) -> None:
    """The reported race: A has removed its part files and is about to rename; B starts
    afresh and stops after sealing its first shard; A publishes; B goes on. Before the fix
    B emptied A's staging folder (A published 0 of 12 shards and a stray .lock) and then
    failed with a raw FileNotFoundError."""
    points = a_points(tmp_path, "single")
    n = points.index(("staging-cleaned", -1)) + 1
    b_pause = points.index(("record-written", 0)) + 1
    a_out, b_out, where = race(tmp_path / "race", "single", n, "fresh", b_pause=b_pause)
    check(tmp_path / "race" / "root", a_out, b_out, "fresh", expected, f"A at {where}, B fresh")


@pytest.mark.slow
def test_every_pause_point_against_every_kind_of_second_process(tmp_path: Path, expected: dict[str, bytes]) -> None:
    failures = []
    cases = 0
    for a_kind in A_KINDS:
        points = a_points(tmp_path / a_kind, a_kind)
        # Every point outside the per-shard stream (writer start, lock, finalize, publish),
        # and a few shards' points, each against every kind of B.
        chosen = [n for n, (name, index) in enumerate(points, 1) if index < 0 or name == "joined" or index in (0, 6)]
        for n in chosen:
            for b_kind in B_KINDS:
                cases += 1
                folder = tmp_path / f"{a_kind}-{n}-{b_kind}"
                try:
                    a_out, b_out, where = race(folder, a_kind, n, b_kind)
                    check(folder / "root", a_out, b_out, b_kind, expected, f"A {a_kind} at {where}, B {b_kind}")
                except AssertionError as err:
                    failures.append(f"A {a_kind} point {n} {points[n - 1]}, B {b_kind}: {err}")
    assert cases >= 80
    assert not failures, f"{len(failures)} of {cases} races failed:\n" + "\n".join(failures)


@pytest.mark.slow
def test_second_writer_stopped_after_sealing_while_the_first_publishes(
    tmp_path: Path, expected: dict[str, bytes]
) -> None:
    """Both stopped: A at each finalize point, B (fresh) after its first sealed shard, if it
    gets that far; A goes on, then B."""
    points = a_points(tmp_path, "single")
    b_pause = points.index(("record-written", 0)) + 1
    failures = []
    start = points.index(("finalize-start", -1)) + 1
    for n in range(start, len(points) + 1):
        folder = tmp_path / f"both-{n}"
        try:
            a_out, b_out, where = race(folder, "single", n, "fresh", b_pause=b_pause)
            check(folder / "root", a_out, b_out, "fresh", expected, f"A at {where}, B fresh")
        except AssertionError as err:
            failures.append(f"A at point {n} {points[n - 1]}: {err}")
    assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------------------
# two shuffles of one source


def _shuffle_source(root: Path) -> Path:
    md = small_metadata(n_examples=40, d_model=16)
    write_cache(root, md, labels=True)
    return root / md.hash


#: Small chunks and buckets, so a shuffle writes several runs (each a `run` step).
SHUFFLE_PLAN = {"seed": 3, "n_buckets": 4, "examples_per_chunk": 7, "memory_bytes": 64 << 10}


def _shuffle(source: Path, out: Path) -> str:
    """Run the shuffle; return how many runs this process scattered, and the output's name."""
    scattered = []
    plan = plan_shuffle(source, out, **SHUFFLE_PLAN)  # type: ignore[arg-type]
    shuffled = run_plan(plan, durable=False, after_step=lambda kind, i: scattered.append(i) if kind == "run" else None)
    return f"{len(scattered)} {shuffled.path.name}"


def test_a_shuffle_that_checked_before_another_published_returns_the_published_output(tmp_path: Path) -> None:
    """The reported race: B checks "already published?" just before A publishes, and takes
    the scratch folder's lock after A removed it. Before the fix B scattered the whole
    source again, failed (`AlreadyPublishedError`) and left scratch the size of the output."""
    source = _shuffle_source(tmp_path / "src")
    out = tmp_path / "out"
    plan = plan_shuffle(source, out, **SHUFFLE_PLAN)  # type: ignore[arg-type]
    pause = Pause(tmp_path / "pause-b", 1, only="shuffle-checked")
    b = Child(_shuffle, source, out, hook=pause)
    assert pause.wait_reached(b), "B ended before its check"
    a_runs, a_name = _shuffle(source, out).split()
    assert int(a_runs) == plan.n_chunks and a_name == plan.output.hash
    assert not plan.work.exists()
    pause.release()
    outcome = b.wait()
    assert outcome.kind == "ok", outcome
    assert outcome.detail == f"0 {plan.output.hash}", "B scattered the source again"
    assert sorted(os.listdir(out)) == [plan.output.hash]  # no scratch, no staging, no lock file
    ss.open(out / plan.output.hash).verify()


def test_a_shuffle_started_while_another_holds_the_lock_is_refused_and_leaves_its_scratch(tmp_path: Path) -> None:
    """A holds the scratch folder's lock (paused after its first sealed run); B is refused
    with `WriterBusyError` and removes nothing; A then completes alone."""
    source = _shuffle_source(tmp_path / "src")
    out = tmp_path / "out"
    plan = plan_shuffle(source, out, **SHUFFLE_PLAN)  # type: ignore[arg-type]
    pause = Pause(tmp_path / "pause-a", 1, only="record-sealed")

    def a_run() -> str:
        def step(kind: str, index: int) -> None:
            if kind == "run":
                fileio.fault_point("record-sealed", index)

        return str(run_plan(plan, durable=False, after_step=step).path)

    a = Child(a_run, hook=pause)
    assert pause.wait_reached(a)
    with pytest.raises(ss.WriterBusyError, match="another process is running this shuffle"):
        run_plan(plan, durable=False)
    assert (plan.work / "run000000.json").exists()  # A's sealed run is still there
    pause.release()
    assert a.wait() == Outcome("ok", str(out / plan.output.hash))
    assert sorted(os.listdir(out)) == [plan.output.hash]
