"""The LoCoMo harness's ``qumem`` strategy: A1/A2 plans from a real (scripted) OpenAI-shaped HTTP
server, retrieval through the product's TypedMemoryRetriever over an in-memory per-type FAISS
store, backfill in topk order. A tiny hand-made LoCoMo-format file, so no shared dataset is needed."""

import io
import json
import os
from contextlib import redirect_stdout

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import polars as pl
import pytest

from fake_openai_server import RunningFakeServer
from qumem_pipeline.eval.locomo.harness import EvalUnit, load_conversations, main, word_count

ANN, BO = "toy-1-ann", "toy-1-bo"
Q_DOG, Q_DRINK, Q_SPORT = "What is the name of Ann's dog?", "What does Ann drink now?", "What did Bo do in Berlin?"
# per question: the plan A2 returns (Q_SPORT's empty store set is repaired to all stores)
PLANS = {
    Q_DOG: [{"query": "Ann's dog name", "stores": ["fact"]}],
    Q_DRINK: [{"query": "Ann's drink preference", "stores": ["preference"]}],
    Q_SPORT: [{"query": "Bo marathon", "stores": []}],
}
# memory_id -> (user, type, content, evidence turn ids); 7 facts so k=5 cannot take them all
MEMORIES = {
    "m-dog": (ANN, "fact", "Ann adopted a golden retriever puppy named Rex.", [0]),
    "m-settle": (BO, "fact", "Bo asked how the puppy is settling in.", [1]),
    "m-shoes": (ANN, "fact", "Rex chews Ann's shoes.", [2]),
    "m-paint": (BO, "fact", "Bo is learning watercolor painting.", [3]),
    "m-switch": (ANN, "fact", "Ann switched from coffee to green tea.", [4]),
    "m-sleep": (ANN, "fact", "Coffee kept Ann awake at night.", [6]),
    "m-marathon": (BO, "fact", "Bo ran his first marathon in Berlin.", [7]),
    "m-tea": (ANN, "preference", "Ann prefers green tea over coffee.", [4, 6]),
    "m-love": (ANN, "preference", "Ann loves her dog.", [2]),
    "m-health": (ANN, "insight", "Ann picks health over habit.", [6]),
}


def _toy_locomo() -> list[dict]:
    s1 = [("Ann", "I adopted a golden retriever puppy named Rex last week."), ("Bo", "How is he settling in?"),
          ("Ann", "He chews my shoes, but I love him."), ("Bo", "I started learning to paint with watercolors.")]
    s2 = [("Ann", "I switched from coffee to green tea this month."), ("Bo", "Why the change?"),
          ("Ann", "Coffee kept me awake at night."), ("Bo", "I ran my first marathon in Berlin.")]
    conv = {"speaker_a": "Ann", "speaker_b": "Bo",
            "session_1_date_time": "1:00 pm on 1 May, 2023", "session_2_date_time": "1:00 pm on 8 May, 2023"}
    for n, sess in ((1, s1), (2, s2)):
        conv[f"session_{n}"] = [{"speaker": sp, "dia_id": f"D{n}:{i + 1}", "text": t} for i, (sp, t) in enumerate(sess)]
    qa = [{"question": Q_DOG, "answer": "Rex", "evidence": ["D1:1"], "category": 1},
          {"question": Q_DRINK, "answer": "green tea", "evidence": ["D2:1"], "category": 1},
          {"question": Q_SPORT, "answer": "a marathon", "evidence": ["D2:4"], "category": 1}]
    return [{"sample_id": "toy-1", "conversation": conv, "qa": qa}]


def _memories() -> pl.DataFrame:
    return pl.DataFrame(
        [{"memory_id": m, "user_id": u, "type": t, "content": c, "evidence_turn_ids": ev, "position": ev[-1]}
         for m, (u, t, c, ev) in MEMORIES.items()],
        schema_overrides={"evidence_turn_ids": pl.List(pl.Int64)})


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    d = tmp_path_factory.mktemp("qumem-harness")
    path = d / "toy_locomo.json"
    path.write_text(json.dumps(_toy_locomo()))
    mem_dir = d / "memories"
    for uid, g in _memories().group_by("user_id"):
        (mem_dir / f"user_id={uid[0]}").mkdir(parents=True)
        g.write_parquet(mem_dir / f"user_id={uid[0]}" / "part-0.parquet")
    script = {"model": "fake-planner", "rules": [
        *({"match": f"Current query: {q}\n\nInformation needs", "responses": [{"json": {"queries": plan}}]}
          for q, plan in PLANS.items()),
        {"match": "information-need agent", "responses": [{"json": {"needs": [{"need": "the fact asked", "why": "to answer"}]}}]},
    ]}
    with RunningFakeServer(script, d / "srv") as srv:
        yield path, mem_dir, srv


