"""The index stages' versions (memory embeddings, memory indexes): what they declare (`SPECS`, with their
upstream stages'). Never followed by the source digests; hashed by `qumem_pipeline.contracts.stage_versions`."""

import qumem_pipeline.embedding.version as embedding_version
from qumem_pipeline.contracts.stage_versions import StageSpec, full_version
from qumem_pipeline.memories.version import SPECS as UPSTREAM_SPECS

SPECS: dict[str, StageSpec] = {
    **UPSTREAM_SPECS,
    "memory_embeddings": StageSpec(
        entries=("index.embeddings",), upstream=("memories", "turns"), inputs=lambda: (embedding_version.embedder_version(),)),
    "memory_indexes": StageSpec(
        entries=("index.vector_store",), upstream=("memory_embeddings",), inputs=lambda: (embedding_version.embedder_version(),)),
}


def stage_version(stage: str) -> str:
    """The `code_version` every row of `stage`'s tables carries (equal to its asset's code_version)."""
    return full_version(stage, SPECS)
