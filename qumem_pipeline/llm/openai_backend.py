"""Backend for any OpenAI-compatible chat-completions endpoint, first of all `vllm serve`.

Requests run concurrently on an httpx.AsyncClient (bounded by a semaphore) from a plain sync
`generate`. Structured output is requested both ways vLLM understands:
`response_format={"type": "json_schema", ...}` (the OpenAI form) and vLLM's own
`structured_outputs: {"json": schema}` request field. (vLLM >= 0.12 silently ignores the old
`guided_json` field, so it is never sent.)

Faults, per request: 429 (Retry-After honoured, capped at `max_retry_after_s`), 5xx, timeouts
(`timeout_s` per request; a hung server is a timeout), dropped or cut connections are retried with
bounded exponential backoff (`backoff_base_s * 2**n`, capped at `backoff_max_s`, seeded jitter) up to
`max_retries` times. A body that is not a chat completion (a proxy's HTML page) is retried too, and
if it persists becomes that request's `invalid_json` result (the caller quarantines it): the server
answers, so the run goes on. 401/403/404 mean a wrong URL or key and stop at once. A request still
failing after its retries raises `LLMEndpointError` naming the URL, after every other request of the
batch has finished; the error's `partial_results` carries those results so the caller can keep them.
"""

import asyncio
import random
import threading
import time
from typing import Any

import httpx

from qumem_pipeline.llm.base import (
    ERROR_HTTP,
    ERROR_INVALID_JSON,
    ERROR_LENGTH,
    BackendBase,
    ChatRequest,
    ChatResult,
    LLMEndpointError,
    parse_structured,
)

RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
CONFIG_STATUS = {401, 403, 404}  # the same for every request: wrong base_url, model route or key
MALFORMED = "malformed response body"


class _Retryable(Exception):
    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


