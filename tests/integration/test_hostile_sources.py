"""Hostile conversion sources: every converter (pickle shards, zarr logs, SAELens caches,
.npy) against its catalogue of hostile sources, each case converted in a child process under
a wall-clock and a memory limit (`tests/support/hostile_sources.py`); a sample through the
command line; and, in the slow suite, random damage to every kind of source.

The rule: a cache that opens and verifies, or a `ShardsError` (on the command line an exit
code 1-4, never 5), in bounded time and memory; nothing published half-made, the source
unchanged, nothing written outside the root.
"""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest

from ..support.cli import cli_with_ctrl_c
from ..support.hostile_sources import (
    CASE_BUDGET,
    CASE_SECONDS,
    CaseOutcome,
    check_outcome,
    convert_in_child,
    run_case,
    tree_listing,
)
from ..support.source_catalogue import BASES, CATALOGUE, MAY_CONVERT, copy_source, random_damage, source_path

pytest.importorskip("zarr")
pytest.importorskip("datasets")

CASES = [(kind, name) for kind, (_, cases) in CATALOGUE.items() for name in cases]


def _run(folder: Path, kind: str, build_options: dict[str, object], name: str) -> CaseOutcome:
    src = folder / "src"
    before = tree_listing(src)
    options = {"memory_bytes": CASE_BUDGET, **build_options}
    outcome = run_case(convert_in_child, str(source_path(kind, src)), str(folder / "root"), kind, options)
    check_outcome(f"{kind}: {name}", outcome, folder, before)
    return outcome


@pytest.mark.parametrize(("kind", "name"), CASES, ids=[f"{k}: {n}" for k, n in CASES])
def test_hostile_source(tmp_path: Path, kind: str, name: str) -> None:
    build_options = CATALOGUE[kind][1][name](tmp_path / "src")
    outcome = _run(tmp_path, kind, build_options, name)
    if f"{kind}: {name}" not in MAY_CONVERT:
        assert outcome.kind != "ok", f"{kind}: {name}: converted without a word ({outcome.detail})"


@pytest.mark.parametrize("kind", list(CATALOGUE))
def test_the_valid_sources_convert(tmp_path: Path, kind: str) -> None:
    """The bases every hostile case starts from convert (so each case's damage is what fails)."""
    BASES[kind](tmp_path / "src")
    before = tree_listing(tmp_path / "src")
    options = {"memory_bytes": CASE_BUDGET}
    outcome = run_case(
        convert_in_child, str(source_path(kind, tmp_path / "src")), str(tmp_path / "root"), kind, options
    )
    assert outcome.kind == "ok", outcome
    check_outcome(kind, outcome, tmp_path, before)


def test_a_gzip_bomb_under_the_default_budget_is_a_convert_error(tmp_path: Path) -> None:
    """Without --max-memory the bomb's cap is a quarter of half the machine's memory, more than
    the child may map: running out of memory is still a `ConvertError`, not exit 5."""
    build = CATALOGUE["pickle"][1]["gzip bomb (2 MB of members expanding to 2 GB)"]
    build(tmp_path / "src")
    before = tree_listing(tmp_path / "src")
    outcome = run_case(convert_in_child, str(tmp_path / "src"), str(tmp_path / "root"), "pickle", {})
    check_outcome("gzip bomb, default budget", outcome, tmp_path, before)


#: Cases also run through `saev-shards convert` as a user would (exit code and one line).
CLI_CASES = [
    ("pickle", "a shard that is a FIFO"),
    ("pickle", "pickle: bytearray(2**34)"),
    ("pickle", "shard: layer_1 and layer_01"),
    ("zarr", "declares 10**9 samples in a few KB"),
    ("zarr", "text file that is a FIFO"),
    ("npy", "a symlink to /dev/zero"),
]


@pytest.mark.parametrize(("kind", "name"), CLI_CASES, ids=[f"{k}: {n}" for k, n in CLI_CASES])
def test_hostile_source_on_the_command_line(tmp_path: Path, kind: str, name: str) -> None:
    CATALOGUE[kind][1][name](tmp_path / "src")
    src = source_path(kind, tmp_path / "src")
    args = ["convert", str(src), "--root", str(tmp_path / "root"), "--max-memory", "256M", "--no-progress"]
    done = subprocess.run(
        cli_with_ctrl_c(*args), check=False, capture_output=True, text=True, timeout=CASE_SECONDS, env={**os.environ}
    )
    assert done.returncode in (1, 2, 3, 4), (done.returncode, done.stderr)
    assert "internal error" not in done.stderr and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("saev-shards: error: "), done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(CATALOGUE))
def test_random_damage_to_every_kind_of_source(tmp_path: Path, kind: str) -> None:
    """60 random damages per kind (a new seed unless SAEV_FUZZ_SEED is set; printed on failure)."""
    seed = int(os.environ.get("SAEV_FUZZ_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    base = tmp_path / "base"
    BASES[kind](base)
    failures = []
    for i in range(60):
        folder = tmp_path / f"case{i}"
        folder.mkdir()
        copy_source(base, folder / "src")
        what = random_damage(folder / "src", rng)
        try:
            _run(folder, kind, {}, what)
        except AssertionError as err:
            failures.append(f"{what}: {err}")
    assert not failures, f"SAEV_FUZZ_SEED={seed}: {len(failures)} of 60 cases failed:\n" + "\n".join(failures)
