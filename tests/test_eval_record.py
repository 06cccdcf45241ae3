"""The evaluation record (qumem_pipeline/eval/record.py): calls stored by content and replayed; a replay
with no model at all; the committed table replayed from eval_record/ and compared with its JSON."""

import gzip
import json
from pathlib import Path

import pytest

from qumem_pipeline.eval.record import (
    ERROR_RECORD_MISS, RECORD_ROOT, EvalRecord, RecordBackend, call_key, format_missing, model_identity,
)
from qumem_pipeline.llm.base import BackendBase, ChatRequest, ChatResult, LLMEndpointError
from qumem_pipeline.runtime.datasets import ENV_VAR, shared_datasets_dir

REPO = Path(__file__).resolve().parents[1]
DEV = shared_datasets_dir() / "locomo" / "locomo_dev5.json"
TABLE = "locomo_qa_smollm2_conv30_s1"
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


class CountingBackend(BackendBase):
    """An engine that answers every request with its prompt's length, counting what it was sent."""

    backend_name = "local"
    model_name = "tiny-model"

    def __init__(self, fail: bool = False, cut_once: set[str] = frozenset()) -> None:
        self.sent: list[str] = []
        self.fail = fail
        self.cut_once = set(cut_once)  # prompts whose first answer is cut at max_tokens (a bad output)

    def generate(self, requests):
        if self.fail:
            raise LLMEndpointError("http://nowhere", "refused", 1)
        self.sent += [r.request_id for r in requests]
        out = []
        for r in requests:
            text = r.messages[0]["content"]
            if text in self.cut_once:
                self.cut_once.discard(text)
                out.append(ChatResult(r.request_id, None, '{"answer": "', "length: output cut at max_tokens", 7, 16, 5, 0.1, 1,
                                      "length"))
                continue
            out.append(ChatResult(r.request_id, {"answer": str(len(text))}, json.dumps({"answer": str(len(text))}),
                                  None, 7, 3, 5, 0.1, 1, "stop"))
        return out


def req(text: str, rid: str = "conv-1#0/answer", max_tokens: int = 16) -> ChatRequest:
    return ChatRequest(rid, [{"role": "user", "content": text}], SCHEMA, max_tokens, "qa_answer",
                       metadata={"user_id": "u1"})


def test_calls_are_recorded_once_and_replayed_with_no_model(tmp_path):
    rec = EvalRecord(tmp_path / "rec")
    inner = CountingBackend()
    first = RecordBackend(inner, rec)
    out = first.generate([req("hello"), req("world!", "conv-1#1/answer")])
    assert [r.parsed for r in out] == [{"answer": "5"}, {"answer": "6"}]
    assert first.appended == 2 and len(inner.sent) == 2 and len(rec.keys()) == 2

    # a second run over the same record sends nothing
    again = CountingBackend()
    second = RecordBackend(again, EvalRecord(tmp_path / "rec"))
    assert [r.parsed for r in second.generate([req("world!", "conv-1#1/answer")])] == [{"answer": "6"}]
    assert again.sent == [] and second.hits == 1

    # replay-only: no backend at all; a call the record lacks is an error result, listed by stage/conversation
    ident = model_identity(inner)
    assert ident["model"] == "tiny-model@auto" and ident["decoding"]["engine"] == "transformers"
    only = RecordBackend(None, EvalRecord(tmp_path / "rec"), ident)
    got = only.generate([req("hello"), req("not asked before", "conv-2#4/answer")])
    assert got[0].parsed == {"answer": "5"} and got[0].cached_tokens is None
    assert got[1].error.startswith(ERROR_RECORD_MISS)
    assert only.missing_summary() == {"calls": 1, "by_stage": {"qa_answer": 1}, "by_conversation": {"conv-2": 1}}
    assert "conv-2#4/answer" in format_missing(only)


