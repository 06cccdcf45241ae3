"""Which LLM writes a stage's rows, as a version input of the stages that call one (memories, persona
profiles, query states, personalization). Never followed by the source digests."""

import os


def llm_model_id() -> str:
    """The backend kind (the environment's default when unset, as `resources` chooses it) and model (the
    embedded GGUF's sha256 when local; without QUMEM_LLM_MODEL a server's model is named by its URL, since
    versions are computed without asking it)."""
    from qumem_pipeline.llm.model_store import local_spec

    default_kind = "openai" if os.environ.get("QUMEM_ENV") == "production" else "local"
    kind = os.environ.get("QUMEM_LLM_KIND") or default_kind
    model = os.environ.get("QUMEM_LLM_MODEL")
    if not model and kind == "local" and os.environ.get("QUMEM_LLM_MODEL_DIR"):
        model = f"dir:{os.path.basename(os.path.normpath(os.environ['QUMEM_LLM_MODEL_DIR']))}"
    if not model:
        spec = local_spec() if kind == "local" else None
        model = (f"{spec.name}@{spec.gguf_sha256[:12]}" if spec is not None
                 else f"served-by:{os.environ.get('QUMEM_LLM_BASE_URL', '')}")
    if kind == "local":
        from qumem_pipeline.llm.model_profiles import profile_for

        weights = profile_for(model.split("@")[0].removeprefix("dir:")).weights
        model += f"+{weights}" if weights else ""  # bf16 weights decode other tokens than float32's
    return f"{kind}:{model}"
