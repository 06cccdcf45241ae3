"""Outputs cut at their budget in a whitespace run: what is read from them, and what is sent again."""

import json

from fake_openai_server import RunningFakeServer
from qumem_pipeline.llm import ChatRequest, make_backend
from qumem_pipeline.llm.base import ChatResult, read_output
from qumem_pipeline.llm.retry import generate_with_retry, retry_request
from qumem_pipeline.llm.salvage import salvage_whitespace_cut

# The shape of the A1 output that Qwen2.5-Coder-1.5B cut (issue 18): "why" closed by its maxLength
# mid-sentence, then whitespace to the token limit.
NEEDS = {
    "type": "object",
    "properties": {"needs": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"need": {"type": "string", "maxLength": 20}, "why": {"type": "string", "maxLength": 20}},
        "required": ["need", "why"], "additionalProperties": False}}},
    "required": ["needs"], "additionalProperties": False,
}
RUN = "  \n" * 40


def test_closes_the_prefix_after_its_last_finished_value():
    cut = '{"needs": [{"need": "speech date", "why": "asks for a date o"' + RUN
    assert salvage_whitespace_cut(cut, NEEDS) == {"needs": [{"need": "speech date", "why": "asks for a date o"}]}
    two = '{"needs": [{"need": "a", "why": "b"}, {"need": "c", "why": "d, [x] {y}"},' + RUN
    assert salvage_whitespace_cut(two, NEEDS) == {"needs": [{"need": "a", "why": "b"}, {"need": "c", "why": "d, [x] {y}"}]}
    escaped = '{"needs": [{"need": "say \\"hi\\"", "why": "q"}' + RUN
    assert salvage_whitespace_cut(escaped, NEEDS)["needs"][0]["need"] == 'say "hi"'


def test_keeps_nothing_it_would_have_to_invent():
    after_key = '{"needs": [{"need": "a", "why"' + RUN
    inside_string = '{"needs": [{"need": "a", "why": "still writing' + RUN
    missing_required = '{"needs": [{"need": "a"' + RUN
    short_run = '{"needs": [{"need": "a", "why": "b"}' + "  "
    for text in (after_key, inside_string, missing_required, short_run):
        assert salvage_whitespace_cut(text, NEEDS) is None, text
    assert salvage_whitespace_cut('["a"' + RUN, None) is None  # not an object


def test_read_output_salvages_only_length_cuts():
    cut = '{"needs": [{"need": "a", "why": "b"}' + RUN
    assert read_output(cut, NEEDS, "length", 64) == ({"needs": [{"need": "a", "why": "b"}]}, None, True)
    parsed, error, salvaged = read_output(cut, NEEDS, "stop", 64)  # a stop here is the server's bug, not a cut
    assert parsed is None and error.startswith("invalid_json") and not salvaged
    parsed, error, salvaged = read_output('{"needs": [{"need": "a", "why"' + RUN, NEEDS, "length", 64)
    assert parsed is None and error.startswith("length: output cut at max_tokens=64") and "whitespace run" in error


def test_retry_policy_for_cuts():
    req = ChatRequest("r", [{"role": "user", "content": "x"}], NEEDS, 100)
    bad_json = ChatResult("r", None, "{", error="invalid_json: x", finish_reason="stop")
    cut_in_words = ChatResult("r", None, '{"needs": [{"need": "a long', error="length: cut", finish_reason="length")
    cut_in_run = ChatResult("r", None, '{"needs": [{"need": "a", "why"' + RUN, error="length: cut", finish_reason="length")
    assert retry_request(req, bad_json) is req
    assert retry_request(req, cut_in_words).max_tokens == 200
    assert retry_request(req, cut_in_run) is None


def test_backend_salvages_and_sends_no_retry(tmp_path):
    """Through a real HTTP exchange: a whitespace-run cut is read up to the run and not sent again; a
    cut in the middle of words is sent once more at twice the budget."""
    script = {"model": "m1", "rules": [
        {"match": "ws", "responses": [{"content": '{"needs": [{"need": "a", "why": "b"}' + RUN, "finish_reason": "length"}]},
        {"match": "words", "responses": [{"content": '{"needs": [{"need": "a lo', "finish_reason": "length"},
                                          {"json": {"needs": [{"need": "a long one", "why": "b"}]}}]}]}
    with RunningFakeServer(script, tmp_path) as srv:
        be = make_backend("openai", base_url=srv.base_url, max_retries=0, timeout_s=5.0)
        reqs = [ChatRequest(f"r{i}", [{"role": "user", "content": t}], NEEDS, 64, "needs") for i, t in enumerate(["ws", "words"])]
        ws, words = generate_with_retry(be, reqs)
        be.close()
        sent = [json.loads(r["body"]) if isinstance(r["body"], str) else r["body"] for r in srv.requests()]
    assert ws.ok and ws.salvaged and ws.finish_reason == "length" and ws.parsed == {"needs": [{"need": "a", "why": "b"}]}
    assert words.ok and not words.salvaged and words.parsed["needs"][0]["need"] == "a long one"
    assert sorted(b["max_tokens"] for b in sent) == [64, 64, 128]  # ws once; words at 64, then at 128


def test_ledger_replay_reads_an_old_cut_as_this_code_reads_it(tmp_path):
    """A row an older run logged as a length error is replayed, not sent again, and read as salvaged."""
    from qumem_pipeline.eval.locomo.qa_ledger import LedgerBackend, request_fingerprint

    class Unreachable:
        model_name, backend_name = "m1", "openai"

        def generate(self, reqs):
            raise AssertionError(f"sent {len(reqs)} request(s); the ledger had the answer")

        def close(self):
            pass

    req = ChatRequest("q1/a1", [{"role": "user", "content": "x"}], NEEDS, 64, "needs")
    text = '{"needs": [{"need": "a", "why": "b"}' + RUN
    row = {"request_id": req.request_id, "status": "error", "prompt_tokens": 9, "completion_tokens": 64,
           "cached_tokens": None, "model": "m1", "fingerprint": request_fingerprint("m1", req), "max_tokens": 64,
           "finish_reason": "length", "error": "length: output cut at max_tokens=64 (invalid_json: x)",
           "raw_text": text, "parsed": None}
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text(json.dumps(row) + "\n")
    lb = LedgerBackend(Unreachable(), ledger)
    (res,) = generate_with_retry(lb, [req])
    assert res.ok and res.salvaged and res.parsed == {"needs": [{"need": "a", "why": "b"}]}
    assert lb.replayed == 1 and lb.sent == 0
    assert lb.used["?"] == {"calls": 1, "errors": 0, "salvaged": 1, "prompt_tokens": 9, "completion_tokens": 64}
