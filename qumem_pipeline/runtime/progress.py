"""Progress lines (done/total, rate, ETA) for long steps, so a 10,000-user run or a 20-minute
evaluation is never silent. Domain-level: the Dagster assets and the evaluations share it.

A line is written when work is reported (at most every ``every_s``, and always the last one), and,
while the line is started (``with progress:`` or ``start()``), by a heartbeat thread whenever
``heartbeat_s`` passed without a line: one batch that runs for minutes (an LLM batch whose calls all
finish at the end, a classifier batch on a slow CPU) still shows done/total, rate and ETA at least
every ``heartbeat_s``. A step made of several sub-stages (the query agents A1, A2, A3) names each
with ``stage(label, total)``: the counts, rate and ETA restart for it."""

import threading
import time
from collections.abc import Callable

HEARTBEAT_S = 10.0  # at most this long without a line while a stage runs (issue 28: every 15 s or better)


def _eta(seconds: float) -> str:
    if seconds == float("inf") or seconds != seconds:
        return "?"
    seconds = int(round(seconds))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class ProgressLine:
    """Called as ``progress(done, total)``; emits one line at most every ``every_s`` and always the last.

    Use it as a context manager (or ``start()`` / ``stop()``) to get the heartbeat (module doc)."""

    def __init__(self, emit: Callable[[str], None], label: str, every_s: float = 5.0,
                 heartbeat_s: float | None = HEARTBEAT_S):
        self.emit, self.label, self.every_s, self.heartbeat_s = emit, label, every_s, heartbeat_s
        self.t0 = time.monotonic()
        self.last = 0.0  # when the last line was written (monotonic)
        self.done: int = 0
        self.total: int | None = None
        self.base = 0  # done before this stage started: not part of the rate
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- reporting ------------------------------------------------------------------------------
    def __call__(self, done: int, total: int) -> None:
        with self._lock:
            self.done, self.total = done, total
            now = time.monotonic()
            if done < total and now - self.last < self.every_s:
                return
            line = self._line_locked(now)
        self.emit(line)

    def stage(self, label: str, total: int | None = None, base: int = 0) -> None:
        """Start a named sub-stage: its own done/total, rate and ETA from now (no line until work is reported).
        `base`: items already done at the start (e.g. calls replayed from checkpoints), not counted in the rate."""
        with self._lock:
            self.label, self.done, self.total, self.base = label, base, total, base
            self.t0 = time.monotonic()

    def line(self) -> str:
        with self._lock:
            return self._line_locked(time.monotonic(), mark=False)

    def _line_locked(self, now: float, mark: bool = True) -> str:
        if mark:
            self.last = now
        elapsed = max(now - self.t0, 1e-9)
        if self.total is None:
            return f"{self.label}: running for {elapsed:.0f}s"
        rate = (self.done - self.base) / elapsed
        eta = 0.0 if self.done >= self.total else (self.total - self.done) / rate if rate > 0 else float("inf")
        reused = f", {self.base} from checkpoints" if self.base else ""
        return f"{self.label}: {self.done}/{self.total} ({rate:.1f}/s, ETA {_eta(eta)}{reused})"

    # -- heartbeat ------------------------------------------------------------------------------
    def start(self) -> "ProgressLine":
        if self.heartbeat_s and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._beat, name=f"progress:{self.label}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _beat(self) -> None:
        assert self.heartbeat_s
        with self._lock:
            self.last = max(self.last, time.monotonic())  # the first beat comes heartbeat_s after start
        while not self._stop.wait(min(1.0, self.heartbeat_s)):
            with self._lock:
                now = time.monotonic()
                if now - self.last < self.heartbeat_s:
                    continue
                line = self._line_locked(now)
            try:
                self.emit(line)
            except Exception:  # noqa: BLE001 - a progress line must never fail the work it reports on
                pass

    def __enter__(self) -> "ProgressLine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def llm_call_progress(progress: ProgressLine, prefix: str = ""):
    """`CheckpointedLLM.progress` writing to `progress`: each batch of calls (A1, A2, A3, a retry batch,
    persona merges) is a sub-stage of its own, `<prefix><STAGE> calls: done/total (rate, ETA)`."""
    current: list = [None]

    def report(stage: str, done: int, total: int) -> None:
        if current[0] != (stage, total) or done < progress.done:
            current[0] = (stage, total)  # a new batch: its replayed calls are done already
            progress.stage(f"{prefix}{stage.upper()} calls", total, base=done)
        progress(done, total)

    return report
