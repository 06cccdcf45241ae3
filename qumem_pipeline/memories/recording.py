"""Record finished calls one at a time, write them in small groups: what `CheckpointStore` mixes in.

Why: the decomposition hands over each LLM call the moment it finishes, and every finished call
must survive a later failure. One write per call would make the checkpoint store the bottleneck
(and, on a table store, one commit per call); so outcomes are buffered and flushed when
`flush_every_n` have gathered or the oldest has waited `flush_every_s` (a timer flushes a quiet
buffer, so a call finished just before a long silence is on disk within that time too). Callers
flush before raising, so an endpoint failure loses nothing that finished; a kill -9 loses at most
the last `flush_every_s` seconds of answers (never more than `flush_every_n - 1` recorded calls, plus
the answers that arrived but were not recorded yet: at most the backend's calls in flight); a rerun
pays for those again (bench/faults.py's random kills measure it). Storage stays the host's
`append(outcomes)`.
"""

import threading
import time
from typing import Any

from qumem_pipeline.runtime.faults import fault_point

DEFAULT_FLUSH_EVERY_S = 1.0
DEFAULT_FLUSH_EVERY_N = 64


class BufferedRecorder:
    """`record(outcome)` + `flush()` over the host class's `append(list_of_outcomes)`."""

    flush_every_s: float = DEFAULT_FLUSH_EVERY_S
    flush_every_n: int = DEFAULT_FLUSH_EVERY_N

    def _rec_state(self) -> dict[str, Any]:
        st = self.__dict__.get("_recording")
        if st is None:  # created on first use: the host's __init__ stays its own
            st = self.__dict__["_recording"] = {"lock": threading.RLock(), "buffer": [], "first_at": None,
                                                "timer": None, "error": None, "flushes": 0, "recorded": 0}
        return st

    def set_flush_policy(self, every_s: float | None = None, every_n: int | None = None) -> "BufferedRecorder":
        if every_s is not None:
            self.flush_every_s = max(0.0, float(every_s))
        if every_n is not None:
            self.flush_every_n = max(1, int(every_n))
        return self

    def record(self, outcome: Any) -> None:
        """Keep one finished call; it is written within `flush_every_s` or `flush_every_n` calls."""
        st = self._rec_state()
        with st["lock"]:
            st["buffer"].append(outcome)
            st["recorded"] += 1
            now = time.monotonic()
            if st["first_at"] is None:
                st["first_at"] = now
            if len(st["buffer"]) >= self.flush_every_n or now - st["first_at"] >= self.flush_every_s:
                self.flush()
            elif st["timer"] is None:
                t = threading.Timer(max(0.0, self.flush_every_s - (now - st["first_at"])), self._timer_flush)
                t.daemon = True
                st["timer"] = t
                t.start()
        fault_point("llm.call_recorded")  # crash tests: die at any finished call, its group maybe not on disk yet

    def flush(self) -> int:
        """Write every buffered call now; returns how many were written."""
        st = self._rec_state()
        with st["lock"]:
            if st["timer"] is not None:
                st["timer"].cancel()
                st["timer"] = None
            batch, st["buffer"], st["first_at"] = st["buffer"], [], None
            if not batch:
                return 0
            try:
                self.append(batch)  # type: ignore[attr-defined]
            except BaseException:
                st["buffer"] = batch + st["buffer"]  # not written: keep them for the next try
                raise
            st["flushes"] += 1
            st["error"] = None  # a timer's failed write has now been retried with success
            fault_point("decompose.batch")  # crash tests: die right after a group of calls is on disk
            return len(batch)

    @property
    def flushes(self) -> int:
        return self._rec_state()["flushes"]

    @property
    def pending(self) -> int:
        return len(self._rec_state()["buffer"])

    def _timer_flush(self) -> None:
        st = self._rec_state()
        try:
            self.flush()
        except Exception as exc:  # noqa: BLE001 - the calls stay buffered; the owner's flush() retries and raises
            st["error"] = exc
