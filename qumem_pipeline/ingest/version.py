"""The turns stage's version: what it declares (`SPECS`) and its version for the rows it writes.

`qumem_pipeline.contracts.stage_versions` hashes the declaration; `qumem_pipeline/code_versions.py`
gathers every stage's. Never followed by the source digests (it names no code that makes rows)."""

from qumem_pipeline.contracts.stage_versions import StageSpec, full_version
from qumem_pipeline.contracts.versions import TURN_SCHEMA_VERSION

SPECS: dict[str, StageSpec] = {
    "turns": StageSpec(
        entries=("ingest.stage", "ingest.sync", "ingest.archive", "ingest.importers", "ingest.validate", "contracts.schema",
                 "contracts.versions"),
        upstream=(),
        inputs=lambda: (TURN_SCHEMA_VERSION,),
    ),
}


def stage_version(stage: str = "turns") -> str:
    """The `code_version` every turns row carries (equal to the asset's code_version)."""
    return full_version(stage, SPECS)
