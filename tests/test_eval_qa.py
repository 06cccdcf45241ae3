"""`qumem eval locomo --qa`: every strategy answers a tiny LoCoMo-format slice through a real (scripted)
OpenAI-shaped HTTP server; scores, checkpoint, ledger, HTML; an interrupted run resumes and asks the
server only for what is left (counted at the server)."""

import io
import json
import math
import os
from contextlib import redirect_stdout

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import polars as pl
import pytest

from fake_openai_server import RunningFakeServer
from qumem_pipeline.eval.locomo.qa import QA_STRATEGIES, run_qa
from qumem_pipeline.llm.base import LLMError
from qumem_pipeline.llm.openai_backend import OpenAIBackend

ANN, BO = "toy-1-ann", "toy-1-bo"
Q_DOG = "What is the name of Ann's dog?"
Q_DRINKS = "What drinks has Ann had?"
Q_WHEN = "When did Bo run his first marathon?"
Q_TASTING = "Would Ann enjoy a coffee tasting?"
Q_ADV = "What is Bo's dog called?"
# scripted answers (the same for every strategy that has a context; 'none' gets "I do not know")
ANSWERS = {Q_DOG: "Rex", Q_DRINKS: "coffee, green tea", Q_WHEN: "May 2023", Q_TASTING: "no"}
# hand-computed: cat 4 Rex 1/1; cat 1 parts 1,1 -> 1/1; cat 2 [may 2023] vs [8 may 2023] F1 0.8, BLEU-1
# exp(-1/2); cat 3 gold "Likely no" -> [like no] vs [no] F1 2/3, BLEU-1 exp(-1)
F1 = (1 + 1 + 0.8 + 2 / 3) / 4
BLEU1 = (1 + 1 + math.exp(-0.5) + math.exp(-1)) / 4
STATE = {"facts": [{"statement": "Ann's dog is named Rex.", "memory_ids": ["M1"]}],
         "preference_trajectory": [], "insights": []}
RESEARCH = {"facts": [{"statement": "The research notes say the dog is Rex.", "memory_ids": ["M1"]}],
            "preference_trajectory": [], "insights": []}
MEMORIES = {
    "m-dog": (ANN, "fact", "Ann adopted a golden retriever puppy named Rex.", [0]),
    "m-paint": (BO, "fact", "Bo is learning watercolor painting.", [3]),
    "m-switch": (ANN, "fact", "Ann switched from coffee to green tea.", [4]),
    "m-marathon": (BO, "fact", "Bo ran his first marathon in Berlin.", [7]),
    "m-tea": (ANN, "preference", "Ann prefers green tea over coffee.", [4, 6]),
}


def _toy_locomo() -> list[dict]:
    s1 = [("Ann", "I adopted a golden retriever puppy named Rex last week."), ("Bo", "How is he settling in?"),
          ("Ann", "He chews my shoes, but I love him."), ("Bo", "I started learning to paint with watercolors.")]
    s2 = [("Ann", "I switched from coffee to green tea this month."), ("Bo", "Why the change?"),
          ("Ann", "Coffee kept me awake at night."), ("Bo", "I ran my first marathon in Berlin yesterday.")]
    conv = {"speaker_a": "Ann", "speaker_b": "Bo",
            "session_1_date_time": "1:00 pm on 1 May, 2023", "session_2_date_time": "1:00 pm on 9 May, 2023"}
    for n, sess in ((1, s1), (2, s2)):
        conv[f"session_{n}"] = [{"speaker": sp, "dia_id": f"D{n}:{i + 1}", "text": t} for i, (sp, t) in enumerate(sess)]
    qa = [{"question": Q_DOG, "answer": "Rex", "evidence": ["D1:1"], "category": 4},
          {"question": Q_DRINKS, "answer": "coffee, green tea", "evidence": ["D2:1"], "category": 1},
          {"question": Q_WHEN, "answer": "8 May 2023", "evidence": ["D2:4"], "category": 2},
          {"question": Q_TASTING, "answer": "Likely no; she switched to tea", "evidence": ["D2:1"], "category": 3},
          {"question": Q_ADV, "adversarial_answer": "Rex", "evidence": ["D1:1"], "category": 5}]
    return [{"sample_id": "toy-1", "conversation": conv, "qa": qa}]


