"""Domain check outcomes -> Dagster asset check results, and the publish gate for blocking checks.

Blocking checks run on the rows BEFORE they are committed: `gate` evaluates them and calls the
write only when every one passed, so a failing check publishes nothing (the store keeps the
previous version) and Dagster still records the failed checks, which stop downstream assets.
"""

import time
from collections.abc import Callable

import dagster as dg

from assets.versions import version_metadata
from qumem_pipeline.contracts.checks import CheckOutcome
from qumem_pipeline.contracts.stage_run import StageRun


def check_result(name: str, outcome: CheckOutcome) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(check_name=name, passed=outcome.passed,
                               description=outcome.description, metadata=outcome.metadata)


def gate(context, outcomes: dict[str, CheckOutcome], publish: Callable[[], object]) -> tuple[list[dg.AssetCheckResult], bool]:
    """Run `publish` only if every (blocking) check passed; returns the check results and whether it ran."""
    failed = [n for n, o in outcomes.items() if not o.passed]
    if failed:
        context.log.error(f"blocking checks failed ({', '.join(failed)}): nothing written, the previous version stays")
    else:
        publish()
    return [check_result(n, o) for n, o in outcomes.items()], not failed


def materialize(context, run: StageRun, stage: str, t0: float) -> dg.MaterializeResult:
    """An asset's result for its stage's run (`qumem_pipeline.contracts.stage_run`): the rows published
    through the gate (when the stage has rows to write), its check results, and its metadata (dicts as
    JSON) with the stage's version and the step's seconds."""
    if run.publish is None:
        results = [check_result(n, o) for n, o in run.outcomes.items()]
    else:
        results, _ = gate(context, run.outcomes, run.publish)
    meta = {k: dg.MetadataValue.json(v) if isinstance(v, (dict, list)) else v for k, v in run.metadata.items()}
    meta.update({"seconds": round(time.perf_counter() - t0, 3), **version_metadata(stage)})
    return dg.MaterializeResult(check_results=results, metadata=meta)


def no_users_result(context) -> dg.MaterializeResult:
    """What a step returns when none of its run's users is left (all forgotten since the run was
    planned): nothing to compute or write, and its checks pass vacuously, so the run of the other
    steps and users goes on (a forget never fails a run)."""
    reason = "no users left in this run: all were forgotten since it was planned"
    checks = [dg.AssetCheckResult(check_name=s.name, passed=True, description=reason)
              for s in context.assets_def.check_specs]
    context.log.info(reason)
    return dg.MaterializeResult(check_results=checks or None, metadata={"users": 0, "dagster/row_count": 0})
