"""A plain progress line on stderr for long planning (no dependency, off unless asked)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """`label: 42% (42000/100000 samples)`, redrawn at most every `interval_s` seconds.

    Args:
        total: units of work (samples).
        enabled: draw anything at all.
        stream: where to draw (stderr by default, resolved when drawing).
    """

    def __init__(self, total: int, *, enabled: bool, label: str = "planning", interval_s: float = 0.5,
                 stream: TextIO | None = None) -> None:
        self.total, self.enabled, self.label, self.interval_s = max(1, total), enabled, label, interval_s
        self.stream = stream
        self.done = 0
        self._last = -float("inf")

    def _draw(self) -> None:
        out = self.stream if self.stream is not None else sys.stderr
        out.write(f"\r{self.label}: {100 * self.done // self.total:3d}% ({self.done}/{self.total} samples)")
        out.flush()

    def update(self, done: int) -> None:
        """Set the units done so far (monotone); redraw if enough time passed."""
        self.done = min(max(self.done, done), self.total)
        now = time.monotonic()
        if self.enabled and now - self._last >= self.interval_s:
            self._last = now
            self._draw()

    def close(self) -> None:
        """Draw 100% and end the line."""
        if self.enabled:
            self.done = self.total
            self._draw()
            (self.stream if self.stream is not None else sys.stderr).write("\n")
