"""Dialogue segmentation evaluation (Pk, WindowDiff, boundary F1) with baselines.

Entry point: :func:`run_segmentation_eval` (CLI: ``python -m qumem_pipeline.eval.segmentation PATH``).
"""

from qumem_pipeline.episodes.metrics import boundary_prf, evaluate, pk, window_k, windowdiff
from qumem_pipeline.episodes.dialogues import Dialogue, detect_format, parse_dialogues, read_dialogues


def run_segmentation_eval(path: str, fmt: str | None = None, as_json: bool = False, classifier=None, **kw) -> dict:
    from qumem_pipeline.eval.segmentation.evaluate import run_segmentation_eval as _run

    return _run(path, fmt, as_json, classifier, **kw)


__all__ = ["Dialogue", "boundary_prf", "detect_format", "evaluate", "parse_dialogues", "pk",
           "read_dialogues", "run_segmentation_eval", "window_k", "windowdiff"]
