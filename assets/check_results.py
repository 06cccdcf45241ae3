"""Domain check outcomes -> Dagster asset check results (one translation for every asset)."""

import dagster as dg

from qumem_pipeline.contracts.checks import CheckOutcome


def check_result(name: str, outcome: CheckOutcome) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(check_name=name, passed=outcome.passed,
                               description=outcome.description, metadata=outcome.metadata)
