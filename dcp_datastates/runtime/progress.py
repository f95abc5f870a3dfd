"""Progress on stderr for the command-line tools (``export``, ``verify``).

:class:`Progress` draws a byte counter: tqdm's bar when tqdm is installed, else one line redrawn
at most twice a second. Disabled, it only counts. The command line enables it when stderr is a
terminal or with ``--progress`` (:mod:`dcp_datastates.cli`); library calls leave it off unless
asked. Not thread-safe: one caller thread.
"""

from __future__ import annotations

import sys
import time
from typing import Any


class Progress:
    """A byte counter drawn on stderr while ``enabled``; ``desc`` labels it."""

    def __init__(self, total: int, enabled: bool, desc: str) -> None:
        self.total, self.done, self.enabled, self.desc = total, 0, enabled, desc
        self._bar: Any = None
        self._last = 0.0
        if enabled:
            try:
                from tqdm import tqdm  # type: ignore[import-untyped]

                self._bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc,
                                 file=sys.stderr)
            except ImportError:
                self._bar = None

    def update(self, n: int) -> None:
        """Counts ``n`` more bytes done."""
        self.done += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last >= 0.5 or self.done >= self.total:
            self._last = now
            pct = 100.0 * self.done / self.total if self.total else 100.0
            sys.stderr.write(
                f"\r{self.desc} {pct:5.1f}% {human_bytes(self.done)} / {human_bytes(self.total)}"
            )
            sys.stderr.flush()

    def close(self) -> None:
        """Ends the line (or the bar)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            sys.stderr.write("\n")
            sys.stderr.flush()


def human_bytes(n: int) -> str:
    """``1.50 GB``, ``12.00 kB``, ``7 B`` (decimal units)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


__all__ = ["Progress", "human_bytes"]
