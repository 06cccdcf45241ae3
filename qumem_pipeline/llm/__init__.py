"""The domain core's LLM layer: one batch interface, several backends chosen by configuration.

Importing this package loads no model and starts no process; see `make_backend`.
"""

from qumem_pipeline.llm.base import (
    BackendBase,
    ChatRequest,
    ChatResult,
    LLMBackend,
    LLMEndpointError,
    LLMError,
    parse_structured,
)
from qumem_pipeline.llm.factory import BACKEND_KINDS, make_backend

__all__ = [
    "BACKEND_KINDS",
    "BackendBase",
    "ChatRequest",
    "ChatResult",
    "LLMBackend",
    "LLMEndpointError",
    "LLMError",
    "make_backend",
    "parse_structured",
]
