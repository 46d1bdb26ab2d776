"""A live progress line on stderr: a bar redrawn in place on a terminal, plain lines otherwise
(logs and CI would otherwise fill with carriage returns)."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TextIO

BAR_WIDTH = 28
TTY_INTERVAL_S = 0.2
PLAIN_INTERVAL_S = 10.0


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def render(sent: int, done: int, failed: int, elapsed: float, total: int | None,
           duration: float | None, bar: bool, complete: bool = False) -> str:
    """One status line. The fraction is of --num-requests finished, else of --duration
    (a run ends when its last request does, which may be just before the duration)."""
    finished = done + failed
    if complete:
        fraction = 1.0
    elif total:
        fraction = finished / total
    elif duration:
        fraction = elapsed / duration
    else:
        fraction = 0.0
    fraction = min(1.0, max(0.0, fraction))
    rate = finished / elapsed if elapsed > 0 else 0.0
    count = f"{finished}/{total}" if total else f"{finished}"
    head = ""
    if bar:
        filled = round(fraction * BAR_WIDTH)
        head = "[" + "#" * filled + "." * (BAR_WIDTH - filled) + "] "
    return (f"{head}{fraction:4.0%} {count} done | sent {sent} ok {done} failed {failed} | "
            f"{rate:.2f} req/s | {_clock(elapsed)}")


class Progress:
    def __init__(self, total: int | None, duration: float | None,
                 stream: TextIO | None = None, tty: bool | None = None) -> None:
        self.total = total
        self.duration = duration
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.sent = self.done = self.failed = 0
        self.start = time.perf_counter()
        self._last_plain = self.start

    def on_sent(self) -> None:
        self.sent += 1

    def on_finished(self, ok: bool) -> None:
        if ok:
            self.done += 1
        else:
            self.failed += 1

    def line(self, complete: bool = False) -> str:
        return render(self.sent, self.done, self.failed, time.perf_counter() - self.start,
                      self.total, self.duration, bar=self.tty, complete=complete)

    def draw(self, final: bool = False, complete: bool = False) -> None:
        now = time.perf_counter()
        if self.tty:
            self.stream.write("\r" + self.line(complete) + "\x1b[K" + ("\n" if final else ""))
        elif final or now - self._last_plain >= PLAIN_INTERVAL_S:
            self._last_plain = now
            self.stream.write(self.line(complete) + "\n")
        self.stream.flush()

    async def run(self) -> None:
        """Redraw until cancelled."""
        interval = TTY_INTERVAL_S if self.tty else 1.0
        while True:
            self.draw()
            await asyncio.sleep(interval)
