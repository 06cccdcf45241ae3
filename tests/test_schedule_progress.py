"""Progress lines of long steps: done/total, rate and ETA, throttled so a big run is not flooded."""

from assets.progress import ProgressLogger


class _Log:
    def __init__(self):
        self.lines: list[str] = []

    def info(self, msg: str) -> None:
        self.lines.append(msg)


def test_progress_reports_done_total_rate_eta_and_throttles():
    log = _Log()
    p = ProgressLogger(log, "pairs classified", every_s=3600.0)
    p.last = -1e9  # the first call is due
    p(10, 100)
    for done in range(11, 100):
        p(done, 100)  # inside the throttle window: silent
    p(100, 100)  # completion always reports
    assert len(log.lines) == 2
    first, last = log.lines
    assert first.startswith("pairs classified: 10/100 (") and "/s, ETA " in first
    assert last.startswith("pairs classified: 100/100 (") and last.endswith("ETA 0s)")
