"""Progress on stderr for the long commands (convert, eval, quantize-kv, apply): one helper for all.

A command opens a session with its `--progress/--no-progress` flag; code below it opens tasks:

    with progress.session(flag):                 # in the command
        ...
        with progress.task("calibrate", total=30, unit="layer") as t:   # anywhere below
            for i in range(30):
                ...
                t.update(1, note=f"layer {i}")

Modes (`resolve`): with stderr a terminal (the default there) one line redrawn in place with the count,
the percentage, the elapsed time and an ETA; a ticker thread redraws it twice a second, so even a single
step that takes minutes (loading a model, one refinement step) shows the clock moving and the user never
waits more than a moment without output. `--progress` with stderr not a terminal (a CI log, a file)
prints plain lines instead: when a task starts, every 10 s, and when it ends. Off by default when
stderr is not a terminal, and always with `--no-progress`. Nothing is ever written to stdout, so JSON
output and pipes stay clean. Outside a session (kvtool as a library) tasks are silent unless a call
asks for progress explicitly (`enabled=True`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator, TextIO

from kvtool.console import escape, out, redraw, stderr

MODES = ("off", "bar", "lines")
BAR_REFRESH_S = 0.5  # the terminal line is redrawn at least this often
BAR_MIN_S = 0.1  # ... and at most this often (a shard of thousands of small tensors would flood the terminal)
LINES_EVERY_S = 10.0  # plain lines (not a terminal): at most one per task this often

_session_mode = "off"
# the --progress/--no-progress help of every long command
FLAG_HELP = ("Progress with elapsed time and ETA on stderr (default: on when stderr is a terminal; "
             "--progress elsewhere prints a line every 10 s).")


def resolve(flag: bool | None, stream: TextIO | None = None) -> str:
    """'bar' | 'lines' | 'off' for a --progress/--no-progress flag (None: not given)."""
    stream = stream if stream is not None else stderr()
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    if flag is False:
        return "off"
    if tty:
        return "bar"
    return "lines" if flag else "off"


@contextlib.contextmanager
def session(flag: bool | None) -> Iterator[str]:
    """Progress for everything inside the block, per the command's flag; yields the mode."""
    global _session_mode
    saved, _session_mode = _session_mode, resolve(flag)
    try:
        yield _session_mode
    finally:
        _session_mode = saved


def active() -> bool:
    """Whether a session shows progress (e.g. to silence other libraries' own bars)."""
    return _session_mode != "off"


def task(desc: str, total: float | None = None, unit: str = "", *, enabled: bool | None = None,
         scale: str | None = None, rate: bool = False) -> "Task":
    """A unit of long work. total None: unknown length (elapsed time only). unit: shown after the
    count ("layer", "tok", "B"). scale "bytes": counts shown as KiB/MiB/GiB. enabled None: the session's
    mode; True / False: as the --progress / --no-progress flag would. rate: also show units per second."""
    mode = _session_mode if enabled is None else resolve(enabled)
    return Task(desc, total, unit, mode=mode, scale=scale, rate=rate)


def fmt_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _fmt_count(n: float, scale: str | None) -> str:
    if scale == "bytes":
        for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(n) < 1024 or unit == "TiB":
                return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
            n /= 1024
    return f"{n:,.0f}" if float(n).is_integer() else f"{n:,.1f}"


class Task:
    """See `task`. Thread-safe; a context manager that closes itself (with a final line)."""

    def __init__(self, desc: str, total: float | None = None, unit: str = "", *, mode: str = "off",
                 scale: str | None = None, stream: TextIO | None = None, rate: bool = False):
        if mode not in MODES:
            raise ValueError(f"progress mode must be one of {MODES}")
        self.desc, self.total, self.unit, self.mode, self.scale = desc, total, unit, mode, scale
        self.rate = rate
        self.stream = stream if stream is not None else stderr()
        self.done = 0.0
        self.note = ""
        self.t0 = time.monotonic()
        self._last_line = self.t0
        self._last_draw = 0.0
        self._width = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = mode == "off"
        self._ticker = None
        if mode != "off":
            if mode == "lines":
                self._emit_line()
            else:
                self._draw()
            self._ticker = threading.Thread(target=self._tick, name="kvtool-progress", daemon=True)
            self._ticker.start()

    # --- public --------------------------------------------------------------------------------
    def update(self, n: float = 1, note: str | None = None) -> None:
        if self._closed:
            return
        with self._lock:
            self.done += n
            if note is not None:
                self.note = note
            self._refresh_locked()

    def set_note(self, note: str) -> None:
        self.update(0, note)

    def close(self) -> None:
        if self._closed:
            return
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=2)
        with self._lock:
            self._closed = True
            if self.mode == "bar":
                self._draw()
                self._write(out, [""])  # the newline that ends the bar
            else:
                self._emit_line_locked()

    def __enter__(self) -> "Task":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- text ----------------------------------------------------------------------------------
    def render(self, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        elapsed = now - self.t0
        unit = f" {self.unit}" if self.unit else ""
        parts = [self.desc]
        if self.total:
            parts.append(f"{_fmt_count(self.done, self.scale)}/{_fmt_count(self.total, self.scale)}{unit}")
            parts.append(f"{min(100.0, 100.0 * self.done / self.total):3.0f}%")
        elif self.done:
            parts.append(f"{_fmt_count(self.done, self.scale)}{unit}")
        if self.rate and self.done and elapsed > 0:
            parts.append(f"{_fmt_count(self.done / elapsed, self.scale)} {self.unit or 'units'}/s")
        parts.append(f"elapsed {fmt_duration(elapsed)}")
        eta = self.eta(elapsed)
        if eta is not None:
            parts.append(f"ETA {fmt_duration(eta)}")
        line = "  ".join(parts)
        return f"{line}  ({self.note})" if self.note else line

    def eta(self, elapsed: float) -> float | None:
        """Seconds left at the average rate so far; None before the first unit or without a total."""
        if not self.total or self.done <= 0 or self.done >= self.total:
            return None
        return elapsed / self.done * (self.total - self.done)

    # --- output --------------------------------------------------------------------------------
    def _tick(self) -> None:
        while not self._stop.wait(BAR_REFRESH_S):
            with self._lock:
                if not self._closed:
                    self._refresh_locked()

    def _refresh_locked(self) -> None:
        if self.mode == "bar":
            if time.monotonic() - self._last_draw >= BAR_MIN_S:
                self._draw()
        elif self.mode == "lines" and time.monotonic() - self._last_line >= LINES_EVERY_S:
            self._emit_line_locked()

    def _pad(self, text: str) -> str:
        pad = max(0, self._width - len(text))
        self._width = len(text)
        return text + " " * pad

    def _draw(self) -> None:
        import shutil

        cols = shutil.get_terminal_size((100, 20)).columns
        self._last_draw = time.monotonic()
        self._write(redraw, self._pad(escape(self.render())[: max(20, cols - 1)]))

    def _emit_line(self) -> None:
        with self._lock:
            self._emit_line_locked()

    def _emit_line_locked(self) -> None:
        self._last_line = time.monotonic()
        self._write(out, self.render())

    def _write(self, write, text) -> None:
        """`write` (kvtool.console.out or redraw) `text` to the stream; escaped there like all output."""
        try:
            write(text, stream=self.stream)
        except (OSError, ValueError):  # stderr closed or gone: progress is never worth a failure
            self._closed = True