def _script(crash_on_a3: bool = False) -> dict:
    a3 = [{"exit": True}] if crash_on_a3 else [{"json": STATE}]
    return {"model": "fake-qa", "rules": [
        {"match": "information-need agent", "responses": [{"json": {"needs": [{"need": "the fact asked", "why": "to answer"}]}}]},
        {"match": "retrieval-planning agent", "responses": [{"json": {"queries": [{"query": "Ann dog", "stores": ["fact"]}]}}]},
        {"match": "user-state inference agent", "responses": a3},
        {"match": "research agent", "responses": [{"json": {**RESEARCH, "sufficient": True, "follow_up": ""}}]},
        {"match": "working agent", "responses": [{"json": {"answer": "AdaMem's own answer"}}]},
        {"match": "Context: (none)", "responses": [{"json": {"answer": "I do not know"}}]},
        *({"match": f"Question: {q}\n", "responses": [{"json": {"answer": a}}]} for q, a in ANSWERS.items()),
    ], "default": [{"json": {"answer": "Not mentioned in the conversation"}}]}


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    d = tmp_path_factory.mktemp("qa")
    path = d / "toy_locomo.json"
    path.write_text(json.dumps(_toy_locomo()))
    mem_dir = d / "memories"
    rows = [{"memory_id": m, "user_id": u, "type": t, "content": c, "evidence_turn_ids": ev, "position": ev[-1]}
            for m, (u, t, c, ev) in MEMORIES.items()]
    for uid, g in pl.DataFrame(rows, schema_overrides={"evidence_turn_ids": pl.List(pl.Int64)}).group_by("user_id"):
        (mem_dir / f"user_id={uid[0]}").mkdir(parents=True)
        g.write_parquet(mem_dir / f"user_id={uid[0]}" / "part-0.parquet")
    return d, path, mem_dir


@pytest.fixture(scope="module")
def embedder():
    from qumem_pipeline.index.embeddings import Embedder

    return Embedder.load(device="cpu")


def _answer_requests(requests: list[dict]) -> list[dict]:
    return [r for r in requests if "Based on the above context" in r["body"]["messages"][-1]["content"]]


