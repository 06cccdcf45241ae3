"""Backend for any OpenAI-compatible chat-completions endpoint, first of all `vllm serve`.

Requests run concurrently on an httpx.AsyncClient, at most `max_concurrency` in flight, from plain
sync calls: `generate` (a list in, a list out) and `generate_each` (each result handed to a
callback the moment it finishes, new requests submitted as slots free up, so the engine is never
idle waiting for the slowest request of a batch). Structured output is requested both ways vLLM
understands: `response_format={"type": "json_schema", ...}` (the OpenAI form) and vLLM's own
`structured_outputs: {"json": schema}` request field. (vLLM >= 0.12 silently ignores the old
`guided_json` field, so it is never sent.)

Streaming (`stream: true`, default): tokens arrive as server-sent events, so a slow generation
that keeps progressing is never cut; a request is cut only after `stall` seconds without a byte
(before the response headers, or between events once its first event came: a request the server
accepted may wait in the engine's queue for its first token), or past its overall bound
(`RequestTimeouts`: derived from max_tokens and a tokens/s floor unless fixed). Cutting a request
closes its connection, and vLLM aborts a request whose client disconnected, so a retry never
runs next to the generation it replaces. Usage comes from the final chunk
(`stream_options.include_usage`). A server that ignores `stream` and answers with a plain
completion is read as one.

Faults, per request: 429 (Retry-After honoured, capped at `max_retry_after_s`), 5xx, timeouts
(stall / overall; a hung server is a stall), dropped or cut connections (a stream that ends before
its finish) are retried with bounded exponential backoff (`backoff_base_s * 2**n`, capped at
`backoff_max_s`, seeded jitter) up to `max_retries` times. A body that is not a chat completion (a
proxy's HTML page) is retried too, and if it persists becomes that request's `invalid_json` result
(the caller quarantines it): the server answers, so the run goes on. 401/403/404 mean a wrong URL
or key and stop at once. A request still failing after its retries raises `LLMEndpointError` naming
the URL: nothing new is submitted, the requests in flight run to their end (their results are
handed over), and the error's `partial_results` (from `generate`) carries what finished.
"""

import asyncio
import json
import random
import threading
import time
from collections import deque
from typing import Any

import httpx

from qumem_pipeline.llm.base import (
    ERROR_HTTP,
    ERROR_INVALID_JSON,
    BackendBase,
    ChatRequest,
    ChatResult,
    LLMEndpointError,
    OnResult,
    read_output,
)
from qumem_pipeline.llm.timeouts import RequestTimeouts

RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
CONFIG_STATUS = {401, 403, 404}  # the same for every request: wrong base_url, model route or key
MALFORMED = "malformed response body"


class _Retryable(Exception):
    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


class _Reply:
    """What one successful HTTP exchange produced: the completion's text, finish and usage."""

    def __init__(self, text: str, finish: str | None, usage: dict, content_chunks: int | None = None) -> None:
        self.text, self.finish, self.usage, self.content_chunks = text, finish, usage, content_chunks


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


