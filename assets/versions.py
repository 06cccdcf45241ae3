"""Each asset's Dagster code version and the version metadata its materializations record.

The versions come from `qumem_pipeline.code_versions` (every stage's declaration, hashed by
`qumem_pipeline.contracts.stage_versions`: source hashes of the stage's modules, its model/prompt
inputs and its upstream stages), the same strings every output row of the stage carries in
`code_version`; the git commit is recorded beside them, never part of them.
"""

from qumem_pipeline.code_versions import git_commit, stage_version


def code_version(stage: str) -> str:
    return stage_version(stage)


def version_metadata(stage: str) -> dict[str, str]:
    """`code_version` (equal to the rows') and `git_commit` ("unknown" outside a git checkout)."""
    return {"code_version": stage_version(stage), "git_commit": git_commit() or "unknown"}