def test_every_strategy_answers_and_is_scored(toy, embedder, tmp_path):
    d, path, mem_dir = toy
    with RunningFakeServer(_script(), tmp_path / "srv") as srv:
        backend = OpenAIBackend(base_url=srv.base_url, max_retries=0, timeout_s=30)
        report = run_qa(str(path), out=tmp_path / "out" / "qa.json", memories=mem_dir, llm_backend=backend,
                        embedder=embedder, log=lambda m: None)
        requests = srv.requests()
    assert report["strategies"] == list(QA_STRATEGIES)
    assert report["n_questions"] == 4 and report["n_questions_adversarial"] == 1
    none = report["qa"]["none"]
    assert none["f1"] == 0.0 and none["bleu1"] == 0.0 and none["adversarial"]["abstain"] == 0.0
    for s in QA_STRATEGIES[1:]:
        v = report["qa"][s]
        assert v["f1"] == pytest.approx(F1, abs=1e-4), s
        assert v["bleu1"] == pytest.approx(BLEU1, abs=1e-4), s
        assert v["per_category"]["2"]["f1"] == pytest.approx(0.8)
        assert v["per_category"]["3"]["bleu1"] == pytest.approx(math.exp(-1), abs=1e-4)
        assert v["adversarial"] == {"n": 1, "abstain": 1.0}
        assert v["not_answered"] == 0 and v["no_answer"] == 0
    # the same answer prompt for every strategy; only the context differs
    answers = _answer_requests(requests)
    assert len(answers) == 5 * len(QA_STRATEGIES)
    assert {r["body"]["messages"][0]["content"] for r in answers} == {answers[0]["body"]["messages"][0]["content"]}
    ctx = {s: [] for s in QA_STRATEGIES}
    for r in answers:
        text = r["body"]["messages"][-1]["content"]
        if "Evidence: the conversation turns the retrieved memories rest on" in text:
            ctx["qumem_evidence"].append(text)
            continue
        if text.startswith("Inferred state") and "Relevant parts of the conversation" in text:
            ctx["adamem_turns"].append(text)
            continue
        for s, marker in [("none", "Context: (none)"), ("full_history", "Session 2 (9 May 2023):"),
                          ("topk_turns", "Relevant parts of the conversation"), ("topk_memories", "Memories about"),
                          ("qumem", "Inferred state")]:
            if text.startswith(marker) or (s == "full_history" and marker in text):
                ctx[s].append(text)
    assert len(ctx["none"]) == 5 and len(ctx["full_history"]) == 5 and len(ctx["topk_turns"]) == 5
    assert len(ctx["topk_memories"]) == 5
    assert "(Ann) Ann adopted a golden retriever" in ctx["topk_memories"][0]  # owner named, dated
    assert "[1 May 2023]" in ctx["topk_memories"][0]
    assert len(ctx["qumem"]) == 15  # qumem's and qumem_hybrid's Z_q and adamem's research notes all render as a state
    # both states cite M1 (the dog memory): their facts are shown as that memory, verbatim and dated, not
    # as the state's restatement
    # (qumem's M1 is the dog memory, adamem's M1 the turn it came from: each shown as that unit)
    head = "Relevant facts (the memories the state selected, with dates):\n- [1 May 2023] "
    bad = [t for t in ctx["qumem"] if not any(head + u in t for u in (
        "(Ann) Ann adopted a golden retriever puppy named Rex.", "Ann: I adopted a golden retriever puppy named Rex"))]
    assert not bad, bad[0]
    assert not [t for t in ctx["qumem"] if "Ann's dog is named Rex." in t or "research notes say" in t]
    # qumem_evidence: the same state (its A1-A3 are qumem's calls, not paid again), shown with the turns its
    # memories rest on, verbatim and dated, instead of the memories
    assert len(ctx["qumem_evidence"]) == 5
    assert all("[1 May 2023] Ann: I adopted a golden retriever puppy named Rex" in t for t in ctx["qumem_evidence"])
    assert not [t for t in ctx["qumem_evidence"] if "Relevant facts (the memories" in t]
    # adamem_turns: AdaMem's research notes (replayed, not paid again) in front of the question's top-k turns
    assert len(ctx["adamem_turns"]) == 5
    assert all("[1 May 2023] Ann: I adopted a golden retriever puppy named Rex" in t for t in ctx["adamem_turns"])
    assert not [t for t in ctx["adamem_turns"] if "Relevant facts (the memories" in t]
    # qumem ran A1 -> A2 -> A3 and adamem its research loop, one batch per stage; AdaMem's working answer too
    kinds = [r["body"]["messages"][0]["content"].split(".")[0] for r in requests]
    # qumem_hybrid plans with qumem's very calls: answered from the ledger, not sent again; its A3 sees other candidates
    assert sum("information-need agent" in k for k in kinds) == 5
    assert sum("user-state inference agent" in k for k in kinds) == 10
    assert sum("research agent" in k for k in kinds) == 5
    # every LLM call is a ledger row, with the pipeline ledger's columns
    ledger = [json.loads(x) for x in (tmp_path / "out" / "qa.ledger.jsonl").read_text().splitlines()]
    assert len(ledger) == len(requests)
    assert {"request_id", "type", "status", "prompt_tokens", "completion_tokens", "latency_s", "model",
            "strategy", "fingerprint"} <= set(ledger[0])
    assert {r["strategy"] for r in ledger} == set(QA_STRATEGIES)
    assert report["llm_calls"]["ledger_rows"] == len(requests)
    used = report["llm_calls"]["by_strategy_this_run"]  # the calls behind this run's answers, per strategy
    # qumem_hybrid's A1 and A2, and qumem_evidence's A1, A2 and A3: qumem's calls, not sent again; adamem_turns'
    # research and working answer: adamem's
    assert report["llm_calls"]["replayed_this_run"] == 5 * 2 + 5 * 3 + 5 * 2
    assert set(used) == set(QA_STRATEGIES)
    assert sum(v["calls"] for v in used.values()) == len(requests) + report["llm_calls"]["replayed_this_run"]
    assert used["none"]["calls"] == 5 and used["qumem"]["calls"] == 5 * 4  # A1, A2, A3, answer
    assert all(v["errors"] == 0 and v["salvaged"] == 0 for v in used.values())
    # checkpoint: one row per strategy and question
    ck = [json.loads(x) for x in (tmp_path / "out" / "qa.checkpoint.jsonl").read_text().splitlines()]
    assert len(ck) == 5 * len(QA_STRATEGIES) and len({(r["strategy"], r["key"]) for r in ck}) == len(ck)
    # the HTML report is one self-contained file with inline SVG plots
    html = (tmp_path / "out" / "qa.html").read_text()
    assert html.count("<svg") >= 3 and "<script" not in html and "src=" not in html and "href=" not in html
    assert json.loads((tmp_path / "out" / "qa.json").read_text())["qa"]["qumem"]["f1"] == report["qa"]["qumem"]["f1"]