def _run_sync(make_coro):
    """Run a coroutine from sync code, on a helper thread when a loop is already running here."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make_coro())
    box: dict[str, Any] = {}

    def runner() -> None:
        try:
            box["v"] = asyncio.run(make_coro())
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["e"] = exc

    th = threading.Thread(target=runner, daemon=True)
    th.start()
    th.join()
    if "e" in box:
        raise box["e"]
    return box["v"]


class OpenAIBackend(BackendBase):
    backend_name = "openai"

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000/v1",
        model: str | None = None,
        api_key: str | None = None,
        max_concurrency: int = 64,
        timeout_s: float | None = None,
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
        stream: bool = True,
        stall_timeout_s: float | None = None,
        min_tokens_per_s: float | None = None,
        timeout_env_kind: str = "openai",
    ) -> None:
        """`timeout_s`: a fixed overall bound per request (None: derived from max_tokens, see
        `RequestTimeouts`); `stall_timeout_s`: seconds without progress before a request is cut;
        `min_tokens_per_s`: the decode-rate floor the derived bound assumes. Unset ones come from
        QUMEM_LLM_<KIND>_* then QUMEM_LLM_* (KIND = `timeout_env_kind`)."""
        base_url = base_url.rstrip("/")
        if not base_url.endswith("/v1"):
            base_url = base_url + "/v1"
        self.base_url = base_url
        self.url = f"{base_url}/chat/completions"
        self.api_key = api_key
        self.max_concurrency = max(1, int(max_concurrency))
        self.timeouts = RequestTimeouts.resolve(timeout_env_kind, overall_s=timeout_s, stall_s=stall_timeout_s,
                                                min_tokens_per_s=min_tokens_per_s)
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
        self.stream = bool(stream)
        self._rng = random.Random(seed)
        self._model = model
        self._gone: LLMEndpointError | None = None  # set once a request exhausts its retries

    # -- model name ---------------------------------------------------------------------------
    @property
    def model_name(self) -> str:  # type: ignore[override]
        """The configured model, else the id the server serves (`GET /v1/models`), asked once:
        what every output row and ledger row records."""
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
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
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

    # -- one HTTP exchange ----------------------------------------------------------------------
    async def _exchange(self, client: httpx.AsyncClient, req: ChatRequest, body: dict, attempt: int) -> "_Reply | ChatResult":
        overall = self.timeouts.overall_for(req.max_tokens)
        # without streaming nothing arrives before the end: only the overall bound can apply
        stall = self.timeouts.stall_for(req.max_tokens) if self.stream else overall
        # The stall bound is kept here, not by httpx's read timeout (only a backstop at the overall
        # bound), because it must not run while a streamed request waits in the engine's queue:
        # vLLM sends the response headers at once and the first event only with the first token,
        # which a full engine (64 in flight on 2 CPU cores) takes minutes to reach; cutting it there
        # re-queued it at the back and paid its prefill twice (issue 18).
        timeout = httpx.Timeout(connect=self.connect_timeout_s, read=overall, write=stall, pool=None)
        loop = asyncio.get_running_loop()
        try:
            # until the headers: connecting (its own bound) and then `stall`
            async with asyncio.timeout_at(loop.time() + self.connect_timeout_s + stall) as bound:
                return await self._exchange_within(client, req, body, attempt, timeout,
                                                   lambda when: bound.reschedule(None if when is None else loop.time() + when),
                                                   stall)
        except TimeoutError:  # only `bound` raises it here (the overall bound fires outside, in `_one`)
            raise _Retryable(f"timeout: no progress for {stall:g}s") from None

    async def _exchange_within(self, client: httpx.AsyncClient, req: ChatRequest, body: dict, attempt: int,
                               timeout: httpx.Timeout, rearm, stall: float) -> "_Reply | ChatResult":
        # Leaving this block by any exit (finished, stalled, over its bound, cancelled) closes the
        # response; an unfinished one takes its connection with it, which makes vLLM abort it.
        async with client.stream("POST", self.url, json=body, headers=self._headers(), timeout=timeout) as resp:
            if resp.status_code >= 400:
                text = (await resp.aread()).decode("utf-8", "replace")
                if resp.status_code in RETRY_STATUS:
                    raise _Retryable(f"HTTP {resp.status_code}: {text[:200]}",
                                     _retry_after_seconds(resp.headers.get("retry-after")))
                if resp.status_code in CONFIG_STATUS:
                    self._gone = LLMEndpointError(
                        self.url, f"HTTP {resp.status_code}: {text[:200]} (check base_url, the model name "
                        "and the API key)", attempt + 1)
                    raise self._gone
                # A client error (bad request, context too long): not retried; the caller
                # quarantines the episode and the run goes on.
                return ChatResult(request_id=req.request_id, parsed=None, raw_text=text,
                                  error=f"{ERROR_HTTP}: HTTP {resp.status_code}: {text[:500]}", attempts=attempt + 1)
            if "text/event-stream" in resp.headers.get("content-type", ""):
                rearm(None)  # accepted: queued until its first token, under the overall bound only
                return await self._read_stream(resp, lambda: rearm(stall))
            raw = (await resp.aread()).decode("utf-8", "replace")  # a plain completion (stream ignored or off)
            try:
                payload = json.loads(raw)
                choice = payload["choices"][0]
                text = choice["message"].get("content") or ""
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                raise _Retryable(f"{MALFORMED} ({type(exc).__name__}): {raw[:200]}")
            return _Reply(text, choice.get("finish_reason"), payload.get("usage") or {})

    async def _read_stream(self, resp: httpx.Response, progressed=lambda: None) -> _Reply:
        """The streamed completion; `progressed()` after each line received (the stall bound restarts)."""
        parts: list[str] = []
        finish: str | None = None
        usage: dict = {}
        chunks = 0
        done = False
        async for line in resp.aiter_lines():
            progressed()
            if not line.startswith("data:"):
                continue  # blank separators, `event:` / `:` comment lines
            data = line[5:].strip()
            if data == "[DONE]":
                done = True  # read on to the body's end, so the connection can be reused
                continue
            if done:
                continue
            try:
                chunk = json.loads(data)
            except ValueError:
                raise _Retryable(f"{MALFORMED} (bad stream chunk): {data[:200]}") from None
            if not isinstance(chunk, dict):
                raise _Retryable(f"{MALFORMED} (bad stream chunk): {data[:200]}")
            if chunk.get("error"):
                raise _Retryable(f"error mid-stream: {json.dumps(chunk['error'])[:200]}")
            for c in chunk.get("choices") or []:
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    parts.append(piece)
                    chunks += 1
                if c.get("finish_reason"):
                    finish = c["finish_reason"]
            if chunk.get("usage"):
                usage = chunk["usage"]
        if finish is None:
            # the connection ended (or [DONE] came) before the generation finished: a cut stream
            raise _Retryable(f"stream ended before the completion finished ({'[DONE]' if done else 'no [DONE]'}, "
                             f"{chunks} chunks)")
        return _Reply("".join(parts), finish, usage, chunks)

    # -- one request, with its retries --------------------------------------------------------
    async def _one(self, client: httpx.AsyncClient, req: ChatRequest) -> ChatResult:
        body = self.build_body(req)
        last_reason = ""
        started = time.perf_counter()
        overall = self.timeouts.overall_for(req.max_tokens)
        for attempt in range(self.max_retries + 1):
            if self._gone is not None:
                # Another request already used up its retries on this endpoint: fail fast
                # instead of spending every queued request's retry budget on a dead server.
                raise self._gone
            try:
                async with asyncio.timeout(overall):
                    out = await self._exchange(client, req, body, attempt)
                if isinstance(out, ChatResult):
                    out.latency_s = time.perf_counter() - started
                    return out
                return self._result(req, out, time.perf_counter() - started, attempt + 1)
            except _Retryable as exc:
                last_reason = exc.reason
                delay = self._backoff(attempt, exc.retry_after)
            except TimeoutError:  # asyncio.timeout: streaming, but not done within the overall bound
                last_reason = f"timeout: no completion within {overall:g}s (overall bound for max_tokens={req.max_tokens})"
                delay = self._backoff(attempt, None)
            except httpx.TimeoutException as exc:  # connect, write, or the read backstop
                last_reason = f"timeout ({type(exc).__name__}): {exc}"
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

    def _result(self, req: ChatRequest, reply: _Reply, latency: float, attempts: int) -> ChatResult:
        usage, text, finish = reply.usage, reply.text, reply.finish
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        completion = usage.get("completion_tokens")
        if completion is None and reply.content_chunks is not None:
            completion = reply.content_chunks  # a server without include_usage: ~one token per chunk
        parsed, error, salvaged = read_output(text, req.json_schema, finish, req.max_tokens)
        return ChatResult(
            request_id=req.request_id,
            parsed=parsed,
            raw_text=text,
            error=error,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(completion or 0),
            cached_tokens=None if cached is None else int(cached),
            latency_s=latency,
            attempts=attempts,
            finish_reason=finish,
            salvaged=salvaged,
        )

    # -- many requests --------------------------------------------------------------------------
    async def agenerate_each(self, requests: list[ChatRequest], on_result: OnResult) -> None:
        """Keep up to `max_concurrency` requests in flight; hand each result over as it finishes."""
        if not requests:
            return
        _ = self.model_name  # resolve before fanning out
        self._gone = None
        limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
        queue: deque[ChatRequest] = deque(requests)
        running: dict[asyncio.Task, ChatRequest] = {}
        error: BaseException | None = None
        failed = 0
        async with httpx.AsyncClient(limits=limits) as client:
            try:
                while running or (queue and error is None):
                    while queue and error is None and len(running) < self.max_concurrency:
                        r = queue.popleft()
                        running[asyncio.ensure_future(self._one(client, r))] = r
                    finished, _pending = await asyncio.wait(list(running), return_when=asyncio.FIRST_COMPLETED)
                    for t in finished:
                        r = running.pop(t)
                        exc = t.exception()
                        if exc is not None:
                            failed += isinstance(exc, LLMEndpointError)
                            error = error or exc
                            continue
                        follow = on_result(r, t.result()) or []
                        queue.extendleft(reversed(follow))  # retries next: their prefix is still cached
            except BaseException:  # cancelled / interrupted / the callback failed: stop the rest
                for t in running:
                    t.cancel()
                await asyncio.gather(*running, return_exceptions=True)
                raise
        if error is not None:
            if isinstance(error, LLMEndpointError):
                error.failed_requests = failed  # type: ignore[attr-defined]
                error.unsent_requests = len(queue)  # type: ignore[attr-defined]
            raise error

    def generate_each(self, requests: list[ChatRequest], on_result: OnResult) -> None:
        _run_sync(lambda: self.agenerate_each(requests, on_result))

    async def agenerate(self, requests: list[ChatRequest]) -> list[ChatResult]:
        index = {id(r): i for i, r in enumerate(requests)}
        out: list[ChatResult | None] = [None] * len(requests)

        def keep(req: ChatRequest, res: ChatResult) -> None:
            out[index[id(req)]] = res

        try:
            await self.agenerate_each(requests, keep)
        except LLMEndpointError as err:
            err.partial_results = list(out)  # type: ignore[attr-defined]
            raise
        return list(out)  # type: ignore[arg-type]

    def generate(self, requests: list[ChatRequest]) -> list[ChatResult]:
        return _run_sync(lambda: self.agenerate(requests))
