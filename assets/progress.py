"""Progress lines for Dagster steps: the domain's ProgressLine writing to the step's log.

Every long step uses one as a context manager, so its heartbeat writes done/total, rate and ETA at
least every `HEARTBEAT_S` while the step works, even inside one long batch."""

from qumem_pipeline.runtime.progress import HEARTBEAT_S, ProgressLine, llm_call_progress

__all__ = ["ProgressLogger", "llm_call_progress"]


class ProgressLogger(ProgressLine):
    def __init__(self, log, label: str, every_s: float = 5.0, heartbeat_s: float | None = HEARTBEAT_S):
        super().__init__(log.info, label, every_s, heartbeat_s)

