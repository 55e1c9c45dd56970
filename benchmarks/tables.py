"""Where the benchmarks' figures go: the folders, the machine's description, and `Table`.

Every suite prints its tables as it goes and saves each under results/<name>.md; the runner
(`run_all.py`) also collects the tables each suite emitted (`emitted_since`) and writes them,
whole, as one page (docs/bench/latest.md after a full `make bench`). The limits the tables
compare against are measured in `benchlib.py`, which re-exports these names.
"""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Sequence
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent

#: Every table emitted in this process, in order (the runner slices it per suite).
_EMITTED: list[str] = []


def bench_dir() -> Path:
    """Where benchmark data files go: $SAEV_BENCH_DIR, else ./bench_out (same disk as the repo)."""
    path = Path(os.environ.get("SAEV_BENCH_DIR", REPO / "bench_out"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def results_dir() -> Path:
    """Where tables (markdown) and plots (PNG) are saved: $SAEV_RESULTS_DIR, else ./results."""
    path = Path(os.environ.get("SAEV_RESULTS_DIR", REPO / "results"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def machine() -> str:
    """One line naming the machine the figures came from."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, Python {platform.python_version()}, numpy {np.__version__}"
    )


def emitted_since(mark: int) -> list[str]:
    """The tables emitted after the ``mark``-th one (``len(emitted_since(0))`` is the count)."""
    return _EMITTED[mark:]


class Table:
    """A markdown table that prints itself and is saved to results/<name>.md."""

    def __init__(self, name: str, title: str, columns: Sequence[str]) -> None:
        self.name = name
        self.title = title
        self.columns = list(columns)
        self.rows: list[list[str]] = []
        self.notes: list[str] = []
        #: The figures behind the rows, by label, for notes computed from them.
        self.values: dict[str, float] = {}

    def add(self, *cells: object) -> None:
        self.rows.append([_cell(c) for c in cells])

    def note(self, text: str) -> None:
        self.notes.append(text)

    def render(self) -> str:
        widths = [
            max(len(c), *(len(r[i]) for r in self.rows)) if self.rows else len(c) for i, c in enumerate(self.columns)
        ]
        lines = [f"### {self.title}", ""]
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(self.columns, widths, strict=True)) + " |")
        lines.append("| " + " | ".join("-" * w for w in widths) + " |")
        lines.extend("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in self.rows)
        if self.notes:
            lines.append("")
            lines.extend(self.notes)
        return "\n".join(lines) + "\n"

    def emit(self) -> str:
        text = self.render()
        print(text, flush=True)
        (results_dir() / f"{self.name}.md").write_text(text)
        _EMITTED.append(text)
        return text


def _cell(c: object) -> str:
    if isinstance(c, float):
        if c != c:  # NaN
            return "n/a"
        if abs(c) >= 100:
            return f"{c:,.0f}"
        if abs(c) >= 10:
            return f"{c:.1f}"
        return f"{c:.2f}"
    return str(c)


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB"
