"""Every stage's code version, gathered from what each stage declares (its `version` module) and hashed by
`qumem_pipeline.contracts.stage_versions`: the asset code versions (`assets/versions.py`), the schedule's
staleness, the evaluation's strategy versions and the tests read them here.

It sits above the stages (it imports their declarations); a stage's own code asks its own `version`
module instead. The warehouse stage is declared here: only its asset asks for its version."""

from qumem_pipeline.contracts.stage_versions import StageSpec, full_version, git_commit, own_version, stage_modules
from qumem_pipeline.contracts.stage_versions import downstream as _downstream
from qumem_pipeline.query.version import SPECS as QUERY_SPECS

SPECS: dict[str, StageSpec] = {
    **QUERY_SPECS,
    "warehouse": StageSpec(entries=("storage.warehouse",),
                           upstream=("turns", "episodes", "memories", "query_states", "persona_profiles")),
}
# The assets, in the asset graph's order; JOB_STAGES run by a job of their own (bulk personalization).
STAGES = ("turns", "episodes", "memories", "memory_embeddings", "memory_indexes", "persona_profiles", "memory_graph",
          "query_states", "warehouse")
JOB_STAGES = ("personalization",)
STAGE_UPSTREAM: dict[str, tuple[str, ...]] = {s: SPECS[s].upstream for s in STAGES}

__all__ = ["JOB_STAGES", "SPECS", "STAGES", "STAGE_UPSTREAM", "downstream", "git_commit", "stage_code_versions",
           "stage_files", "stage_own_versions", "stage_version"]


def stage_version(stage: str) -> str:
    """The `code_version` every row of `stage`'s tables carries (equal to its asset's code_version)."""
    return full_version(stage, SPECS)


def stage_own_versions() -> dict[str, str]:
    """Stage -> version of its own source and inputs only (what a change touches directly)."""
    return {s: own_version(s, SPECS) for s in STAGES}


def stage_code_versions() -> dict[str, str]:
    """Stage (asset name) -> code_version: own source and inputs plus every upstream stage's version."""
    memo: dict[str, str] = {}
    return {s: full_version(s, SPECS, memo) for s in STAGES}


def stage_files(stage: str):
    """Every source file hashed into `stage`'s version."""
    return stage_modules(tuple(SPECS[stage].entries))


def downstream(stages: set[str]) -> set[str]:
    """The stages plus every asset stage that reads from them, transitively."""
    return _downstream(stages, {s: SPECS[s] for s in STAGES})
