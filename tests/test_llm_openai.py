"""The `openai` backend against a real local HTTP server process serving scripted replies."""

import json

import pytest

from fake_openai_server import RunningFakeServer
from qumem_pipeline.llm import ChatRequest, LLMEndpointError, make_backend
from qumem_pipeline.runtime.processes import free_port

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}},
    "required": ["answer"],
    "additionalProperties": False,
}


def req(i: int, text: str, max_tokens: int = 32) -> ChatRequest:
    return ChatRequest(
        request_id=f"r{i}",
        messages=[{"role": "system", "content": "sys"}, {"role": "user", "content": text}],
        json_schema=SCHEMA,
        max_tokens=max_tokens,
        schema_name="answer_obj",
    )


def backend(server, **kw):
    cfg = dict(base_url=server.base_url, max_retries=3, backoff_base_s=0.05, backoff_max_s=0.2, timeout_s=5.0)
    cfg.update(kw)
    return make_backend("openai", **cfg)


def test_request_shape_and_usage(tmp_path):
    script = {"model": "m1", "rules": [{"match": "hello", "responses": [{"json": {"answer": "hi"}, "cached_tokens": 7}]}]}
    with RunningFakeServer(script, tmp_path) as srv, backend(srv) as be:
        assert be.model_name == "m1"  # discovered from /v1/models
        (res,) = be.generate([req(0, "hello")])
        body = srv.requests()[0]["body"]
    assert res.ok and res.parsed == {"answer": "hi"} and res.error is None
    assert res.cached_tokens == 7 and res.prompt_tokens > 0 and res.completion_tokens > 0
    assert res.attempts == 1 and res.latency_s > 0
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "answer_obj", "schema": SCHEMA, "strict": True},
    }
    assert body["structured_outputs"] == {"json": SCHEMA, "disable_any_whitespace": True}
    assert "guided_json" not in body
    assert body["temperature"] == 0 and body["seed"] == 0 and body["max_tokens"] == 32
    assert body["model"] == "m1"
    # streamed, with the usage chunk asked for: token counts are the server's, not estimates
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert res.completion_tokens == len('{"answer": "hi"}') // 4 and res.finish_reason == "stop"


def test_plain_completion_without_streaming(tmp_path):
    script = {"default": [{"json": {"answer": "x"}, "cached_tokens": 3}]}
    with RunningFakeServer(script, tmp_path) as srv, backend(srv, model="m", stream=False) as be:
        (res,) = be.generate([req(0, "q")])
        body = srv.requests()[0]["body"]
    assert "stream" not in body and "stream_options" not in body
    assert res.ok and res.parsed == {"answer": "x"} and res.cached_tokens == 3
    assert res.completion_tokens == len('{"answer": "x"}') // 4


def test_cached_tokens_absent_is_none(tmp_path):
    script = {"default": [{"json": {"answer": "x"}}]}
    with RunningFakeServer(script, tmp_path) as srv, backend(srv, model="given") as be:
        (res,) = be.generate([req(0, "q")])
    assert res.ok and res.cached_tokens is None


@pytest.mark.parametrize(
    "first",
    [
        {"status": 500},
        {"status": 503},
        {"hang": 3},  # longer than the 1 s client timeout
        {"drop": True},
        {"truncate": True},  # the stream is cut before its finish chunk
        {"garbage": "<html>proxy error</html>"},
    ],
    ids=["500", "503", "timeout", "dropped-connection", "stream-cut", "non-json-body"],
)
def test_transient_failures_are_retried(tmp_path, first):
    script = {"rules": [{"match": "q", "responses": [first, {"json": {"answer": "ok"}}]}]}
    with RunningFakeServer(script, tmp_path) as srv, backend(srv, model="m", timeout_s=1.0) as be:
        (res,) = be.generate([req(0, "q")])
        n = len(srv.requests())
    assert res.ok and res.parsed == {"answer": "ok"}
    assert res.attempts == 2 and n == 2


def test_429_honours_retry_after(tmp_path):
    script = {"rules": [{"match": "q", "responses": [{"status": 429, "retry_after": 1}, {"json": {"answer": "ok"}}]}]}
    with RunningFakeServer(script, tmp_path) as srv, backend(srv, model="m") as be:
        (res,) = be.generate([req(0, "q")])
        times = [r["t"] for r in srv.requests()]
    assert res.ok and res.attempts == 2
    # the server saw the retry no sooner than Retry-After (a lower bound: load cannot break it)
    assert times[1] - times[0] >= 0.9  # not the 0.05 s backoff


