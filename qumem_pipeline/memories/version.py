"""The memories stage's version: what it declares (`SPECS`, with its upstream stages'). Never followed by
the source digests; hashed by `qumem_pipeline.contracts.stage_versions`."""

from qumem_pipeline.contracts.stage_versions import StageSpec, full_version
from qumem_pipeline.episodes.version import SPECS as UPSTREAM_SPECS
from qumem_pipeline.llm.version import llm_model_id

SPECS: dict[str, StageSpec] = {
    **UPSTREAM_SPECS,
    "memories": StageSpec(
        entries=("memories.stage", "memories.decompose", "memories.checkpoints", "llm.factory"),
        upstream=("episodes",),
        inputs=lambda: (llm_model_id(),),
    ),
}


def stage_version(stage: str = "memories") -> str:
    """The `code_version` every memories row carries (equal to the asset's code_version)."""
    return full_version(stage, SPECS)
