"""`saev_shards.humanize`: sizes and ages read one way everywhere, and notebook tables that
escape what they show."""

from __future__ import annotations

import pytest

from saev_shards.humanize import html_table, human_age, human_bytes


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (999, "999 B"),
        (1000, "1.0 KB"),
        (3_700, "3.7 KB"),
        (19_700_000, "19.7 MB"),
        (1.2e9, "1.2 GB"),
        (5e15, "5.0 PB"),
        (5e18, "5000.0 PB"),  # the last unit holds whatever is larger
        (-2_500, "-2.5 KB"),
    ],
)
def test_human_bytes(n: float, text: str) -> None:
    assert human_bytes(n) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (-5, "0 s"),
        (0, "0 s"),
        (40.9, "40 s"),
        (60, "1 min"),
        (12 * 60 + 59, "12 min"),
        (5 * 3600, "5 h"),
        (86400, "1 day"),
        (3 * 86400 + 1, "3 days"),
    ],
)
def test_human_age(seconds: float, text: str) -> None:
    assert human_age(seconds) == text


def test_html_table_escapes_the_caption_names_values_and_note() -> None:
    page = html_table("<cache>", [("a&b", "<i>1</i>")], note="x < y")
    assert "<cache>" not in page and "&lt;cache&gt;" in page
    assert "a&amp;b" in page and "&lt;i&gt;1&lt;/i&gt;" in page and "x &lt; y" in page
    assert page.count("<tr>") == 1


def test_html_table_without_a_note_has_no_line_below() -> None:
    assert "color:#666" not in html_table("c", [("k", "v")])