def test_bad_model_output_is_reported_not_retried(tmp_path):
    script = {
        "rules": [
            {"match": "broken", "responses": [{"content": '{"answer": "unterminated'}]},
            {"match": "wrongtype", "responses": [{"json": {"answer": 5}}]},
            {"match": "cut", "responses": [{"content": '{"answ', "finish_reason": "length"}]},
        ]
    }
    with RunningFakeServer(script, tmp_path) as srv, backend(srv, model="m") as be:
        a, b, c = be.generate([req(0, "broken"), req(1, "wrongtype"), req(2, "cut")])
        assert len(srv.requests()) == 3
    assert a.parsed is None and a.error_kind == "invalid_json" and a.raw_text == '{"answer": "unterminated'
    assert b.parsed is None and b.error_kind == "schema_violation" and "answer" in b.error
    assert c.error_kind == "length"


def test_client_error_is_a_result_not_a_crash(tmp_path):
    script = {"rules": [{"match": "toolong", "responses": [{"status": 400}]}], "default": [{"json": {"answer": "y"}}]}
    with RunningFakeServer(script, tmp_path) as srv, backend(srv, model="m") as be:
        bad, good = be.generate([req(0, "toolong"), req(1, "fine")])
    assert bad.error_kind == "http_error" and "400" in bad.error and bad.attempts == 1
    assert good.ok


def max_live(generations: list[dict]) -> int:
    """Most generations running at once, replayed from the server's start/end events."""
    live = peak = 0
    for g in generations:
        live += 1 if g["event"] == "start" else -1
        peak = max(peak, live)
    return peak


def test_many_requests_bounded_concurrency_keep_order(tmp_path):
    # each generation streams 3 tokens 0.3 s apart, so the 5 slots overlap; counted on the server
    script = {"rules": [{"match": f"item-{i}:", "responses": [{"token_delay": 0.3, "json": {"answer": str(i)}}]}
                        for i in range(20)]}
    with RunningFakeServer(script, tmp_path) as srv, backend(srv, model="m", max_concurrency=5) as be:
        results = be.generate([req(i, f"item-{i}:") for i in range(20)])
        gens = srv.generations()
    assert [r.parsed["answer"] for r in results] == [str(i) for i in range(20)]
    assert [r.request_id for r in results] == [f"r{i}" for i in range(20)]
    assert len(gens) == 40 and all(g["how"] == "finished" for g in gens if g["event"] == "end")
    assert max_live(gens) == 5  # concurrent, never past the bound


def test_generate_each_hands_over_results_as_they_finish_and_submits_follow_ups(tmp_path):
    # "slow" streams for a while; "fast" and its follow-up finish before it does
    script = {"rules": [{"match": "slow", "responses": [{"token_delay": 0.4, "json": {"answer": "slow"}}]},
                        {"match": "fast", "responses": [{"json": {"answer": "fast"}}]},
                        {"match": "again", "responses": [{"json": {"answer": "again"}}]}]}
    order = []

    def on_result(r, res):
        order.append(res.parsed["answer"])
        return [req(9, "again")] if r.request_id == "r1" else None

    with RunningFakeServer(script, tmp_path) as srv, backend(srv, model="m", max_concurrency=2) as be:
        be.generate_each([req(0, "slow"), req(1, "fast")], on_result)
        n = len(srv.requests())
    # the follow-up went out while "slow" was still generating (a free slot, no batch barrier)
    assert order == ["fast", "again", "slow"] and n == 3


def test_slow_but_progressing_generation_finishes(tmp_path):
    # 40 tokens, 0.05 s apart: the generation takes 4x the 0.5 s that a fixed per-request timeout
    # (the old logic: one bound for the whole answer) allows, so it fails there; streamed, every
    # token is progress and it finishes on its first attempt.
    answer = {"answer": "x" * 146}  # 160 characters of JSON = 40 tokens
    script = {"default": [{"token_delay": 0.05, "json": answer}]}
    with RunningFakeServer(script, tmp_path / "fixed") as srv, \
            backend(srv, model="m", stream=False, timeout_s=0.5, max_retries=0) as be:
        with pytest.raises(LLMEndpointError, match="timeout"):
            be.generate([req(0, "slow", max_tokens=64)])
    with RunningFakeServer(script, tmp_path / "streamed") as srv, \
            backend(srv, model="m", timeout_s=None, stall_timeout_s=0.5, min_tokens_per_s=0.5) as be:
        assert be.timeouts.overall_for(64) == 0.5 + 64 / 0.5  # derived from max_tokens, not fixed
        (res,) = be.generate([req(0, "slow", max_tokens=64)])
        n, gens = len(srv.requests()), srv.generations()
    assert res.ok and res.parsed == answer and res.attempts == 1 and n == 1
    assert res.completion_tokens == 40  # the usage chunk of the stream
    assert [g["event"] for g in gens] == ["start", "end"] and gens[1]["how"] == "finished"


