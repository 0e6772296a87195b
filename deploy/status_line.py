"""One status line: rewritten in place on a terminal, a plain line every few seconds otherwise.

>>> import io
>>> line = StatusLine(io.StringIO(), every_s=0.0)
>>> line.show("step 1"); line.show("step 2"); line.done()
>>> line.out.getvalue()
'step 1\\nstep 2\\n'
>>> progress_bar(0.5)
'[##########          ]  50%'
"""

from __future__ import annotations

import time
from typing import TextIO


def progress_bar(share: float, width: int = 20) -> str:
    """``[####    ]  50%`` for ``share`` in [0, 1] (clipped)."""
    share = min(1.0, max(0.0, share))
    return f"[{'#' * int(share * width):<{width}}] {share:>4.0%}"


class StatusLine:
    """Shows the newest status: in place on a terminal, else at most one line per ``every_s``."""

    def __init__(self, out: TextIO, *, every_s: float = 5.0) -> None:
        self.out = out
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self.every_s = every_s
        self._last = 0.0  # the first status is shown at once
        self._unshown: str | None = None  # the newest status held back by every_s

    def show(self, text: str) -> None:
        now = time.monotonic()
        if self.tty:
            self.out.write("\r" + text + "\033[K")
            self.out.flush()
        elif now - self._last >= self.every_s:
            self.out.write(text + "\n")
            self.out.flush()
            self._last = now
            self._unshown = None
        else:
            self._unshown = text

    def done(self) -> None:
        """End the line on a terminal (the next output starts on a line of its own);
        elsewhere show the last status if ``every_s`` held it back: how a run ended.

        >>> import io
        >>> out = io.StringIO()
        >>> line = StatusLine(out, every_s=60.0)
        >>> line.show("10%"); line.show("100%"); line.done()
        >>> out.getvalue().splitlines()
        ['10%', '100%']
        """
        if self.tty:
            self.out.write("\n")
            self.out.flush()
        elif self._unshown is not None:
            self.out.write(self._unshown + "\n")
            self.out.flush()
            self._unshown = None
