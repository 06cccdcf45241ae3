"""Progress lines for Dagster steps: the domain's ProgressLine writing to the step's log."""

from qumem_pipeline.runtime.progress import ProgressLine


class ProgressLogger(ProgressLine):
    def __init__(self, log, label: str, every_s: float = 5.0):
        super().__init__(log.info, label, every_s)