def test_stalled_stream_is_cut_and_retried_with_one_live_generation_at_a_time(tmp_path):
    # first attempt: one token, then the engine goes quiet for 30 s; the client's 0.5 s stall bound
    # cuts it, closing the connection, and the server (like vLLM) aborts that generation before
    # the retry arrives: never two generations of one request at once.
    script = {"rules": [{"match": "q", "responses": [{"stall_after": 1, "stall": 30, "json": {"answer": "ok"}},
                                                     {"json": {"answer": "ok"}}]}]}
    with RunningFakeServer(script, tmp_path) as srv, \
            backend(srv, model="m", timeout_s=None, stall_timeout_s=0.5, backoff_base_s=1.0, backoff_max_s=1.0) as be:
        (res,) = be.generate([req(0, "q")])
        n, gens = len(srv.requests()), srv.generations()
    assert res.ok and res.attempts == 2 and n == 2
    assert [(g["event"], g.get("how")) for g in gens] == [
        ("start", None), ("end", "client_disconnected"), ("start", None), ("end", "finished")]
    assert all(g["live_before"] == 0 for g in gens if g["event"] == "start")


def test_a_request_queued_in_the_engine_is_not_cut_by_the_stall_bound(tmp_path):
    # headers at once, first event 1.5 s later (3x the 0.5 s stall bound), as vLLM does for a request
    # waiting behind a full engine: it is waited for, not cut and re-queued; once its events flow,
    # silence between them is a stall again, and no response headers within the bound is a hang.
    script = {"rules": [{"match": "queued", "responses": [{"queue": 1.5, "json": {"answer": "ok"}}]},
                        {"match": "wedged", "responses": [{"queue": 1.5, "stall_after": 1, "stall": 30,
                                                           "json": {"answer": "ok"}}, {"json": {"answer": "ok"}}]},
                        {"match": "hung", "responses": [{"hang": 3}, {"json": {"answer": "ok"}}]}]}
    with RunningFakeServer(script, tmp_path) as srv, \
            backend(srv, model="m", timeout_s=None, stall_timeout_s=0.5, min_tokens_per_s=0.5,
                    connect_timeout_s=0.5) as be:
        queued, wedged, hung = be.generate([req(0, "queued"), req(1, "wedged"), req(2, "hung")])
        gens = srv.generations()
    assert queued.ok and queued.attempts == 1
    assert wedged.ok and wedged.attempts == 2  # cut 0.5 s into the silence after its first token
    assert hung.ok and hung.attempts == 2  # no headers within connect + stall bounds
    assert sum(g.get("how") == "client_disconnected" for g in gens) == 1  # the wedged one's first attempt


