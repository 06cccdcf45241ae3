"""The query stages' versions (AdaMem's persona profiles and graph, query states, and the bulk
personalization job): what they declare (`SPECS`, with their upstream stages'). Never followed by the
source digests; hashed by `qumem_pipeline.contracts.stage_versions`."""

import qumem_pipeline.embedding.version as embedding_version
from qumem_pipeline.contracts.stage_versions import StageSpec, full_version
from qumem_pipeline.index.version import SPECS as UPSTREAM_SPECS
from qumem_pipeline.llm.version import llm_model_id

_QUERY_ENTRIES = ("query.stage", "query.queries", "query.retrieval", "query.retrievers", "query.strategies.registry", "llm.factory")

SPECS: dict[str, StageSpec] = {
    **UPSTREAM_SPECS,
    "persona_profiles": StageSpec(
        entries=("query.strategies.adamem.profiles", "llm.factory"), upstream=("memories", "memory_embeddings"),
        inputs=lambda: (llm_model_id(), embedding_version.embedder_version())),
    "memory_graph": StageSpec(
        entries=("query.strategies.adamem.graph",), upstream=("turns", "episodes", "memories", "persona_profiles")),
    "query_states": StageSpec(
        entries=_QUERY_ENTRIES, upstream=("memory_indexes", "turns", "memory_graph"),
        inputs=lambda: (llm_model_id(), embedding_version.embedder_version())),
    # run by a job of its own, not an asset (`assets/personalize.py`); its rows carry its version all the same
    "personalization": StageSpec(
        entries=("query.personalize", "query.batch_input", "query.queries", "query.retrievers",
                 "query.strategies.registry", "llm.factory"),
        upstream=("memory_indexes", "turns", "memory_graph"), inputs=lambda: (llm_model_id(), embedding_version.embedder_version())),
}


def stage_version(stage: str) -> str:
    """The `code_version` every row of `stage`'s tables carries (equal to its asset's code_version)."""
    return full_version(stage, SPECS)