def test_full_history_skipped_when_over_the_context_window(toy, embedder, tmp_path):
    d, path, _ = toy
    with RunningFakeServer(_script(), tmp_path / "srv") as srv:
        report = run_qa(str(path), out=tmp_path / "qa.json", strategies=["full_history", "none"], context_tokens=60,
                        llm_backend=OpenAIBackend(base_url=srv.base_url, max_retries=0), embedder=embedder,
                        log=lambda m: None)
        assert len(_answer_requests(srv.requests())) == 5  # only 'none' was sent
    assert report["skipped"]["full_history_over_context_window"]["questions"] == 5
    assert report["qa"]["full_history"]["not_answered"] == 5 and report["qa"]["full_history"]["f1"] is None
    # n_scored: the category 1-4 questions every strategy scored (full_history scored none), not n_questions
    assert report["n_scored"] == report["qa"]["full_history"]["n"] == 0 and report["qa"]["none"]["n"] > 0
    # without memories the memory strategies are skipped with the reason, never silently empty
    assert "strategy_qumem" not in report["skipped"]


def test_memory_strategies_skipped_without_memories(toy, embedder, tmp_path):
    _, path, _ = toy
    with RunningFakeServer(_script(), tmp_path / "srv") as srv:
        report = run_qa(str(path), out=tmp_path / "qa.json", strategies=["topk_memories", "qumem", "topk_turns"],
                        llm_backend=OpenAIBackend(base_url=srv.base_url, max_retries=0), embedder=embedder,
                        log=lambda m: None)
    assert "--memories" in report["skipped"]["strategy_qumem"]
    assert report["strategies"] == ["topk_turns"]


def test_sample_per_category_is_seeded_and_bounded(toy, embedder, tmp_path):
    from qumem_pipeline.eval.locomo.qa import load_questions, sample_questions

    _, path, _ = toy
    _, qs, _ = load_questions(str(path))
    assert len(qs) == 5 and [q.key for q in qs] == [f"toy-1#{i}" for i in range(5)]
    a = sample_questions(qs, 1, seed=3)
    assert sorted(q.category for q in a) == [1, 2, 3, 4, 5]
    # more questions than asked for: N per category, the same N for the same seed, in file order
    from dataclasses import replace

    many = [replace(q, key=f"{q.key}/{j}") for j in range(4) for q in qs]
    b, c = sample_questions(many, 2, seed=7), sample_questions(many, 2, seed=7)
    assert [q.key for q in b] == [q.key for q in c] and len(b) == 10
    assert all(sum(1 for q in b if q.category == cat) == 2 for cat in range(1, 6))
    assert [q.key for q in b] == [q.key for q in many if q.key in {x.key for x in b}]
    assert [q.key for q in sample_questions(many, 2, seed=8)] != [q.key for q in b]
    assert sample_questions(many, None) == many


