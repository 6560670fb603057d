"""How a long run (eval.py, training) shows progress: a bar on a terminal, elsewhere a plain line now and then."""

from __future__ import annotations

import sys
import time
from typing import Optional


class Lines:
    """Progress off a terminal (no piled-up bar frames): a line at most every `every` s, always if `final`."""

    def __init__(self, every: float = 60.0):
        self.every, self.last = every, time.monotonic()

    def say(self, text: str, final: bool = False):
        now = time.monotonic()
        if final or now - self.last >= self.every:
            self.last = now
            print(text, file=sys.stderr, flush=True)


def show(enabled: bool) -> Optional[str]:
    """How to show progress: "bar" on a terminal, "lines" elsewhere (`Lines`), None when not asked for."""
    return None if not enabled else "bar" if sys.stderr.isatty() else "lines"