def test_request_timeouts_from_config_and_environment(monkeypatch):
    from qumem_pipeline.llm.timeouts import DEFAULT_MIN_TOKENS_PER_S, DEFAULT_STALL_S, RequestTimeouts

    for var in ("TIMEOUT_S", "STALL_TIMEOUT_S", "MIN_TOKENS_PER_S"):
        monkeypatch.delenv(f"QUMEM_LLM_{var}", raising=False)
        monkeypatch.delenv(f"QUMEM_LLM_OPENAI_{var}", raising=False)
    t = RequestTimeouts.resolve("openai")
    assert t.overall_for(384) == DEFAULT_STALL_S + 384 / DEFAULT_MIN_TOKENS_PER_S  # grows with max_tokens
    assert t.overall_for(768) > t.overall_for(384) and t.stall_for(384) == DEFAULT_STALL_S
    monkeypatch.setenv("QUMEM_LLM_MIN_TOKENS_PER_S", "2")
    monkeypatch.setenv("QUMEM_LLM_STALL_TIMEOUT_S", "30")
    assert RequestTimeouts.resolve("openai").overall_for(100) == 30 + 50
    monkeypatch.setenv("QUMEM_LLM_TIMEOUT_S", "900")
    assert RequestTimeouts.resolve("openai").overall_for(100) == 900
    monkeypatch.setenv("QUMEM_LLM_OPENAI_TIMEOUT_S", "20")  # the backend's own variable wins
    t = RequestTimeouts.resolve("openai")
    assert t.overall_for(100) == 20 and t.stall_for(100) == 20  # a stall never outlasts the bound
    assert RequestTimeouts.resolve("vllm-managed").overall_for(100) == 900
    assert RequestTimeouts.resolve("openai", overall_s=5).overall_for(100) == 5  # explicit argument first
    be = make_backend("openai", base_url="http://127.0.0.1:1/v1", model="m")
    assert be.timeouts.overall_for(1) == 20
    monkeypatch.setenv("QUMEM_LLM_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="QUMEM_LLM_TIMEOUT_S"):
        RequestTimeouts.resolve("vllm-managed")


def test_endpoint_gone_raises_clear_error():
    port = free_port()
    be = make_backend("openai", base_url=f"http://127.0.0.1:{port}/v1", model="m", max_retries=2, backoff_base_s=0.01)
    with pytest.raises(LLMEndpointError) as ei:
        be.generate([req(0, "q")])
    assert f"127.0.0.1:{port}" in str(ei.value) and "3 attempt" in str(ei.value)


def test_persistent_5xx_raises_after_retries(tmp_path):
    script = {"default": [{"status": 500}]}
    with RunningFakeServer(script, tmp_path) as srv, backend(srv, model="m", max_retries=2) as be:
        with pytest.raises(LLMEndpointError) as ei:
            be.generate([req(0, "q")])
        assert len(srv.requests()) == 3
    assert "HTTP 500" in str(ei.value) and srv.base_url in str(ei.value)


def test_generate_inside_running_event_loop(tmp_path):
    import asyncio

    script = {"default": [{"json": {"answer": "z"}}]}
    with RunningFakeServer(script, tmp_path) as srv, backend(srv, model="m") as be:

        async def inner():
            return be.generate([req(0, "q")])

        (res,) = asyncio.run(inner())
    assert res.ok


def test_factory_rejects_unknown_kind():
    with pytest.raises(ValueError, match="unknown LLM backend"):
        make_backend("nope")


def test_jitter_is_seeded():
    a = make_backend("openai", base_url="http://127.0.0.1:1/v1", model="m", seed=3)
    b = make_backend("openai", base_url="http://127.0.0.1:1/v1", model="m", seed=3)
    assert [a._backoff(i, None) for i in range(5)] == [b._backoff(i, None) for i in range(5)]
    assert a._backoff(0, 2.5) == 2.5
    json.dumps(a.build_body(req(0, "x")))  # serialisable


def test_whitespace_runaway_length_cut_names_the_server_fix(tmp_path):
    # What vLLM + SmolLM2 did without the server's disable_any_whitespace: newlines until max_tokens.
    runaway = '{\n  "answer": ' + "\n" * 60
    script = {"rules": [{"match": "ws", "responses": [{"content": runaway, "finish_reason": "length"}]}]}
    with RunningFakeServer(script, tmp_path) as srv, backend(srv, model="m") as be:
        (res,) = be.generate([req(0, "ws")])
    assert res.error_kind == "length" and "disable_any_whitespace" in res.error


def test_vllm_managed_starts_server_with_compact_json(tmp_path):
    import sys

    from qumem_pipeline.llm.vllm_managed import VLLMStartError

    # this venv has no vllm, so the child exits at once; the error names the command it ran
    with pytest.raises(VLLMStartError) as err:
        make_backend("vllm-managed", model="m", python=sys.executable, log_path=tmp_path / "v.log", startup_timeout_s=30)
    msg = str(err.value)
    assert "--structured-outputs-config" in msg and '"disable_any_whitespace": true' in msg and '"backend": "xgrammar"' in msg
    with pytest.raises(VLLMStartError) as err:
        make_backend("vllm-managed", model="m", python=sys.executable, log_path=tmp_path / "w.log", startup_timeout_s=30,
                     extra_args=["--structured-outputs-config", '{"backend": "guidance"}'])
    assert str(err.value).count("--structured-outputs-config") == 1