def test_interrupted_run_resumes_and_asks_only_for_the_rest(toy, embedder, tmp_path):
    d, path, mem_dir = toy
    out = tmp_path / "run" / "qa.json"
    # first run: the server dies at qumem's first A3 call (after none/full_history/topk_* and qumem's A1, A2)
    with RunningFakeServer(_script(crash_on_a3=True), tmp_path / "srv1") as srv1:
        with pytest.raises(LLMError):
            run_qa(str(path), out=out, memories=mem_dir, chunk=2, embedder=embedder, log=lambda m: None,
                   llm_backend=OpenAIBackend(base_url=srv1.base_url, max_retries=0, timeout_s=10))
        first = srv1.requests()
    ck1 = [json.loads(x) for x in out.with_name("qa.checkpoint.jsonl").read_text().splitlines()]
    assert {r["strategy"] for r in ck1} == {"none", "full_history", "topk_turns", "topk_memories"}
    assert len(ck1) == 20
    ledger1 = [json.loads(x) for x in out.with_name("qa.ledger.jsonl").read_text().splitlines()]
    assert any(r["type"] == "information_needs" for r in ledger1 if r["status"] == "ok")

    with RunningFakeServer(_script(), tmp_path / "srv2") as srv2:
        report = run_qa(str(path), out=out, memories=mem_dir, chunk=2, embedder=embedder, log=lambda m: None,
                        llm_backend=OpenAIBackend(base_url=srv2.base_url, max_retries=0, timeout_s=10))
        second = srv2.requests()
    # only qumem and adamem questions were answered in the second run; nothing answered before was asked again
    def ident(r):
        return (r["body"]["messages"][0]["content"], r["body"]["messages"][-1]["content"])

    answered_first = {ident(r) for r in first if "json" in r["response"]}
    assert not answered_first & {ident(r) for r in second}, "a call already answered in the first run was sent again"
    assert len(_answer_requests(second)) == 25  # qumem, adamem, qumem_hybrid, qumem_evidence and adamem_turns
    a1_first = [r for r in first if "information-need agent" in r["body"]["messages"][0]["content"]]
    a1_second = [r for r in second if "information-need agent" in r["body"]["messages"][0]["content"]]
    assert len(a1_first) == 2 and len(a1_second) == 3  # the first chunk's A1 replayed from the ledger
    assert report["llm_calls"]["replayed_this_run"] >= len(a1_first)
    ck = [json.loads(x) for x in out.with_name("qa.checkpoint.jsonl").read_text().splitlines()]
    assert len(ck) == 5 * len(QA_STRATEGIES) and len({(r["strategy"], r["key"]) for r in ck}) == 5 * len(QA_STRATEGIES)
    assert report["qa"]["qumem"]["f1"] == pytest.approx(F1, abs=1e-4)
    assert report["qa"]["none"]["f1"] == 0.0 and report["qa"]["topk_turns"]["f1"] == pytest.approx(F1, abs=1e-4)

    # a changed state strategy (another query-stage version) is answered again; the other strategies are not
    import qumem_pipeline.eval.locomo.qa as qa_mod

    real = qa_mod.strategy_version
    with RunningFakeServer(_script(), tmp_path / "srv3") as srv3:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(qa_mod, "strategy_version", lambda s: real(s) + "-changed" if s == "qumem" else real(s))
            report3 = run_qa(str(path), out=out, memories=mem_dir, chunk=2, embedder=embedder, log=lambda m: None,
                             llm_backend=OpenAIBackend(base_url=srv3.base_url, max_retries=0, timeout_s=10))
        third = srv3.requests()
    assert report3["skipped"]["checkpoint_rows_other_version"] == 5
    # its 5 answer calls are identical requests, so the ledger replays them: nothing reaches the server
    assert third == [] and report3["qa"]["qumem"]["f1"] == report["qa"]["qumem"]["f1"]


def test_cli_qa_branch_prints_the_table_and_json(toy, embedder, tmp_path, monkeypatch):
    from qumem_pipeline.cli import main as cli_main

    _, path, _ = toy
    with RunningFakeServer(_script(), tmp_path / "srv") as srv:
        monkeypatch.setenv("QUMEM_LLM_BASE_URL", srv.base_url)
        buf = io.StringIO()
        with redirect_stdout(buf):
            rc = cli_main(["eval", "locomo", str(path), "--qa", "--strategies", "none,topk_turns", "--llm-kind", "openai",
                           "--out", str(tmp_path / "cli" / "qa.json"), "--sample-per-category", "1", "--json"])
    assert rc == 0
    out = buf.getvalue().strip().splitlines()
    rep = json.loads(out[-1])
    assert rep["qa"]["topk_turns"]["f1"] == pytest.approx(F1, abs=1e-4)
    assert any(line.strip().startswith("topk_turns") for line in out[:-1])


def test_decompose_builds_memories_once_and_a_rerun_reuses_them(toy, embedder, tmp_path):
    _, path, _ = toy
    script = _script()
    script["rules"].insert(0, {"match": "You are a memory decomposer", "responses": [{"echo_memory": True}]})
    out = tmp_path / "dec" / "qa.json"
    with RunningFakeServer(script, tmp_path / "srv") as srv:
        backend = OpenAIBackend(base_url=srv.base_url, max_retries=0)
        report = run_qa(str(path), out=out, strategies=["topk_memories"], decompose=True, llm_backend=backend,
                        embedder=embedder, log=lambda m: None)
        first = srv.requests()
    dec = [r for r in first if "memory decomposer" in r["body"]["messages"][0]["content"]]
    assert dec and report["decomposition"]["users_decomposed"] == [ANN, BO]
    assert report["qa"]["topk_memories"]["n"] == 4
    assert (out.with_name("qa.memories") / "memories").is_dir()
    ledger = [json.loads(x) for x in out.with_name("qa.ledger.jsonl").read_text().splitlines()]
    assert sum(r["strategy"] == "decompose" for r in ledger) == len(dec)
    # a new question set (another seed's sample) on the same out: memories reused, nothing decomposed again
    ck = out.with_name("qa.checkpoint.jsonl")
    ck.unlink()
    with RunningFakeServer(script, tmp_path / "srv2") as srv2:
        report2 = run_qa(str(path), out=out, strategies=["topk_memories"], decompose=True, embedder=embedder,
                         llm_backend=OpenAIBackend(base_url=srv2.base_url, max_retries=0), log=lambda m: None)
        again = srv2.requests()
    assert not [r for r in again if "memory decomposer" in r["body"]["messages"][0]["content"]]
    assert report2["decomposition"]["users_decomposed"] == []
    assert report2["qa"]["topk_memories"]["f1"] == report["qa"]["topk_memories"]["f1"]


