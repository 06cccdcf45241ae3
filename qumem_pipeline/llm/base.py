"""The one LLM interface of the domain core: a batch of chat requests in, parsed objects out.

Every backend (an OpenAI-compatible endpoint such as `vllm serve`, a managed vLLM child process,
the embedded in-process model) takes a list of `ChatRequest` and returns one `ChatResult` per
request, in request order. Output is JSON constrained by each request's JSON schema; the backend
parses and validates it, so callers see either `parsed` or an `error` naming what went wrong.
"""

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import jsonschema

from qumem_pipeline.llm.salvage import ends_in_whitespace_run, salvage_whitespace_cut

# Error kinds a ChatResult can carry (the prefix of `error`, before ':').
ERROR_INVALID_JSON = "invalid_json"
ERROR_SCHEMA = "schema_violation"
ERROR_LENGTH = "length"
ERROR_HTTP = "http_error"


class LLMError(RuntimeError):
    """Base class of LLM-layer failures that stop a run."""


class LLMEndpointError(LLMError):
    """An endpoint that stayed unreachable (or kept failing) after every retry."""

    def __init__(self, url: str, reason: str, attempts: int) -> None:
        self.url = url
        self.reason = reason
        self.attempts = attempts
        super().__init__(
            f"LLM endpoint {url} failed after {attempts} attempt(s): {reason}. "
            "Check that the server is running and reachable (base_url), then rerun; "
            "outputs already written are left intact."
        )


@dataclass
class ChatRequest:
    request_id: str
    messages: list[dict[str, str]]
    json_schema: dict[str, Any] | None = None
    max_tokens: int = 512
    schema_name: str = "output"
    metadata: dict[str, Any] = field(default_factory=dict)
    # Optional tighter schema that decoding is constrained to (e.g. evidence ids bounded to one
    # episode); output is still validated against `json_schema`, so a server that ignores the
    # constraint cannot turn a recoverable detail into a schema violation. Default: json_schema.
    constraint_schema: dict[str, Any] | None = None

    @property
    def decoding_schema(self) -> dict[str, Any] | None:
        return self.constraint_schema if self.constraint_schema is not None else self.json_schema


@dataclass
class ChatResult:
    request_id: str
    parsed: dict[str, Any] | None
    raw_text: str
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    latency_s: float = 0.0
    attempts: int = 1
    finish_reason: str | None = None
    # True when the output was cut at max_tokens in a whitespace run and closed after its last
    # finished value (see `llm.salvage`): `parsed` is what the model wrote before the run.
    salvaged: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and self.parsed is not None

    @property
    def error_kind(self) -> str | None:
        return None if self.error is None else self.error.split(":", 1)[0]


@runtime_checkable
class LLMBackend(Protocol):
    model_name: str
    backend_name: str

    def generate(self, requests: list[ChatRequest]) -> list[ChatResult]: ...

    def close(self) -> None: ...


# on_result(request, result) -> follow-up requests to submit (e.g. a retry), or None
OnResult = Callable[[ChatRequest, ChatResult], "list[ChatRequest] | None"]


def generate_each_by_rounds(backend: Any, requests: list[ChatRequest], on_result: OnResult) -> None:
    """`generate_each` for a backend that only has `generate`: one `generate` per round of
    follow-ups, each result handed to `on_result` as soon as its round returns. On an endpoint
    failure the finished results of that round are handed over before the error is raised."""
    pending = list(requests)
    while pending:
        try:
            results = backend.generate(pending)
        except LLMEndpointError as exc:
            for req, res in zip(pending, getattr(exc, "partial_results", None) or []):
                if res is not None:
                    on_result(req, res)  # follow-ups of a failed round are not sent
            raise
        if len(results) != len(pending):
            raise RuntimeError(f"backend returned {len(results)} results for {len(pending)} requests")
        follow: list[ChatRequest] = []
        for req, res in zip(pending, results):
            follow.extend(on_result(req, res) or [])
        pending = follow


