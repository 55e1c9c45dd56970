"""`benchmarks/run_all.py`, the runner of `make bench`: one page holding every table each suite
emitted, under the suite's heading, with the run's date, commit and machine; a failed suite
said on the page while the others still run, and the exit status 1; quick or partial runs
never written over docs/bench/latest.md; the plots a full run drew copied beside its page."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from benchmarks import run_all, tables

SUITE = """
from benchmarks import tables

def main(quick: bool = False) -> None:
    t = tables.Table("{name}_t", "{name} table ({{}})".format("quick" if quick else "full"), ["what", "GB/s"])
    t.add("memcpy (limit)", 10.0)
    t.add("ours", 9.5)
    t.emit()
"""
FAILING = """
from benchmarks import tables

def main(quick: bool = False) -> None:
    tables.Table("half", "emitted before the failure", ["a"]).emit()
    raise RuntimeError("the disk went away")
"""


@pytest.fixture
def suites(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Three fake suites (the second fails) in a package of their own; results under tmp_path."""
    package = tmp_path / "fake_suites"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "one.py").write_text(SUITE.format(name="one"))
    (package / "two.py").write_text(FAILING)
    (package / "three.py").write_text(SUITE.format(name="three"))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("fake_suites")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(run_all, "SUITES", [(n, f"fake_suites.{n}") for n in ("one", "two", "three")])
    monkeypatch.setattr(run_all, "PAGE", tmp_path / "docs" / "bench" / "latest.md")
    monkeypatch.setenv("SAEV_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("SAEV_BENCH_DIR", str(tmp_path / "bench_out"))
    return tmp_path


def test_a_full_run_writes_every_table_of_every_suite_into_the_page(suites: Path) -> None:
    plot = tables.results_dir() / "peers.png"
    assert run_all.main([]) == 1  # a suite failed
    page = (suites / "docs" / "bench" / "latest.md").read_text()
    assert page.startswith(
        "# `make bench` results\n\nWritten whole by `make bench` (`benchmarks/run_all.py`), a full run"
    )
    assert "Suites: one, two, three." in page and tables.machine() in page
    one, two, three = page.index("## one\n"), page.index("## two\n"), page.index("## three\n")
    assert one < page.index("### one table (full)") < two < page.index("### three table (full)")
    assert three > page.index("Stopped after") > two and "RuntimeError: the disk went away" in page
    assert page.index("### emitted before the failure") > two  # what a suite emitted before it failed is kept
    assert "| ours" in page and (suites / "results" / "one_t.md").is_file()
    assert not plot.exists() and not (suites / "docs" / "bench" / "peers.png").exists()


def test_the_plots_a_full_run_drew_are_copied_beside_its_page(suites: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tables.results_dir() / "peers_scale.png"
    stale.write_bytes(b"an earlier --scale run")
    os.utime(stale, (1, 1))
    monkeypatch.setattr(run_all, "SUITES", run_all.SUITES[:1])
    (suites / "fake_suites" / "one.py").write_text(
        SUITE.format(name="one") + "\n    (tables.results_dir() / 'peers.png').write_bytes(b'png')\n"
    )
    assert run_all.main([]) == 0
    bench = suites / "docs" / "bench"
    assert (bench / "peers.png").read_bytes() == b"png" and not (bench / "peers_scale.png").exists()
    assert "![peers.png](peers.png)" in (bench / "latest.md").read_text()


@pytest.mark.parametrize("argv", [["--quick", "--suite", "one,three"], ["--suite", "one,three"]])
def test_quick_and_partial_runs_leave_the_published_page_alone(suites: Path, argv: list[str]) -> None:
    assert run_all.main(argv) == 0
    assert not (suites / "docs" / "bench" / "latest.md").exists()
    page = (tables.results_dir() / "bench.md").read_text()
    assert f"`benchmarks/run_all.py {' '.join(argv)}`" in page
    assert "## two" not in page and "### three table" in page
    quick = "--quick" in argv
    assert ("three table (quick)" in page) == quick and ("not for publishing" in page) == quick


def test_an_unknown_suite_is_refused_naming_the_suites(suites: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        run_all.main(["--suite", "core"])
    assert stop.value.code == 2
    assert "unknown suite core; the suites are one, two, three" in capsys.readouterr().err