@pytest.fixture(scope="module")
def embedder():
    from qumem_pipeline.index.embeddings import Embedder

    return Embedder.load(device="cpu")


def _openai(srv):
    from qumem_pipeline.llm.factory import make_backend

    return make_backend("openai", base_url=srv.base_url)


def test_qumem_ranks_planned_memories_first_then_topk_backfill(toy, embedder):
    from qumem_pipeline.eval.locomo.adamem_units import strategy_rankings

    path, _, srv = toy
    conv = load_conversations(str(path))[0][0]
    assert conv.user_id == ANN
    questions = [Q_DOG, Q_DRINK, Q_SPORT]
    stats: dict = {}
    out = strategy_rankings(conv, questions, embedder.encode(questions), ["qumem", "topk"], embedder, _memories(), None,
                            lambda dias, text: EvalUnit(text, [(frozenset(dias), word_count(text))]),
                            llm=_openai(srv), qumem_stats=stats)
    by_text = {c: m for m, (_, _, c, _) in MEMORIES.items()}
    ids = {s: [[by_text[u.text] for u in units] for units in lists] for s, lists in out.items()}
    for qi in range(3):  # every memory exactly once: equal budgets, no duplicates
        assert sorted(ids["qumem"][qi]) == sorted(MEMORIES) and sorted(ids["topk"][qi]) == sorted(MEMORIES)
    # the query anchor (every store, 2k = 10 deep) reaches the whole toy, so planning ranks all ten by best score
    assert stats["toy-1"]["mean_planned_memories"] == len(MEMORIES)
    dog, drink = ids["qumem"][0], ids["qumem"][1]
    assert dog[0] == "m-dog" or dog[:2] == ["m-love", "m-dog"]
    assert set(drink[:2]) & {"m-tea", "m-switch"}
    # evidence maps to the conversation's dia ids (Bo's memories pooled via his turns)
    assert out["qumem"][2][0].pieces[0][0] <= {f"D{s}:{i}" for s in (1, 2) for i in range(1, 5)}
    st = stats["toy-1"]
    assert st["questions"] == 3 and st["a1_a2_prompt_tokens"] > 0 and st["a1_a2_completion_tokens"] > 0
    assert st["plans_repaired"] == 1 and st["repairs"] == ["empty store set -> all stores"]
    a1 = [r for r in srv.requests() if "information-need agent" in json.dumps(r["body"])]
    assert len(a1) >= 3


def test_planned_retrieval_never_uses_memories_after_as_of(toy, embedder):
    from qumem_pipeline.eval.locomo.adamem_units import conversation_memories
    from qumem_pipeline.eval.locomo.qumem_units import qumem_planned_retrieval

    path, _, srv = toy
    conv = load_conversations(str(path))[0][0]
    mems = conversation_memories(conv, _memories())
    res = qumem_planned_retrieval("toy-1", ANN, [Q_DRINK, Q_DOG], mems, embedder, _openai(srv), as_of=3)
    pos = dict(zip(mems["memory_id"].to_list(), mems["position"].to_list()))
    assert "m-love" in res.memory_ids[0] and "m-tea" not in res.memory_ids[0]  # m-tea (stated at turn 6) is after as_of
    assert all(pos[m] <= 3 for m in res.memory_ids[0])
    assert res.memory_ids[1] and all(pos[m] <= 3 for m in res.memory_ids[1])
    # every memory up to turn 3 (the anchor reaches the preference store too), nothing later
    assert set(res.memory_ids[1]) == {m for m, p in pos.items() if p <= 3} == {"m-dog", "m-settle", "m-shoes", "m-paint", "m-love"}