def test_answer_step_sees_the_dates_of_what_a_state_cites():
    from datetime import datetime, timezone

    from qumem_pipeline.eval.locomo.qa import render_state
    from qumem_pipeline.query.strategies.base import RetrievedMemory, render_candidates

    d1, d2 = datetime(2023, 1, 20, 16, 4, tzinfo=timezone.utc), datetime(2023, 5, 7, tzinfo=timezone.utc)
    state = {"facts": [{"statement": "Jon lost his job yesterday", "memory_ids": ["m1"]},
                       {"statement": "Jon opened a studio", "memory_ids": ["m1", "turn:9"]},
                       {"statement": "undated", "memory_ids": ["m9"]}],
             "preference_trajectory": [], "insights": [{"insight": "Jon is driven", "memory_ids": ["turn:9"]}]}
    text = render_state(state, {"m1": d1, "turn:9": d2, "m9": None})
    assert "- fact: Jon lost his job yesterday [stated 20 January 2023]" in text
    assert "- fact: Jon opened a studio [stated 20 January 2023 to 7 May 2023]" in text
    assert "- fact: undated\n" in text and "- insight: Jon is driven [stated 7 May 2023]" in text
    assert "[stated" not in render_state(state)  # no dates given: the old rendering
    cands = [RetrievedMemory("m1", "fact", "lost his job yesterday", 3, 0.9, [3], d1),
             RetrievedMemory("m2", "fact", "no date", 4, 0.8, [4], None)]
    assert render_candidates(cands).splitlines()[1:] == [
        "M1 [fact, stated 20 January 2023]: lost his job yesterday", "M2 [fact, turn 4]: no date"]


def test_a_state_is_rendered_as_its_evidence_within_the_word_budget():
    from datetime import datetime, timezone

    from qumem_pipeline.eval.locomo.qa_contexts import StateRow, render_grounded

    d = datetime(2023, 5, 7, tzinfo=timezone.utc)
    state = {"facts": [{"statement": "Jon paints", "memory_ids": ["m2"]},
                       {"statement": "Jon has a studio", "memory_ids": ["gone"]}],
             "preference_trajectory": [{"aspect": "art", "earlier": "oil", "current": "acrylic",
                                        "applies_now_because": "faster", "memory_ids": ["m1"]}], "insights": []}
    texts = {"m1": "(Jon) Jon paints sunsets in oil", "m2": "(Jon) Jon took up painting", "turn:3": "Jon: I paint",
             "m3": " ".join(["long"] * 40)}
    row = StateRow(state, cited=["m2", "m1"], candidates=["m1", "m3", "m2", "turn:3", "profile:x"])
    text = render_grounded(row, texts, {"m1": d, "m2": d, "turn:3": d}, budget=60)
    lines = text.splitlines()
    # a fact is the memory it cites, verbatim and dated; its statement only where no citation resolves
    assert lines[1:4] == ["Relevant facts (the memories the state selected, with dates):",
                          "- [7 May 2023] (Jon) Jon took up painting", "- Jon has a studio"]
    assert lines[4].startswith("- preference (art): earlier oil; now acrylic (faster) [stated 7 May 2023]")
    # then the other candidates, cited first, by rank, whole: m3 does not fit and is passed over, m2 is not
    # repeated, a unit without text gets no line
    assert lines[5:] == ["Other evidence retrieved for this question (with dates):",
                         "[7 May 2023] (Jon) Jon paints sunsets in oil", "[7 May 2023] Jon: I paint"]
    header_words = len("Other evidence retrieved for this question (with dates):".split())
    assert len(text.split()) - header_words <= 60
    assert render_grounded(None, texts, None, 40).startswith("Inferred state: (none")
    tight = render_grounded(row, texts, {"m1": d, "m2": d}, budget=10)
    assert "Other evidence" not in tight and "Jon took up painting" in tight  # the state itself is never cut


