"""Progress lines for Dagster steps: the domain's ProgressLine writing to the step's log.

Every long step uses one as a context manager, so its heartbeat writes done/total, rate and ETA at
least every `HEARTBEAT_S` while the step works, even inside one long batch."""

from qumem_pipeline.runtime.progress import HEARTBEAT_S, ProgressLine


class ProgressLogger(ProgressLine):
    def __init__(self, log, label: str, every_s: float = 5.0, heartbeat_s: float | None = HEARTBEAT_S):
        super().__init__(log.info, label, every_s, heartbeat_s)


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