def test_entries_are_content_addressed_and_byte_stable(tmp_path):
    ident = {"model_name": "m", "model": "m@bfloat16", "decoding": {"engine": "openai-compatible", "temperature": 0.0}}
    k1, fields = call_key(ident, req("x"))
    assert fields["model"] == "m@bfloat16" and set(fields) == {"model", "decoding", "max_tokens", "schema_digest",
                                                                "prompt_digest"}
    assert call_key(ident, req("x", rid="another/id"))[0] == k1  # the request id is not content
    assert call_key(ident, req("x", max_tokens=32))[0] != k1
    assert call_key({**ident, "model": "m@float32"}, req("x"))[0] != k1
    assert call_key(ident, req("x"), occurrence=1)[0] != k1  # a retry of the same request is its own call

    # two machines recording the same call write the same bytes (gzip without mtime, sorted keys)
    a, b = EvalRecord(tmp_path / "a"), EvalRecord(tmp_path / "b")
    RecordBackend(CountingBackend(), a).generate([req("same")])
    RecordBackend(CountingBackend(), b).generate([req("same")])
    (ka,) = a.keys()
    assert a.path_of(ka).read_bytes() == b.path_of(ka).read_bytes()
    entry = json.loads(gzip.decompress(a.path_of(ka).read_bytes()))
    assert {"output", "prompt_tokens", "completion_tokens", "finish_reason", "prompt_digest"} <= set(entry)
    assert "cached_tokens" not in entry and "created_at" not in entry


def test_retry_of_a_request_is_its_own_entry_and_failures_are_not_recorded(tmp_path):
    rec = EvalRecord(tmp_path / "rec")
    inner = CountingBackend(cut_once={"same"})
    b = RecordBackend(inner, rec)
    assert b.generate([req("same")])[0].error  # a bad output (cut at max_tokens): recorded as what came back
    assert b.generate([req("same")])[0].parsed == {"answer": "4"}  # its retry: the 2nd occurrence, sent
    assert len(rec.keys()) == 2 and len(inner.sent) == 2
    # a third identical request (another strategy asking the very same thing) is answered by the good
    # entry: not sent, nothing added; a replay of the run finds every call in the record
    assert b.generate([req("same")])[0].parsed == {"answer": "4"}
    assert len(inner.sent) == 2 and len(rec.keys()) == 2
    replay = RecordBackend(None, rec, identity=b.identity)
    assert [replay.generate([req("same")])[0].parsed for _ in range(3)] == [None, {"answer": "4"}, {"answer": "4"}]
    assert not replay.missing
    dead = RecordBackend(CountingBackend(fail=True), rec)
    with pytest.raises(LLMEndpointError):
        dead.generate([req("never answered")])
    assert len(rec.keys()) == 2
    rec.remove(rec.keys()[0])
    assert len(rec.keys()) == 1


def test_generate_each_records_and_replays(tmp_path):
    rec = EvalRecord(tmp_path / "rec")
    got = []
    RecordBackend(CountingBackend(), rec).generate_each([req("a"), req("bb")], lambda q, r: got.append(r.parsed))
    assert len(got) == 2 and len(rec.keys()) == 2
    again = []
    only = RecordBackend(None, rec, model_identity(CountingBackend()))
    only.generate_each([req("a"), req("bb")], lambda q, r: again.append(r.parsed))
    assert again == got and only.hits == 2 and not only.missing


class StoppedPartWay(CountingBackend):
    """An engine that finishes the first ``finish`` requests of a batch, then is stopped (SIGTERM or Ctrl-C
    reaching the run as KeyboardInterrupt) with the rest in flight."""

    def __init__(self, finish: int) -> None:
        super().__init__()
        self.finish = finish

    def generate_each(self, requests, on_result):
        for r in requests[: self.finish]:
            on_result(r, self.generate([r])[0])
        raise KeyboardInterrupt


def test_a_batch_stopped_part_way_keeps_its_finished_calls(tmp_path):
    """A QA batch goes through `generate`; the calls that finished before a stop are in the record and the
    run's ledger, so the rerun sends only the calls that had not finished."""
    from qumem_pipeline.eval.locomo.qa_ledger import LedgerBackend

    rec, ledger = EvalRecord(tmp_path / "rec"), tmp_path / "run.ledger.jsonl"
    batch = [req("one"), req("two", "conv-1#1/answer"), req("three", "conv-1#2/answer")]
    stopped = StoppedPartWay(finish=2)
    with pytest.raises(KeyboardInterrupt):
        RecordBackend(LedgerBackend(stopped, ledger), rec).generate(batch)
    assert stopped.sent == ["conv-1#0/answer", "conv-1#1/answer"]
    assert len(rec.keys()) == 2 and len(ledger.read_text().splitlines()) == 2

    rerun = CountingBackend()
    out = RecordBackend(LedgerBackend(rerun, ledger), EvalRecord(tmp_path / "rec")).generate(batch)
    assert rerun.sent == ["conv-1#2/answer"]
    assert [r.parsed for r in out] == [{"answer": "3"}, {"answer": "3"}, {"answer": "5"}]
    assert len(rec.keys()) == 3


