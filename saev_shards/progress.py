"""A small progress bar on stderr (no dependency): rate, percentage and ETA."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from .humanize import human_bytes


def _human(n: float, unit: str) -> str:
    return human_bytes(n) if unit == "B" else f"{n:,.0f} {unit}"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Progress:
    """``with Progress(total, "verify", unit="B") as bar: bar.update(n)``.

    Draws at most ten times a second, only when ``enabled`` (default: stderr is a
    terminal), so logs and tests stay clean.
    """

    def __init__(
        self,
        total: int,
        desc: str,
        *,
        unit: str = "B",
        enabled: bool | None = None,
        stream: TextIO | None = None,
        extra: str = "",
    ) -> None:
        self.total = total
        self.desc = desc
        self.unit = unit
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.done = 0
        self.extra = extra
        self.start = time.perf_counter()
        self._last = 0.0
        self._drawn = -1  # `done` as last drawn

    def update(self, n: int, extra: str | None = None) -> None:
        self.done += n
        if extra is not None:
            self.extra = extra
        now = time.perf_counter()
        if self.enabled and (now - self._last >= 0.1 or self.done >= self.total):
            self._last = now
            self._draw(now)

    def _draw(self, now: float, end: str = "") -> None:
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        pct = 100.0 * self.done / self.total if self.total else 100.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        line = (
            f"\r{self.desc}: {pct:5.1f}% {_human(self.done, self.unit)}/{_human(self.total, self.unit)} "
            f"[{_duration(elapsed)}<{_duration(eta)}, {_human(rate, self.unit)}/s]"
        )
        if self.extra:
            line += f" {self.extra}"
        self.stream.write(line + end)
        self.stream.flush()
        self._drawn = self.done

    def close(self) -> None:
        if not self.enabled:
            return
        if self._drawn == self.done:
            self.stream.write("\n")  # the final state is already on screen
            self.stream.flush()
        else:
            self._draw(time.perf_counter(), end="\n")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
