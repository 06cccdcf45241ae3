"""The `openai` backend against a real local HTTP server process serving scripted replies."""

import json
import time

import pytest

from fake_openai_server import RunningFakeServer
from qumem_pipeline.llm import ChatRequest, LLMEndpointError, make_backend
from qumem_pipeline.llm.vllm_managed import free_port

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
        {"garbage": "<html>proxy error</html>"},
    ],
    ids=["500", "503", "timeout", "dropped-connection", "non-json-body"],
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
        t0 = time.perf_counter()
        (res,) = be.generate([req(0, "q")])
        dt = time.perf_counter() - t0
        times = [r["t"] for r in srv.requests()]
    assert res.ok and res.attempts == 2
    assert dt >= 0.95 and times[1] - times[0] >= 0.9  # waited Retry-After, not the 0.05 s backoff


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


def test_many_requests_bounded_concurrency_keep_order(tmp_path):
    script = {"rules": [{"match": f"item-{i}:", "responses": [{"hang": 0.2, "json": {"answer": str(i)}}]} for i in range(20)]}
    with RunningFakeServer(script, tmp_path) as srv, backend(srv, model="m", max_concurrency=5) as be:
        t0 = time.perf_counter()
        results = be.generate([req(i, f"item-{i}:") for i in range(20)])
        dt = time.perf_counter() - t0
    assert [r.parsed["answer"] for r in results] == [str(i) for i in range(20)]
    assert [r.request_id for r in results] == [f"r{i}" for i in range(20)]
    assert 0.75 <= dt < 3.0  # 20 x 0.2 s at 5 in flight: ~0.8 s, far below 4 s serial


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