def generate_each(backend: Any, requests: list[ChatRequest], on_result: OnResult) -> None:
    """Run `requests` with the backend's bound on requests in flight and call `on_result` for each
    one the moment it finishes (in completion order); the requests it returns are submitted too.

    Why: a caller that checkpoints each finished call as it arrives loses nothing on a later
    failure, and a backend that submits continuously never idles its engine waiting for the
    slowest request of a batch. Raises `LLMEndpointError` after handing over every result that
    did finish."""
    fn = getattr(backend, "generate_each", None)
    if fn is not None:
        fn(requests, on_result)
    else:
        generate_each_by_rounds(backend, requests, on_result)


def collect_each(generate_each_fn: Callable[[list[ChatRequest], OnResult], None],
                 requests: list[ChatRequest]) -> list[ChatResult]:
    """`generate` as a wrapper's own ``generate_each`` collected in request order. Why: a wrapper that keeps
    each call as it finishes (the evaluation record, a run's ledger) then keeps it on the `generate` path too,
    so a batch stopped part-way (SIGTERM, Ctrl-C, an endpoint failure) has lost no finished call. On an
    `LLMEndpointError` its ``partial_results`` are the finished results aligned to ``requests``."""
    slots: dict[int, list[int]] = defaultdict(list)
    for i, r in enumerate(requests):
        slots[id(r)].append(i)
    out: list[ChatResult | None] = [None] * len(requests)

    def keep(req: ChatRequest, res: ChatResult) -> list[ChatRequest]:
        out[slots[id(req)].pop(0)] = res
        return []

    try:
        generate_each_fn(list(requests), keep)
    except LLMEndpointError as err:
        err.partial_results = list(out)  # type: ignore[attr-defined]
        raise
    return out  # type: ignore[return-value]


class BackendBase:
    """Context-manager plumbing shared by the concrete backends."""

    model_name: str = ""
    backend_name: str = ""

    def generate(self, requests: list[ChatRequest]) -> list[ChatResult]:  # pragma: no cover
        raise NotImplementedError

    def generate_each(self, requests: list[ChatRequest], on_result: OnResult) -> None:
        """Results as they finish (see `generate_each`); backends that can do better override it."""
        generate_each_by_rounds(self, requests, on_result)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def parse_structured(raw_text: str, schema: dict[str, Any] | None) -> tuple[dict | None, str | None]:
    """Parse model output as JSON and validate it: (parsed, None) or (None, 'kind: reason')."""
    try:
        value = json.loads(raw_text)
    except (json.JSONDecodeError, TypeError) as exc:
        return None, f"{ERROR_INVALID_JSON}: {exc}"
    if schema is not None:
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError as exc:
            path = "/".join(str(p) for p in exc.absolute_path) or "<root>"
            return None, f"{ERROR_SCHEMA}: at {path}: {exc.message}"
    if not isinstance(value, dict):
        return None, f"{ERROR_SCHEMA}: top-level value is {type(value).__name__}, not an object"
    return value, None


def read_output(raw_text: str, schema: dict[str, Any] | None, finish: str | None,
                max_tokens: int) -> tuple[dict | None, str | None, bool]:
    """(parsed, error, salvaged) for one completion: `parse_structured`, then, for an output cut at
    its budget in a whitespace run, the finished JSON before the run (`llm.salvage`). Every backend
    and the evaluation ledger's replay read outputs through this, so a rerun reads them alike."""
    parsed, error = (None, None)
    if schema is not None or raw_text:
        parsed, error = parse_structured(raw_text, schema)
    if error is None or finish != "length":
        return parsed, error, False
    rescued = salvage_whitespace_cut(raw_text, schema)
    if rescued is not None:
        return rescued, None, True
    hint = ""
    if schema is not None and ends_in_whitespace_run(raw_text):
        hint = (" [output ends in a whitespace run after an unfinished value: the server lets free whitespace "
                "into JSON; start vLLM with --structured-outputs-config "
                "'{\"backend\":\"xgrammar\",\"disable_any_whitespace\":true}']")
    return None, f"{ERROR_LENGTH}: output cut at max_tokens={max_tokens}{hint} ({error})", False
