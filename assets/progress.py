"""Progress lines (done/total, rate, ETA) for long steps, so a 10,000-user run is never silent."""

import time


class ProgressLogger:
    def __init__(self, log, label: str, every_s: float = 5.0):
        self.log, self.label, self.every_s = log, label, every_s
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
        self.log.info(f"{self.label}: {done}/{total} ({rate:.1f}/s, ETA {eta:.0f}s)")
