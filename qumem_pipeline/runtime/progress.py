"""Progress lines (done/total, rate, ETA) for long steps, so a 10,000-user run or a 20-minute
evaluation is never silent. Domain-level: the Dagster assets and the evaluations share it."""

import time
from collections.abc import Callable


class ProgressLine:
    """Called as ``progress(done, total)``; emits one line at most every ``every_s`` and always the last."""

    def __init__(self, emit: Callable[[str], None], label: str, every_s: float = 5.0):
        self.emit, self.label, self.every_s = emit, label, every_s
        self.t0 = time.monotonic()
        self.last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self.last < self.every_s:
            return
        self.last = now
        elapsed = max(now - self.t0, 1e-9)
        rate = done / elapsed
        eta = (total - done) / rate if rate > 0 else float("inf")
        self.emit(f"{self.label}: {done}/{total} ({rate:.1f}/s, ETA {eta:.0f}s)")
