"""`saev_shards.progress.Progress`: silent unless enabled, and when drawn, the last state
on screen once, with its rate and units."""

from __future__ import annotations

import io

from saev_shards.progress import Progress


def test_a_disabled_bar_writes_nothing() -> None:
    stream = io.StringIO()
    with Progress(10, "verify", enabled=False, stream=stream) as bar:
        bar.update(10)
    assert stream.getvalue() == ""
    assert bar.done == 10


def test_the_default_follows_whether_the_stream_is_a_terminal() -> None:
    assert Progress(1, "x", stream=io.StringIO()).enabled is False


def test_an_enabled_bar_draws_the_final_state_once_and_ends_the_line() -> None:
    stream = io.StringIO()
    with Progress(2_000_000, "verify", enabled=True, stream=stream) as bar:
        bar.update(1_000_000)  # drawn: the first update is at least 0.1 s after a zero start
        bar.update(1_000_000, extra="2 files")  # drawn: the total is reached
    text = stream.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1
    last = text.rstrip("\n").split("\r")[-1]
    assert last.startswith("verify: 100.0% 2.0 MB/2.0 MB [")
    assert last.endswith("/s] 2 files")


def test_counts_in_other_units_are_whole_numbers_with_separators() -> None:
    stream = io.StringIO()
    with Progress(12_345, "dump", unit="ex", enabled=True, stream=stream) as bar:
        bar.update(12_345)
    assert "12,345 ex/12,345 ex" in stream.getvalue()


def test_close_draws_the_state_when_the_last_update_was_not_drawn() -> None:
    stream = io.StringIO()
    bar = Progress(100, "copy", unit="ex", enabled=True, stream=stream)
    bar.update(100)  # drawn (the total)
    bar.done = 50  # as if an update had come within 0.1 s of the last draw
    bar.close()
    assert stream.getvalue().split("\r")[-1].startswith("copy:  50.0% 50 ex/100 ex")
