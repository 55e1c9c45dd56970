"""Numbers for people: byte counts and ages, formatted one way everywhere, and the small
tables a notebook shows for a cache or a loader (`html_table`).

The command line, the progress bar, dump's reports and `saev-shards clean` all print sizes
through `human_bytes`, so the same number never reads two ways in one session.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

_BYTE_UNITS = ("B", "KB", "MB", "GB", "TB", "PB")


def human_bytes(n: float) -> str:
    """Decimal units, one decimal past bytes: ``512 B``, ``3.7 KB``, ``19.7 MB``, ``1.2 GB``."""
    for unit in _BYTE_UNITS:
        if abs(n) < 1000 or unit == _BYTE_UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")  # the loop returns at the last unit


def human_age(seconds: float) -> str:
    """A duration in its largest whole unit: ``40 s``, ``12 min``, ``5 h``, ``3 days``."""
    seconds = max(0.0, seconds)
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            value = int(seconds // size)
            return f"{value} {'day' if unit == 'days' and value == 1 else unit}"
    return f"{int(seconds)} s"


def html_table(caption: str, rows: Sequence[tuple[str, str]], note: str = "") -> str:
    """A two-column HTML table (``name | value``, both escaped) under a bold caption, with an
    optional line below: what a notebook shows for a `Shards` or a loader (``_repr_html_``)."""
    body = "".join(
        f"<tr><th style='text-align:left;padding-right:1em'>{html.escape(name)}</th>"
        f"<td style='text-align:left'>{html.escape(value)}</td></tr>"
        for name, value in rows
    )
    tail = f"<div style='color:#666'>{html.escape(note)}</div>" if note else ""
    return f"<div><b>{html.escape(caption)}</b><table>{body}</table>{tail}</div>"