def _retry_after_seconds(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:  # HTTP-date form
        from email.utils import parsedate_to_datetime

        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


class OpenAIBackend(BackendBase):
    backend_name = "openai"

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000/v1",
        model: str | None = None,
        api_key: str | None = None,
        max_concurrency: int = 64,
        timeout_s: float = 120.0,
        connect_timeout_s: float = 10.0,
        max_retries: int = 4,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 20.0,
        max_retry_after_s: float = 60.0,
        seed: int = 0,
        temperature: float = 0.0,
        send_response_format: bool = True,
        send_structured_outputs: bool = True,
        strict: bool = True,
        compact_json: bool = True,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        base_url = base_url.rstrip("/")
        if not base_url.endswith("/v1"):
            base_url = base_url + "/v1"
        self.base_url = base_url
        self.url = f"{base_url}/chat/completions"
        self.api_key = api_key
        self.max_concurrency = max(1, int(max_concurrency))
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_base_s = float(backoff_base_s)
        self.backoff_max_s = float(backoff_max_s)
        self.max_retry_after_s = float(max_retry_after_s)
        self.seed = seed
        self.temperature = temperature
        self.send_response_format = send_response_format
        self.send_structured_outputs = send_structured_outputs
        self.strict = strict
        self.compact_json = compact_json
        self.extra_body = dict(extra_body or {})
        self._rng = random.Random(seed)
        self._model = model
        self._gone: LLMEndpointError | None = None  # set once a request exhausts its retries

    # -- model name ---------------------------------------------------------------------------
    @property
    def model_name(self) -> str:  # type: ignore[override]
        if self._model is None:
            self._model = self._discover_model()
        return self._model

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _discover_model(self) -> str:
        url = f"{self.base_url}/models"
        last = "no attempt"
        for attempt in range(self.max_retries + 1):
            try:
                r = httpx.get(url, headers=self._headers(), timeout=self.connect_timeout_s + 5)
                r.raise_for_status()
                data = r.json().get("data") or []
                if not data:
                    raise LLMEndpointError(url, "the server lists no models", attempt + 1)
                return str(data[0]["id"])
            except (httpx.TransportError, httpx.HTTPStatusError, ValueError, KeyError, TypeError) as exc:
                last = f"{type(exc).__name__}: {exc}"
                time.sleep(self._backoff(attempt, None))
        raise LLMEndpointError(url, last, self.max_retries + 1)

    # -- request body -------------------------------------------------------------------------
    def build_body(self, req: ChatRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model_name,
            "messages": req.messages,
            "max_tokens": int(req.max_tokens),
            "temperature": self.temperature,
            "seed": self.seed,
        }
        schema = req.decoding_schema
        if schema is not None:
            if self.send_response_format:
                body["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": req.schema_name, "schema": schema, "strict": self.strict},
                }
            if self.send_structured_outputs:
                so: dict[str, Any] = {"json": schema}
                if self.compact_json:
                    # Asks for no free whitespace between JSON tokens. NOTE: vLLM 0.32 ignores this
                    # per-request field and honours only the server's
                    # `--structured-outputs-config '{"backend":"xgrammar","disable_any_whitespace":true}'`
                    # (vllm-managed passes it); sent anyway for servers that read it.
                    so["disable_any_whitespace"] = True
                body["structured_outputs"] = so
        body.update(self.extra_body)
        return body

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, self.max_retry_after_s)
        base = min(self.backoff_max_s, self.backoff_base_s * (2**attempt))
        return base * (0.5 + 0.5 * self._rng.random())  # seeded jitter in [0.5, 1.0] x base

    # -- one request --------------------------------------------------------------------------
    async def _one(self, client: httpx.AsyncClient, sem: asyncio.Semaphore, req: ChatRequest) -> ChatResult:
        body = self.build_body(req)
        last_reason = ""
        async with sem:
            started = time.perf_counter()
            for attempt in range(self.max_retries + 1):
                if self._gone is not None:
                    # Another request already used up its retries on this endpoint: fail fast
                    # instead of spending every queued request's retry budget on a dead server.
                    raise self._gone
                try:
                    resp = await client.post(self.url, json=body, headers=self._headers())
                    if resp.status_code in RETRY_STATUS:
                        raise _Retryable(
                            f"HTTP {resp.status_code}: {resp.text[:200]}",
                            _retry_after_seconds(resp.headers.get("retry-after")),
                        )
                    if resp.status_code in CONFIG_STATUS:
                        self._gone = LLMEndpointError(
                            self.url, f"HTTP {resp.status_code}: {resp.text[:200]} (check base_url, the model name "
                            "and the API key)", attempt + 1)
                        raise self._gone
                    if resp.status_code >= 400:
                        # A client error (bad request, context too long): not retried; the caller
                        # quarantines the episode and the run goes on.
                        return ChatResult(
                            request_id=req.request_id,
                            parsed=None,
                            raw_text=resp.text,
                            error=f"{ERROR_HTTP}: HTTP {resp.status_code}: {resp.text[:500]}",
                            latency_s=time.perf_counter() - started,
                            attempts=attempt + 1,
                        )
                    try:
                        payload = resp.json()
                        choice = payload["choices"][0]
                        text = choice["message"].get("content") or ""
                    except (ValueError, KeyError, IndexError, TypeError) as exc:
                        raise _Retryable(f"{MALFORMED} ({type(exc).__name__}): {resp.text[:200]}")
                    return self._result(req, payload, choice, text, time.perf_counter() - started, attempt + 1)
                except _Retryable as exc:
                    last_reason = exc.reason
                    delay = self._backoff(attempt, exc.retry_after)
                except httpx.TimeoutException as exc:
                    last_reason = f"timeout after {self.timeout_s:g}s ({type(exc).__name__})"
                    delay = self._backoff(attempt, None)
                except httpx.TransportError as exc:
                    last_reason = f"{type(exc).__name__}: {exc}"
                    delay = self._backoff(attempt, None)
                if attempt < self.max_retries:
                    await asyncio.sleep(delay)
        if last_reason.startswith(MALFORMED):
            # The server is up and answering, just not with a completion for this request.
            return ChatResult(request_id=req.request_id, parsed=None, raw_text=last_reason,
                              error=f"{ERROR_INVALID_JSON}: {last_reason}", latency_s=time.perf_counter() - started,
                              attempts=self.max_retries + 1)
        self._gone = LLMEndpointError(self.url, last_reason, self.max_retries + 1)
        raise self._gone

    def _result(self, req, payload, choice, text, latency, attempts) -> ChatResult:
        usage = payload.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        finish = choice.get("finish_reason")
        parsed, error = (None, None)
        if req.json_schema is not None or text:
            parsed, error = parse_structured(text, req.json_schema)
        if error is not None and finish == "length":
            hint = ""
            if req.json_schema is not None and len(text) >= 32 and not text[-32:].strip():
                hint = (" [output ends in a whitespace run: the server lets free whitespace into JSON; start "
                        "vLLM with --structured-outputs-config '{\"backend\":\"xgrammar\",\"disable_any_whitespace\":true}']")
            error = f"{ERROR_LENGTH}: output cut at max_tokens={req.max_tokens}{hint} ({error})"
        return ChatResult(
            request_id=req.request_id,
            parsed=parsed,
            raw_text=text,
            error=error,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            cached_tokens=None if cached is None else int(cached),
            latency_s=latency,
            attempts=attempts,
            finish_reason=finish,
        )

    # -- batch --------------------------------------------------------------------------------
    async def agenerate(self, requests: list[ChatRequest]) -> list[ChatResult]:
        if not requests:
            return []
        _ = self.model_name  # resolve before fanning out
        self._gone: LLMEndpointError | None = None
        sem = asyncio.Semaphore(self.max_concurrency)
        limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
        timeout = httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            tasks = [asyncio.ensure_future(self._one(client, sem, r)) for r in requests]
            try:
                # Every request runs to its own end (each bounded by its retries), so results that did
                # succeed are handed back with the error instead of being thrown away.
                outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            except BaseException:  # cancelled / interrupted: stop the rest
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
        for o in outcomes:
            if isinstance(o, BaseException) and not isinstance(o, LLMEndpointError):
                raise o
        failed = [o for o in outcomes if isinstance(o, LLMEndpointError)]
        if failed:
            err = failed[0]
            err.partial_results = [None if isinstance(o, BaseException) else o for o in outcomes]
            err.failed_requests = len(failed)
            raise err
        return list(outcomes)

    def generate(self, requests: list[ChatRequest]) -> list[ChatResult]:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.agenerate(requests))
        # Called from inside a running event loop: run ours on a helper thread.
        box: dict[str, Any] = {}

        def runner() -> None:
            try:
                box["v"] = asyncio.run(self.agenerate(requests))
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                box["e"] = exc

        th = threading.Thread(target=runner, daemon=True)
        th.start()
        th.join()
        if "e" in box:
            raise box["e"]
        return box["v"]