def test_record_status_json_is_one_compact_last_line(capsys):
    from qumem_pipeline.eval.record_cli import main

    assert main(["--record", str(RECORD_ROOT), "status", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    got = json.loads(lines[-1])
    assert {"root", "runs", "models", "tables"} <= got.keys() and TABLE in got["tables"]
    assert main(["--record", str(RECORD_ROOT), "status"]) == 0  # without --json: indented, as before
    assert json.loads(capsys.readouterr().out) == got and len(lines) == 1


def test_record_check_and_table_json_when_nothing_replays(tmp_path, capsys):
    """`check --json` on a record with no tables, `table NAME --json -- ...` whose replay fails: the last
    stdout line says so, with the exit code; nothing is written."""
    from qumem_pipeline.eval.record_cli import main

    root = tmp_path / "rec"
    assert main(["--record", str(root), "check", "--json"]) == 1
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"tables": {}, "rc": 1}
    for argv in (["table", "t1", "--json", "--", "segmentation"], ["table", "--json", "t1", "--", "segmentation"]):
        assert main(["--record", str(root), *argv]) == 1
        got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert got["table"] == "t1" and got["written"] is False and got["rc"] == 1
    assert not (root / "tables" / "t1.json").exists()


needs_data = pytest.mark.skipif(not DEV.exists(), reason=f"LoCoMo dev file not at {DEV} (set {ENV_VAR})")


@needs_data
def test_committed_table_replays_from_the_record_with_no_model(monkeypatch, capsys):
    """The published table (docs/evaluation.md) regenerated from eval_record/ alone equals its JSON."""
    from qumem_pipeline.eval.record_cli import check

    monkeypatch.setenv("QUMEM_LLM_KIND", "no-such-backend")  # any model start would fail loudly
    assert (RECORD_ROOT / "tables" / f"{TABLE}.json").is_file()
    rc = check(EvalRecord(RECORD_ROOT), [TABLE], as_json=True)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"{TABLE}: same" in out
    assert json.loads(out.strip().splitlines()[-1]) == {"tables": {TABLE: "same"}, "rc": 0}  # --json: the last line
    body = json.loads((RECORD_ROOT / "tables" / f"{TABLE}.json").read_text())
    fig = body["figures"]
    assert set(fig["qa"]) == {"none", "topk_turns", "topk_memories", "qumem", "adamem"}
    assert fig["replayed"]["missing_calls"] == 0 and fig["replayed"]["memories_match_record"] == {"conv-30": True}
    for s, v in fig["f1_vs_topk_turns"].items():  # every comparison carries its n and interval
        assert v["n"] == fig["n_scored"] and len(v["ci95"]) == 2


@needs_data
def test_the_evaluation_models_table_replays_from_the_record_with_no_model(monkeypatch, capsys):
    """The 1.5B evaluation model's conv-30 table (docs/evaluation.md: 921 calls, decomposition included)
    regenerated from eval_record/ alone equals its JSON, every comparison with its n and interval."""
    from qumem_pipeline.eval.record_cli import check

    table = "locomo_qa_qwen15b_conv30"
    monkeypatch.setenv("QUMEM_LLM_KIND", "no-such-backend")  # any model start would fail loudly
    rc = check(EvalRecord(RECORD_ROOT), [table])
    out = capsys.readouterr().out
    assert rc == 0 and f"{table}: same" in out, out
    fig = json.loads((RECORD_ROOT / "tables" / f"{table}.json").read_text())["figures"]
    assert fig["model"] == "Qwen2.5-Coder-1.5B-Instruct@bfloat16" and fig["n_scored"] == 81
    assert set(fig["qa"]) == {"none", "topk_turns", "topk_memories", "qumem", "adamem", "qumem_hybrid"}
    assert fig["replayed"]["missing_calls"] == 0
    for v in [*fig["f1_vs_topk_turns"].values(), *fig["f1_vs_qumem"].values()]:
        assert v["n"] == 81 and v["ci95"][0] <= v["delta"] <= v["ci95"][1]


@needs_data
def test_replay_only_fails_listing_the_calls_the_record_lacks(monkeypatch, capsys):
    """Another word budget changes every top-k prompt: none of them is in the record."""
    from qumem_pipeline.cli import main as cli_main

    monkeypatch.setenv("QUMEM_EVAL_RECORD", str(RECORD_ROOT))
    monkeypatch.chdir(REPO)
    rc = cli_main(["eval", "locomo", str(DEV), "--qa", "--replay-only", "--strategies", "topk_turns", "--conversations",
                   "conv-30", "--max-sessions", "1", "--sample-per-category", "1", "--words", "64",
                   "--replay-model", "SmolLM2-135M-Instruct-Q4_1@float32"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "not in the record" in err and '"qa_answer"' in err and "topk_turns/conv-30#" in err
    assert not any(p.name.startswith(".tmp-") for p in RECORD_ROOT.rglob("*"))



def test_recall_harness_records_then_replays_with_no_model(monkeypatch, tmp_path):
    """The retrieval harness's A1/A2 calls go to the record; --replay-only gives the same recall with no
    model, and a record without them fails listing the calls."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    import test_qumem_harness as tq
    from fake_openai_server import RunningFakeServer
    from qumem_pipeline.eval.locomo.harness import main

    path = tmp_path / "toy_locomo.json"
    path.write_text(json.dumps(tq._toy_locomo()))
    mem_dir = tmp_path / "memories"
    for uid, g in tq._memories().group_by("user_id"):
        (mem_dir / f"user_id={uid[0]}").mkdir(parents=True)
        g.write_parquet(mem_dir / f"user_id={uid[0]}" / "part-0.parquet")
    script = {"model": "fake-planner", "rules": [
        *({"match": f"Current query: {q}\n\nInformation needs", "responses": [{"json": {"queries": plan}}]}
          for q, plan in tq.PLANS.items()),
        {"match": "information-need agent", "responses": [{"json": {"needs": [{"need": "the fact", "why": "to answer"}]}}]},
    ]}
    rec = tmp_path / "rec"
    args = [str(path), "--json", "--units", "turns", "--memories", str(mem_dir), "--strategies", "qumem"]

    def run(extra):
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            rc = main(args + extra)
        return rc, json.loads(out.getvalue().strip().splitlines()[-1]), err.getvalue()

    with RunningFakeServer(script, tmp_path / "srv") as srv:
        monkeypatch.setenv("QUMEM_LLM_BASE_URL", srv.base_url)
        rc, first, _ = run(["--llm-kind", "openai", "--record", str(rec)])
    assert rc == 0 and first["record"]["appended"] == 6  # 3 questions x (A1, A2)
    monkeypatch.delenv("QUMEM_LLM_BASE_URL")
    rc, again, _ = run(["--replay-only", "--record", str(rec)])
    assert rc == 0 and again["replay"]["calls_replayed"] == 6 and again["replay"]["missing"]["calls"] == 0
    assert again["retrieval"]["strategies"]["qumem"] == first["retrieval"]["strategies"]["qumem"]
    for f in (rec / "calls").rglob("*.json.gz"):
        f.unlink()
    rc, _, err = run(["--replay-only", "--record", str(rec)])
    assert rc == 1 and "model call(s) are not in the record" in err and "information_needs" in err


@needs_data
def test_recorded_episodes_replay_without_the_classifier(monkeypatch, capsys, tmp_path):
    """A decomposition recorded over one classifier's episodes replays from the episodes the record keeps,
    whatever classifier ships now: here none can even load (the artifact path does not exist)."""
    from qumem_pipeline.cli import main as cli_main
    from qumem_pipeline.eval.record import episodes_path, read_episodes, write_episodes

    table = json.loads((RECORD_ROOT / "tables" / f"{TABLE}.json").read_text())["command"]
    version = table[table.index("--episodes-version") + 1]
    stored = episodes_path(EvalRecord(RECORD_ROOT), DEV.name, version, "conv-30", 1)
    eps = read_episodes(stored)
    assert len(eps) == 2 and all(e.height and e["classifier_version"].unique().to_list() == [version] for e in eps.values())
    again = tmp_path / "again.jsonl.gz"
    assert write_episodes(again, eps) and again.read_bytes() == stored.read_bytes()  # byte-stable round trip
    monkeypatch.setenv("QUMEM_LLM_KIND", "no-such-backend")
    monkeypatch.setenv("QUMEM_EVAL_RECORD", str(RECORD_ROOT))
    monkeypatch.chdir(REPO)
    rc = cli_main(["eval", "locomo", str(DEV), "--qa", "--replay-only", "--decompose", "--episodes-version", version,
                   "--continuity-artifact", str(tmp_path / "no-classifier-here"), "--conversations", "conv-30",
                   "--max-sessions", "1", "--strategies", "topk_memories", "--questions", "conv-30#0",
                   "--replay-model", "SmolLM2-135M-Instruct-Q4_1@float32", "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0
    assert report["replay"]["missing"]["calls"] == 0 and report["replay"]["memories_match_record"] == {"conv-30": True}