def test_ledger_replays_each_call_as_it_finished_retries_included(tmp_path):
    """A call cut at its budget, then retried, is replayed as cut-then-retried: a rerun sends nothing
    and gets the first run's results; a call that got no completion (a proxy's HTML page) is sent again."""
    from fake_openai_server import RunningFakeServer

    from qumem_pipeline.eval.locomo.qa_ledger import LedgerBackend
    from qumem_pipeline.llm.retry import generate_with_retry
    from qumem_pipeline.llm.base import ChatRequest
    from qumem_pipeline.llm.factory import make_backend

    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    script = {"model": "m1", "rules": [
        {"match": "cut-once", "responses": [{"content": '{"answer": "ha', "finish_reason": "length"},
                                            {"json": {"answer": "second try"}}]},
        {"match": "always-cut", "responses": [{"content": '{"answer": "  ', "finish_reason": "length"}]},
        {"match": "down", "responses": [{"garbage": "<html>proxy error</html>"}]}]}

    def reqs():
        return [ChatRequest(f"r{i}", [{"role": "user", "content": t}], schema, 16, "answer_obj")
                for i, t in enumerate(["cut-once", "always-cut", "down"])]

    ledger = tmp_path / "ledger.jsonl"
    with RunningFakeServer(script, tmp_path / "srv") as srv:
        def run():
            inner = make_backend("openai", base_url=srv.base_url, max_retries=0, timeout_s=5.0)
            lb = LedgerBackend(inner, ledger)
            res = generate_with_retry(lb, reqs())
            lb.close()
            return lb, [(r.parsed, r.error_kind) for r in res]

        first, got1 = run()
        assert got1[0] == ({"answer": "second try"}, None)
        assert got1[1][1] == "length" and got1[2][1] == "invalid_json"
        assert first.sent == 6 and first.replayed == 0
        n_requests = len(srv.requests())
        second, got2 = run()
        assert got2 == got1  # the same results, the retry included
        assert second.replayed == 4  # cut, retry, cut, cut: finished calls are never paid twice
        assert second.sent == 2  # only the calls that got no answer
        assert len(srv.requests()) == n_requests + 2


def test_ledger_generate_each_writes_each_call_as_it_finishes_and_replays_follow_ups(tmp_path):
    """Streaming through the ledger (the decomposition's path): every finished call is a ledger row
    before the caller sees it, a follow-up the caller returns (a retry) is sent and recorded too, and
    a rerun hands the same results over with nothing sent."""
    from fake_openai_server import RunningFakeServer

    from qumem_pipeline.eval.locomo.qa_ledger import JsonlLog, LedgerBackend
    from qumem_pipeline.llm.base import ChatRequest, generate_each
    from qumem_pipeline.llm.factory import make_backend

    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    script = {"model": "m1", "rules": [
        {"match": "retry me", "responses": [{"json": {"answer": "retried"}}]},
        {"match": "q", "responses": [{"json": {"answer": "ok"}}]}]}
    ledger = tmp_path / "ledger.jsonl"
    reqs = [ChatRequest(f"r{i}", [{"role": "user", "content": f"q{i}"}], schema, 16, "answer_obj") for i in range(5)]

    def run(srv):
        lb = LedgerBackend(make_backend("openai", base_url=srv.base_url, max_retries=0, timeout_s=5.0), ledger)
        seen = []

        def on_result(req, res):
            rows_now = len(JsonlLog(ledger).rows())
            seen.append((req.request_id, res.parsed, rows_now))
            if req.request_id == "r2":  # one follow-up, as a retry would be
                return [ChatRequest("r2/retry", [{"role": "user", "content": "retry me"}], schema, 16, "answer_obj")]
            return None

        generate_each(lb, list(reqs), on_result)
        lb.close()
        return lb, seen

    with RunningFakeServer(script, tmp_path / "srv") as srv:
        first, seen1 = run(srv)
        assert first.sent == 6 and first.replayed == 0 and len(srv.requests()) == 6
        assert sorted(rid for rid, _, _ in seen1) == ["r0", "r1", "r2", "r2/retry", "r3", "r4"]
        assert dict((rid, p) for rid, p, _ in seen1)["r2/retry"] == {"answer": "retried"}
        # each result is on disk before it is handed over: the row count grows with every call
        assert [n for _, _, n in seen1] == list(range(1, 7))
        second, seen2 = run(srv)
        assert second.sent == 0 and second.replayed == 6 and len(srv.requests()) == 6
        assert sorted((r, json.dumps(p)) for r, p, _ in seen2) == sorted((r, json.dumps(p)) for r, p, _ in seen1)


