"""The LoCoMo harness's named steps, each alone on small synthetic conversations:
load (data), build units (units), rank, score, report, and one conversation through all of them."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import polars as pl
import pytest

from qumem_pipeline.eval.locomo.data import load_dataset, qa_items
from qumem_pipeline.eval.locomo.rank import SCORINGS, embed_units, rank_order, scorings_for
from qumem_pipeline.eval.locomo.report import RunSettings, build_report, format_table
from qumem_pipeline.eval.locomo.score import QAItem, Tally
from qumem_pipeline.eval.locomo.sources import UnitSources, gather_sources
from qumem_pipeline.eval.locomo.units import Conversation, EvalUnit, memory_units, text_unit, unit_builders


def _conv() -> Conversation:
    """Two sessions, six turns, two speakers; primary user Ann, whose turn indices are 0..5."""
    turns = pl.DataFrame({
        "turn_index": list(range(6)),
        "session_id": ["s1"] * 4 + ["s2"] * 2,
        "speaker": ["Ann", "Bo"] * 3,
        "text": ["I adopted a puppy named Rex.", "How is he?", "He chews shoes.", "I paint now.",
                 "I switched to green tea.", "Why?"],
        "source_ref": ["D1:1", "D1:2", "D1:3", "D1:4", "D2:1", "D2:2"],
    })
    ann = dict(enumerate(turns["source_ref"]))
    bo = {10 + i: d for i, d in ann.items()}  # Bo's history numbers the same turns differently
    return Conversation("x", "x-ann", ["x-ann", "x-bo"], turns, {"x-ann": ann, "x-bo": bo})


def _toy_file(tmp_path):
    conv = {"speaker_a": "Ann", "speaker_b": "Bo"}
    for s in (1, 2):
        conv[f"session_{s}_date_time"] = f"1:00 pm on {s} May, 2023"
        conv[f"session_{s}"] = [{"speaker": "Ann" if i % 2 == 0 else "Bo", "dia_id": f"D{s}:{i + 1}",
                                 "text": f"session {s} turn {i + 1}"} for i in range(3)]
    qa = [{"question": "q1", "answer": "a", "evidence": ["D1:1"], "category": 1},
          {"question": "q2", "answer": "a", "evidence": ["D9:9"], "category": 2},  # names no turn
          {"question": "q3", "answer": "a", "evidence": ["D2:3", "D7:1"], "category": 5}]
    p = tmp_path / "toy.json"
    p.write_text(json.dumps([{"sample_id": "t-1", "conversation": conv, "qa": qa}]))
    return p


# ---------------------------------------------------------------------------------------- load


def test_load_dataset_and_qa_items_keep_only_answerable_evidence(tmp_path):
    data = load_dataset(str(_toy_file(tmp_path)), speaker_prefix=False)
    (conv,) = data.conversations
    assert conv.user_id == "t-1-ann" and conv.speaker_prefix is False  # speaker_a is the primary user
    assert [l[2] for l in conv.lines()][:2] == ["session 1 turn 1", "session 1 turn 2"]
    items, skipped = qa_items(data.conversations, data.qa, data.qa_stats)
    assert [(it.question, set(it.gold), it.category) for it in items["t-1"]] == [("q1", {"D1:1"}, 1),
                                                                               ("q3", {"D2:3"}, 5)]
    assert skipped["items_without_valid_evidence"] + skipped["evidence_ids_not_in_valid_turns"] >= 1
    assert "qa_loader" in skipped
    # a QA item of a conversation not loaded is counted, not scored
    items, skipped = qa_items([], data.qa)
    assert dict(items) == {} and skipped["items_outside_limited_conversations"] == len(data.qa)


# ---------------------------------------------------------------------------------------- build units


def test_unit_builders_in_report_order_with_what_each_kind_needs():
    eps = {"x-ann": pl.DataFrame({"episode_index": [0, 1], "turn_ids": [[0, 1, 2, 3], [4, 5]]})}
    mems = pl.DataFrame({"user_id": ["x-bo"], "content": ["Ann has a puppy"], "evidence_turn_ids": [[10, 12]]})
    kinds = unit_builders(["turns", "fixed_chunks", "sessions", "episodes", "memories"], (2, 3), eps, mems)
    assert [k for k, _ in kinds] == ["turns", "window_2", "window_3", "sessions", "episodes", "matched_windows",
                                     "memories"]
    built = {k: b(_conv()) for k, b in kinds}
    assert [u.turn_rows for u in built["window_3"]] == [(0, 1, 2), (3,), (4, 5)]
    assert [u.turn_rows for u in built["episodes"]] == [(0, 1, 2, 3), (4, 5)]
    assert built["memories"][0].pieces == [(frozenset({"D1:1", "D1:3"}), 4)]  # Bo's ids mapped to dia ids
    # episodes are not built without episodes, and only memories given bring the memories row
    assert [k for k, _ in unit_builders(["episodes", "memories"])] == []
    assert text_unit(["D1:1"], "a b c") == EvalUnit("a b c", [(frozenset({"D1:1"}), 3)])


def test_memory_units_ignore_other_users_and_unknown_turns():
    mems = pl.DataFrame({"user_id": ["x-ann", "y-zed"], "content": ["likes tea", "other"],
                         "evidence_turn_ids": [[4, 99], [0]]})
    assert [u.pieces for u in memory_units(_conv(), mems)] == [[(frozenset({"D2:1"}), 2)]]


# ---------------------------------------------------------------------------------------- rank


def test_rank_order_is_stable_and_scorings_per_kind():
    assert rank_order(np.array([0.2, 0.9, 0.2, 0.9])).tolist() == [1, 3, 0, 2]  # ties keep unit order
    assert scorings_for("turns") == scorings_for("memories") == ("text",)
    assert scorings_for("window_4") == SCORINGS


def test_embed_units_reuses_turn_vectors_for_single_turns():
    class CountingEmbedder:  # counts calls only; the real encoder is exercised in the end-to-end test below
        calls = 0

        def encode(self, texts, batch_size=64):
            self.calls += 1
            return np.ones((len(texts), 2), dtype=np.float32)

    emb, tv = CountingEmbedder(), np.zeros((2, 2), dtype=np.float32)
    units = [EvalUnit("a", [(frozenset({"a"}), 1)], (0,)), EvalUnit("b", [(frozenset({"b"}), 1)], (1,))]
    assert embed_units(units, emb, 8, tv, single_turns=True) is tv and emb.calls == 0
    assert embed_units(units, emb, 8, tv).shape == (2, 2) and emb.calls == 1


# ---------------------------------------------------------------------------------------- score


def test_tally_records_budgeted_and_top_unit_recall_per_item():
    units = [EvalUnit("x", [(frozenset({"a"}), 100)]), EvalUnit("y", [(frozenset({"b"}), 100)])]
    items = [QAItem("x", 1, "q", frozenset({"b"})), QAItem("x", 5, "q", frozenset({"a", "b"}))]
    scores = np.array([[0.1, 0.9], [0.9, 0.1]])
    t = Tally()
    t.add_scored("turns", "text", units, scores, items, (128, 256), 0.5)
    assert t.per_kind[("turns", "text")] == [(1, {128: 1.0, 256: 1.0}), (5, {128: 0.5, 256: 1.0})]
    assert t.per_rank[("turns", "text")][0] == (1, {1: 1.0, 3: 1.0, 5: 1.0})
    t.add_ranked("strategy_topk", [[units[0], units[1]], [units[1]]], items, (128,), 0.5)
    assert t.per_kind[("strategy_topk", "text")] == [(1, {128: 0.0}), (5, {128: 0.5})]
    t.add_scored("memories", "text", [], np.zeros((2, 0)), items, (128,), 0.5)  # no units: zero recall
    assert t.per_kind[("memories", "text")] == [(1, {128: 0.0}), (5, {128: 0.0})]


# ---------------------------------------------------------------------------------------- report


def _settings(**kw):
    base = dict(path="toy.json", budgets=(128, 256), units=["turns", "fixed_chunks"], window_sizes=(2, 4),
                unit_scoring="text", strategies=[])
    return RunSettings(**{**base, **kw})


def test_report_picks_best_window_and_splits_categories():
    conv = _conv()
    items = {"x": [QAItem("x", 1, "q", frozenset({"D1:1"})), QAItem("x", 5, "q", frozenset({"D1:2"}))]}
    t = Tally()
    t.per_kind[("turns", "text")] += [(1, {128: 0.5, 256: 1.0}), (5, {128: 0.0, 256: 0.0})]
    for sc in SCORINGS:
        t.per_kind[("window_2", sc)] += [(1, {128: 0.2, 256: 0.2}), (5, {128: 1.0, 256: 1.0})]
        t.per_kind[("window_4", sc)] += [(1, {128: 0.3, 256: 0.4}), (5, {128: 0.0, 256: 0.0})]
    t.unit_stats["turns"]["n_units"] = 6
    skipped = {}
    r = build_report(t, _settings(), [conv], items, UnitSources(), skipped, slice_info=None, load_info={},
                     embedding_model="emb@1", max_seq=256)
    # best window by mean recall over categories 1-4 (window_4); adversarial items only in the wider block
    assert r["retrieval"]["fixed_chunks"] == {"128": 0.3, "256": 0.4, "window_turns": 4}
    assert r["retrieval"]["turns"] == {"128": 0.5, "256": 1.0}
    assert r["retrieval_with_adversarial"]["turns"] == {"128": 0.25, "256": 0.5}
    assert r["retrieval"]["sessions"] is None and r["n_questions"] == 1 and r["n_questions_with_adversarial"] == 2
    assert sorted(r["per_category"]) == ["1", "5"] and r["per_category"]["5"]["n"] == 1
    assert r["units"]["turns"]["n_units"] == 6 and skipped == {}
    r["wall_s"] = 0.0
    text = format_table(r)
    assert "fixed (best=4)" in text and "category 5" in text and "sessions" in text


def test_report_says_why_rows_are_missing():
    conv = _conv()
    items = {"x": [QAItem("x", 1, "q", frozenset({"D1:1"}))], "y": [QAItem("y", 1, "q", frozenset({"D1:1"}))]}
    conv_y = _conv()
    conv_y.sample_id = "y"
    t = Tally()
    t.per_kind[("turns", "text")] += [(1, {128: 1.0}), (1, {128: 0.0})]
    t.per_kind[("memories", "text")] += [(1, {128: 1.0})]
    t.mem_conversations.append("x")
    mems = pl.DataFrame({"user_id": ["x-ann"], "content": ["m"], "evidence_turn_ids": [[0]]})
    skipped = {}
    r = build_report(t, _settings(budgets=(128,), window_sizes=(), units=["turns", "fixed_chunks", "memories"]),
                     [conv, conv_y], items, UnitSources(memories=mems), skipped, slice_info=None, load_info={},
                     embedding_model="emb@1", max_seq=256)
    assert skipped["fixed_chunks"] == "no window sizes given"
    assert "memories only for conversations ['x']" in skipped["memories_partial"]
    assert r["memories_subset_turns"] == {"128": 1.0}  # turns on conversation x's items only
    assert r["memories_n_memories"] == 1


# ---------------------------------------------------------------------------------------- sources


def test_sources_without_llm_skip_qumem_and_keep_the_others():
    mems = pl.DataFrame({"user_id": ["x-ann"], "content": ["m"], "evidence_turn_ids": [[0]]})
    skipped = {}
    src = gather_sources([_conv()], ["turns"], ["qumem", "topk"], skipped, memories=mems)
    assert src.run_strategies == ["topk"] and src.strategy_llm is None
    assert "needs an LLM" in skipped["strategy_qumem"]
    assert src.memories is mems and src.episodes_by_user is None
    skipped = {}
    src = gather_sources([_conv()], ["memories"], [], skipped, memories="/nonexistent/memories")
    assert src.memories is None and "unreadable" in skipped["memories"]


# ---------------------------------------------------------------------------------------- one conversation


@pytest.fixture(scope="module")
def embedder():
    from qumem_pipeline.index.embeddings import Embedder

    return Embedder.load(device="cpu")


def test_one_conversation_through_every_step(embedder):
    from qumem_pipeline.eval.locomo.run import evaluate_conversation

    conv = _conv()
    items = [QAItem("x", 1, "What is the puppy's name?", frozenset({"D1:1"})),
             QAItem("x", 2, "What does Ann drink?", frozenset({"D2:1"}))]
    qv = embedder.encode([it.question for it in items])
    t = Tally()
    evaluate_conversation(conv, items, qv, unit_builders(["turns", "fixed_chunks"], (2,)), embedder, t,
                          budgets=(8, 1024))
    assert set(t.per_kind) == {("turns", "text"), *(("window_2", sc) for sc in SCORINGS)}
    # at 1024 words every unit fits: recall 1 whatever the ranking; at 8 words the best turn is the evidence
    for recs in t.per_kind.values():
        assert [r[1024] for _, r in recs] == [1.0, 1.0]
    assert [r[8] for _, r in t.per_kind[("turns", "text")]] == [1.0, 1.0]
    assert t.unit_stats["turns"]["n_units"] == 6 and t.unit_stats["window_2"]["n_units"] == 3
    assert t.unit_stats["window_2"]["cross_session"] == 0