def test_planned_retrieval_is_the_strategys_plans_plus_a_deeper_query_anchor(toy, embedder):
    """k=1: Q_DOG's rewrite searches the fact store one deep; the query itself searches every store 2 deep."""
    from qumem_pipeline.eval.locomo.adamem_units import conversation_memories
    from qumem_pipeline.eval.locomo.qumem_units import qumem_planned_retrieval

    path, _, srv = toy
    conv = load_conversations(str(path))[0][0]
    mems = conversation_memories(conv, _memories())
    res = qumem_planned_retrieval("toy-1", ANN, [Q_DOG], mems, embedder, _openai(srv), as_of=99, k=1)
    assert res.plans[0] == [("Ann's dog name", ["fact"]), (Q_DOG, ["fact", "preference", "insight"])]
    got = res.memory_ids[0]
    assert "m-dog" in got and "m-shoes" in got  # two facts: the anchor goes deeper than k
    assert {"m-love", "m-tea", "m-health"} <= set(got)  # stores the rewrite did not plan, reached by the anchor
    assert len(got) == 5 and got == list(dict.fromkeys(got))


def _run(args, env_url=None, monkeypatch=None):
    if env_url:
        monkeypatch.setenv("QUMEM_LLM_BASE_URL", env_url)
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(args) == 0
    return json.loads(buf.getvalue().strip().splitlines()[-1]), buf.getvalue()


def test_harness_reports_qumem_row_with_llm_and_memories(toy, monkeypatch):
    path, mem_dir, srv = toy
    report, text = _run([str(path), "--json", "--units", "turns", "--memories", str(mem_dir),
                         "--strategies", "qumem,topk", "--llm-kind", "openai"], srv.base_url, monkeypatch)
    r = report["retrieval"]["strategies"]
    assert "strategy_qumem" not in report["skipped"] and r["qumem"] is not None
    assert "strategy qumem" in text and "qumem planning (fake-planner)" in text
    # every question's evidence is covered by its planned retrieval's memories within 128 words
    assert r["qumem"]["128"] == 1.0
    qp = report["qumem_planning"]
    assert qp["model"] == "fake-planner" and qp["k_per_sub_query"] == 5 and qp["plans_repaired"] == 1
    assert qp["prompt_tokens"] == qp["by_conversation"]["toy-1"]["a1_a2_prompt_tokens"] > 0


def test_harness_ledger_replays_planning_calls_on_rerun(toy, monkeypatch, tmp_path):
    """--out puts every A1/A2 call in <out>.ledger.jsonl; a rerun sends nothing and reports the same recall."""
    path, mem_dir, srv = toy
    out = tmp_path / "h.json"
    args = [str(path), "--json", "--units", "turns", "--memories", str(mem_dir), "--strategies", "qumem",
            "--llm-kind", "openai", "--out", str(out)]
    before = len(srv.requests())
    first, _ = _run(args, srv.base_url, monkeypatch)
    sent = len(srv.requests()) - before
    assert first["llm_ledger"]["sent"] == sent == 6 and first["llm_ledger"]["replayed"] == 0  # 3 questions x (A1, A2)
    rows = [json.loads(x) for x in (tmp_path / "h.json.ledger.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and {r["type"] for r in rows} == {"information_needs", "retrieval_plan"}
    second, _ = _run(args, srv.base_url, monkeypatch)
    assert len(srv.requests()) - before == sent, "the rerun paid for calls the ledger holds"
    assert second["llm_ledger"] == {**first["llm_ledger"], "sent": 0, "replayed": 6}
    assert second["retrieval"]["strategies"]["qumem"] == first["retrieval"]["strategies"]["qumem"]


def test_harness_keeps_qumem_skipped_without_llm_or_memories(toy, monkeypatch):
    path, mem_dir, srv = toy
    report, _ = _run([str(path), "--json", "--units", "turns", "--memories", str(mem_dir), "--strategies", "qumem,topk"])
    assert report["retrieval"]["strategies"]["qumem"] is None and "needs an LLM" in report["skipped"]["strategy_qumem"]
    assert report["retrieval"]["strategies"]["topk"] is not None and report["qumem_planning"] is None
    report, _ = _run([str(path), "--json", "--units", "turns", "--strategies", "qumem,topk", "--llm-kind", "openai"],
                     srv.base_url, monkeypatch)
    assert report["retrieval"]["strategies"]["qumem"] is None and "--memories" in report["skipped"]["strategy_qumem"]