def test_ledger_endpoint_failure_hands_back_results_aligned_to_the_callers_requests(tmp_path):
    """A replayed call and a call to an endpoint that is down: the error's partial_results line up with
    the requests the caller passed (the replayed result first, None for the one that got nothing)."""
    from fake_openai_server import RunningFakeServer

    from qumem_pipeline.eval.locomo.qa_ledger import LedgerBackend
    from qumem_pipeline.llm.base import ChatRequest, LLMEndpointError
    from qumem_pipeline.llm.factory import make_backend
    from qumem_pipeline.runtime.processes import free_port

    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    ledger = tmp_path / "ledger.jsonl"
    a = ChatRequest("a", [{"role": "user", "content": "qa"}], schema, 16, "answer_obj")
    b = ChatRequest("b", [{"role": "user", "content": "qb"}], schema, 16, "answer_obj")
    with RunningFakeServer({"model": "m1", "rules": [{"match": "q", "responses": [{"json": {"answer": "A"}}]}]},
                           tmp_path / "srv") as srv:
        LedgerBackend(make_backend("openai", base_url=srv.base_url, max_retries=0, timeout_s=5.0), ledger).generate([a])
    dead = make_backend("openai", base_url=f"http://127.0.0.1:{free_port()}/v1", model="m1", max_retries=0, timeout_s=2.0)
    lb = LedgerBackend(dead, ledger)
    with pytest.raises(LLMEndpointError) as got:
        lb.generate([a, b])
    partial = got.value.partial_results
    assert len(partial) == 2 and partial[0].parsed == {"answer": "A"} and partial[1] is None
    assert lb.replayed == 1 and lb.sent == 0


def test_a_run_stopped_by_sigint_reports_and_records_what_it_answered(toy, embedder, tmp_path):
    """A recording run stopped at its deadline (SIGINT, as `timeout -s INT` sends) keeps what it finished:
    the report scores the strategies answered before the stop, says it was interrupted, and the record
    gets the run's manifest, so --replay-only covers those questions with no model."""
    d, path, mem_dir = toy
    rec = tmp_path / "rec"

    class StopAtState(OpenAIBackend):
        @staticmethod
        def _stop_at_state(requests):
            if any("user-state inference agent" in r.messages[0]["content"] for r in requests):
                raise KeyboardInterrupt

        def generate(self, requests, *args, **kwargs):
            self._stop_at_state(requests)
            return super().generate(requests, *args, **kwargs)

        def generate_each(self, requests, on_result):  # the ledger and the record send each call this way
            self._stop_at_state(requests)
            return super().generate_each(requests, on_result)

    with RunningFakeServer(_script(), tmp_path / "srv") as srv:
        report = run_qa(str(path), out=tmp_path / "run" / "qa.json", memories=mem_dir, chunk=2, embedder=embedder,
                        log=lambda m: None, record=rec,
                        llm_backend=StopAtState(base_url=srv.base_url, max_retries=0, timeout_s=10))
    assert "interrupted" in report["skipped"]
    assert report["qa"]["topk_turns"]["n"] == report["n_questions"] == 4  # the scored questions, all answered
    assert report["qa"]["topk_turns"]["f1"] == pytest.approx(F1, abs=1e-4)
    assert report["qa"]["qumem"]["n"] == 0 and report["qa"]["qumem"]["not_answered"] == 5  # stopped in its first chunk
    manifest = report["record"]["manifest"]
    run = json.loads(next((rec / "runs").glob(manifest)).read_text())
    assert sorted(run["answered"]) == ["full_history", "none", "topk_memories", "topk_turns"]
    replay = run_qa(str(path), out=tmp_path / "replay.json", memories=mem_dir, chunk=2, embedder=embedder,
                    log=lambda m: None, record=rec, replay_only=True, strategies=["topk_turns", "topk_memories"])
    assert replay["replay"]["missing"]["calls"] == 0
    assert replay["qa"]["topk_turns"]["f1"] == report["qa"]["topk_turns"]["f1"]
