"""Which LLM writes a stage's rows, as a version input of the stages that call one (memories, persona
profiles, query states, personalization). Never followed by the source digests."""

import os


def llm_model_id() -> str:
    """The backend kind (the environment's default when unset, as `resources` chooses it) and model (the
    embedded GGUF's sha256 when local; without QUMEM_LLM_MODEL a server's model is named by its URL, since
    versions are computed without asking it)."""
    from qumem_pipeline.llm.model_store import DEFAULT_MODEL

    default_kind = "openai" if os.environ.get("QUMEM_ENV") == "production" else "local"
    kind = os.environ.get("QUMEM_LLM_KIND") or default_kind
    model = os.environ.get("QUMEM_LLM_MODEL")
    if not model:
        model = (f"{DEFAULT_MODEL.name}@{DEFAULT_MODEL.gguf_sha256[:12]}" if kind == "local"
                 else f"served-by:{os.environ.get('QUMEM_LLM_BASE_URL', '')}")
    return f"{kind}:{model}"
