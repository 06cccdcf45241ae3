"""What one run of a stage over its users hands the orchestrator: the blocking checks on the rows it
would write, the write itself, and its figures.

A stage's core function (`ingest/stage.py`, `episodes/stage.py`, `memories/stage.py`, `query/stage.py`)
reads its users' upstream rows, computes, and returns a `StageRun`; its Dagster asset only reads its
partition, calls that function, publishes through the gate (`publish` runs only when every outcome
passed, so a failing check writes nothing) and returns the metadata and check results. The asset stays
thin and the stage stays testable without Dagster.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qumem_pipeline.contracts.checks import CheckOutcome


class StageFailed(RuntimeError):
    """The stage cannot run for a reason its operator fixes; the message says what and what to do
    (an upstream table not materialized yet, an LLM endpoint down with its finished calls checkpointed)."""


@dataclass
class StageRun:
    """`outcomes`: the blocking checks, by check name; `publish`: the commit of the run's rows (None when
    the stage has written already, e.g. the archive sync, or has nothing to write); `metadata`: counts,
    rates and versions only (never user content: it lands in Dagster's event log)."""

    outcomes: dict[str, CheckOutcome]
    publish: Callable[[], object] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
