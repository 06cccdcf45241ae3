"""LoCoMo retrieval harness: the budgeted-recall rule on hand-made cases, and the harness end to end
on a two-conversation slice of the shared dev file (skipped with a reason when the file is absent)."""

import io
import json
import os
import re
from contextlib import redirect_stdout

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import polars as pl
import pytest

from qumem_pipeline.runtime.datasets import ENV_VAR, shared_datasets_dir
from qumem_pipeline.eval.locomo.harness import (
    UNIT_KINDS,
    Conversation,
    EvalUnit,
    QAItem,
    budgeted_coverage,
    budgeted_recall,
    episode_units,
    main,
    recall_at_units,
    session_units,
    slice_locomo,
    turn_units,
    unit_scores,
    window_units,
    word_count,
)

DEV = shared_datasets_dir() / "locomo" / "locomo_dev5.json"


def U(*pieces):
    """A unit from (dia_ids, words) pieces."""
    return EvalUnit("x", [(frozenset(ids if isinstance(ids, (list, tuple, set)) else [ids]), w) for ids, w in pieces])


# ---------------------------------------------------------------------------------------- the rule


def test_units_taken_whole_while_they_fit():
    ranked = [U(("a", 60)), U(("b", 60)), U(("c", 8)), U(("d", 100))]
    cov = budgeted_coverage(ranked, (128, 256))
    assert cov[128] == {"a", "b", "c"}  # exactly 128 words: the budget is inclusive
    assert cov[256] == {"a", "b", "c", "d"}


def test_crossing_unit_truncated_half_rule():
    # a window of two turns crossing the budget: its first turn fits, its second counts iff >= half fits
    ranked = [U(("a", 100)), U(("b", 20), ("c", 16))]
    assert budgeted_coverage(ranked, (128,))[128] == {"a", "b", "c"}  # c: 8 of 16 words fit -> counts
    assert budgeted_coverage(ranked, (127,))[127] == {"a", "b"}  # 7 of 16 -> not
    ranked = [U(("a", 100)), U(("b", 20), ("c", 18))]
    assert budgeted_coverage(ranked, (128,))[128] == {"a", "b"}  # c: 8 of 18 words < half -> not covered
    ranked = [U(("a", 100)), U(("b", 30))]
    assert budgeted_coverage(ranked, (128,))[128] == {"a", "b"}  # 28 of 30 words fit
    ranked = [U(("a", 120)), U(("b", 30))]
    assert budgeted_coverage(ranked, (128,))[128] == {"a"}  # 8 of 30 words fit
    # nothing after the crossing unit counts, even if it would fit
    ranked = [U(("a", 120)), U(("b", 30)), U(("c", 1))]
    assert budgeted_coverage(ranked, (128,))[128] == {"a"}


def test_memory_piece_covers_all_its_evidence():
    ranked = [U((["d1", "d2", "d3"], 12)), U(("d4", 300))]
    assert budgeted_recall(ranked, ["d2", "d4", "d9"], (128, 256)) == {128: pytest.approx(1 / 3), 256: pytest.approx(2 / 3)}


def test_exhausted_units_and_first_unit_over_budget():
    assert budgeted_coverage([U(("a", 10))], (128, 256)) == {128: {"a"}, 256: {"a"}}
    # a single session bigger than the budget: its first turns count, the rest do not
    ranked = [U(("a", 60), ("b", 60), ("c", 60), ("d", 60))]
    assert budgeted_coverage(ranked, (128, 200, 256)) == {128: {"a", "b"}, 200: {"a", "b", "c"}, 256: {"a", "b", "c", "d"}}
    assert budgeted_coverage([], (128,)) == {128: set()}
    with pytest.raises(ValueError):
        budgeted_recall(ranked, [], (128,))
    assert word_count("Caroline: I went to a support group.") == 7


# ---------------------------------------------------------------------------------------- units


def _toy_conversation() -> Conversation:
    """Two sessions of turns by two speakers; turn 3 has a photo caption the importer appended."""
    texts = ["Hi Mel, I went to a support group.", "Oh nice, how was it?", "Really moving.",
             "Look at this [shares a photo: a lake at sunrise]", "Back again: I adopted a dog!", "What breed?"]
    turns = pl.DataFrame({
        "turn_index": list(range(6)),
        "session_id": ["session_1"] * 4 + ["session_2"] * 2,
        "speaker": ["Caroline", "Melanie"] * 3,
        "role": ["user", "other"] * 3,
        "text": texts,
        "source_ref": ["D1:1", "D1:2", "D1:3", "D1:4", "D2:1", "D2:2"],
    })
    return Conversation("c", "c-caroline", ["c-caroline"], turns, {"c-caroline": dict(enumerate(turns["source_ref"]))})


def test_multi_turn_units_cost_exactly_what_their_text_holds():
    conv = _toy_conversation()
    eps = pl.DataFrame({"episode_index": [1, 0], "turn_ids": [[4, 5], [0, 1, 2, 3]]})
    kinds = {"turns": turn_units(conv), "window_3": window_units(conv, 3), "sessions": session_units(conv),
             "episodes": episode_units(conv, eps)}
    for name, units in kinds.items():
        for u in units:
            # the words a unit costs are the words of the text it carries (speaker prefix included)
            assert u.words == word_count(u.text), name
            assert u.text.splitlines() == [conv.lines()[r][2] for r in u.turn_rows], name
            assert [next(iter(ids)) for ids, _ in u.pieces] == [conv.lines()[r][0] for r in u.turn_rows], name
    assert [u.turn_rows for u in kinds["window_3"]] == [(0, 1, 2), (3,), (4, 5)]  # never across a session
    assert [u.turn_rows for u in kinds["episodes"]] == [(0, 1, 2, 3), (4, 5)]  # episode order
    assert kinds["episodes"][0].text.startswith("Caroline: Hi Mel")
    conv.speaker_prefix = False
    assert episode_units(conv, eps)[1].text == "Back again: I adopted a dog!\nWhat breed?"


def test_primary_user_switch_brings_that_users_turns():
    """Episodes come from the primary user's own history (their utterances are role=user)."""
    from qumem_pipeline.eval.locomo.harness import _speaker_a_first

    conv = _toy_conversation()
    other = conv.turns.with_columns(role=pl.Series(["other", "user"] * 3))
    conv.user_ids = ["c-bo", "c-caroline"]
    conv.user_id, conv.turns = "c-bo", other
    conv.turns_by_user = {"c-bo": other, "c-caroline": _toy_conversation().turns}
    conv.dia_by_user_turn = {"c-bo": {}, "c-caroline": {}}
    _speaker_a_first([conv], [{"sample_id": "c", "user_ids": ["c-caroline", "c-bo"]}])
    assert conv.user_id == "c-caroline" and conv.user_ids == ["c-caroline", "c-bo"]
    assert conv.turns.filter(pl.col("role") == "user")["speaker"].unique().to_list() == ["Caroline"]


def test_unit_scorings_from_turn_vectors():
    turn_vecs = np.eye(4, dtype=np.float32)
    units = [EvalUnit("a b", [(frozenset(["t0"]), 1), (frozenset(["t1"]), 1)], (0, 1)),
             EvalUnit("c", [(frozenset(["t2"]), 1)], (2,))]
    q = np.array([[0.6, 0.0, 0.8, 0.0]], dtype=np.float32)
    assert unit_scores(units, q, "best_turn", turn_vecs=turn_vecs) == pytest.approx(np.array([[0.6, 0.8]]))
    mean = unit_scores(units, q, "mean_turn", turn_vecs=turn_vecs)
    assert mean == pytest.approx(np.array([[0.6 / np.sqrt(2), 0.8]]), rel=1e-5)
    unit_vecs = np.array([[0, 0, 0, 1], [1, 0, 0, 0]], dtype=np.float32)
    assert unit_scores(units, q, "text", unit_vecs=unit_vecs) == pytest.approx(np.array([[0.0, 0.6]]))
    memory = [EvalUnit("a memory", [(frozenset(["t0"]), 2)])]
    with pytest.raises(ValueError, match="turn-based"):
        unit_scores(memory, q, "best_turn", turn_vecs=turn_vecs)
    with pytest.raises(ValueError, match="unknown scoring"):
        unit_scores(units, q, "max", turn_vecs=turn_vecs)


def test_memory_stats_flag_budgets_that_hold_every_memory():
    from qumem_pipeline.eval.locomo.harness import memory_stats

    lines = [("D1:1", "s1", "Caroline: " + "w " * 19), ("D1:2", "s1", "Melanie: " + "w " * 9)]
    mems = [EvalUnit("The user...", [(frozenset(["D1:1", "D1:2"]), 2)]), EvalUnit("x y z", [(frozenset(["D1:2"]), 3)])]
    st = memory_stats(mems, lines, (4, 5, 128))
    assert st == {"n_memories": 2, "total_words": 5, "mean_evidence_turns": 1.5, "turns_cited_by_any": 2,
                  "cited_turn_words_per_memory_word": (20 + 10 + 10) / 5, "budgets_holding_every_memory": [5, 128]}


def test_recall_at_top_units_ignores_cost():
    units = [U(("a", 500), ("b", 500)), U(("c", 1))]
    items = [QAItem("s", 1, "q", frozenset(["b", "c"]))]
    scores = np.array([[0.9, 0.1]])
    assert recall_at_units(units, scores, items, (1, 2)) == [{1: 0.5, 2: 1.0}]
    assert budgeted_recall(units, ["b", "c"], (128,)) == {128: 0.0}  # the same ranking under a budget


def _toy_locomo(n_sessions=3):
    conv = {"speaker_a": "Ann", "speaker_b": "Bo"}
    for s in range(1, n_sessions + 1):
        conv[f"session_{s}_date_time"] = f"1:00 pm on {s} May, 2023"
        conv[f"session_{s}"] = [{"speaker": "Ann" if i % 2 == 0 else "Bo", "dia_id": f"D{s}:{i + 1}",
                                 "text": f"session {s} turn {i + 1}"} for i in range(4)]
    qa = [{"question": "q1", "answer": "a", "evidence": ["D1:1"], "category": 1},
          {"question": "q2", "answer": "a", "evidence": ["D1:2", "D3:1"], "category": 2},
          {"question": "q3", "answer": "a", "evidence": ["D2:4"], "category": 4}]
    return [{"sample_id": "x-1", "conversation": conv, "qa": qa},
            {"sample_id": "x-2", "conversation": dict(conv), "qa": []}]


def test_slice_keeps_sessions_and_only_answerable_questions(tmp_path):
    src = tmp_path / "toy.json"
    src.write_text(json.dumps(_toy_locomo()))
    out, info = slice_locomo(str(src), tmp_path / "s", ["x-1"], max_sessions=2)
    data = json.loads(out.read_text())
    assert [d["sample_id"] for d in data] == ["x-1"]
    assert sorted(k for k in data[0]["conversation"] if k.startswith("session_") and k.count("_") == 1) == \
        ["session_1", "session_2"]
    assert [q["question"] for q in data[0]["qa"]] == ["q1", "q3"]  # q2 needs session 3
    assert info == {"conversations": ["x-1"], "max_sessions": 2, "qa_items_dropped_evidence_outside_slice": 1}
    with pytest.raises(ValueError, match="no conversation"):
        slice_locomo(str(src), tmp_path / "s", ["x-9"])
    with pytest.raises(ValueError, match="max-sessions"):
        slice_locomo(str(src), tmp_path / "s", None, max_sessions=0)


# ---------------------------------------------------------------------------------------- harness

N_SESSIONS = 4


@pytest.fixture(scope="module")
def slice_file(tmp_path_factory):
    if not DEV.is_file():
        pytest.skip(f"LoCoMo dev file {DEV} not found; set {ENV_VAR} to the shared datasets directory")
    data = json.loads(DEV.read_text())[:2]
    for sample in data:
        conv = sample["conversation"]
        for key in list(conv):
            m = re.match(r"^session_(\d+)(_date_time)?$", key)
            if m and int(m.group(1)) > N_SESSIONS:
                del conv[key]
        kept = []
        for q in sample["qa"]:
            ev = q.get("evidence") or []
            sess = [int(m.group(1)) for e in ev for m in [re.match(r"^D(\d+):\d+$", str(e))] if m]
            if sess and len(sess) == len(ev) and max(sess) <= N_SESSIONS:
                kept.append(q)
        sample["qa"] = kept
    p = tmp_path_factory.mktemp("locomo") / "locomo_slice2.json"
    p.write_text(json.dumps(data))
    return p, data


def _memories_for_first_conversation(data, tmp_path):
    """A stand-in memories table (one memory per speaker_a turn) for conversation 1 only."""
    from qumem_pipeline.ingest.importers.locomo import import_locomo
    from qumem_pipeline.ingest.validate import validate

    turns = validate(import_locomo(str(tmp_path / "locomo_slice2.json"))).turns
    sid = data[0]["sample_id"]
    a = turns.filter((pl.col("conversation_id") == sid) & (pl.col("role") == "user")).sort(["user_id", "turn_index"])
    first_user = a["user_id"][0]
    a = a.filter(pl.col("user_id") == first_user)
    mem = pl.DataFrame(
        {
            "memory_id": [f"m{i}" for i in range(a.height)],
            "user_id": a["user_id"],
            "type": ["fact"] * a.height,
            "content": a["text"],
            "episode_id": ["e"] * a.height,
            "evidence_turn_ids": [[t] for t in a["turn_index"].to_list()],
            "position": a["turn_index"],
        }
    )
    out = tmp_path / "memories" / f"user_id={first_user}"
    out.mkdir(parents=True, exist_ok=True)
    mem.write_parquet(out / "part-0.parquet")
    return tmp_path / "memories", mem


class StubClassifier:
    """Stands in for the continuity artifact when it is absent: a boundary every 5th user utterance."""

    threshold = 0.5
    version = "stub-continuity@0"

    def predict_same_proba(self, pairs, batch_size=64, progress=None):
        p = np.full(len(pairs), 0.9, dtype=np.float32)
        p[4::5] = 0.1
        return p


@pytest.mark.slow
def test_harness_on_two_conversation_slice(slice_file, monkeypatch):
    from qumem_pipeline.episodes.continuity import DEFAULT_ARTIFACT_DIR, ContinuityClassifier

    stubbed = not (DEFAULT_ARTIFACT_DIR / "config.json").is_file()
    if stubbed:  # still exercise the episodes path end to end
        monkeypatch.setattr(ContinuityClassifier, "load", classmethod(lambda cls, *a, **k: StubClassifier()))
    path, data = slice_file
    mem_dir, mem = _memories_for_first_conversation(data, path.parent)
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main([str(path), "--json", "--memories", str(mem_dir), "--window-sizes", "2,4",
                   "--units", "turns,fixed_chunks,sessions,episodes,memories", "--out", str(path.parent / "r.json")])
    assert rc == 0
    lines = buf.getvalue().strip().splitlines()
    report = json.loads(lines[-1])
    assert json.loads((path.parent / "r.json").read_text()) == report
    assert "overall (categories 1-4)" in buf.getvalue()

    assert report["n_conversations"] == 2
    n_items = sum(len(s["qa"]) for s in data)
    assert report["n_questions_with_adversarial"] + report["skipped"]["items_without_valid_evidence"] == n_items
    r = report["retrieval"]
    budgets = ["128", "256", "512", "1024"]
    for kind in ("turns", "sessions", "fixed_chunks"):
        vals = [r[kind][b] for b in budgets]
        assert all(0.0 <= v <= 1.0 for v in vals), kind
        assert vals == sorted(vals), f"{kind}: recall must not drop with a bigger budget"
    assert r["fixed_chunks"]["window_turns"] in (2, 4)
    assert set(r["fixed_chunks_by_size"]) == {"2", "4"}
    # ~4 sessions of ~20 turns: 1024 words reach most of the conversation
    assert r["turns"]["1024"] > r["turns"]["128"]
    assert r["sessions"]["1024"] >= 0.5
    # episodes from the continuity classifier (the stub when the artifact is absent)
    assert r["episodes"] is not None and report["units"]["episodes"]["n_units"] > 0
    assert report["continuity_classifier"] == (
        "stub-continuity@0" if stubbed else json.loads((DEFAULT_ARTIFACT_DIR / "config.json").read_text())["version"]
    )
    assert [r["episodes"][b] for b in budgets] == sorted(r["episodes"][b] for b in budgets)
    # memories: only the first conversation has them -> partial, with turns on the same items
    assert r["memories"] is not None and report["memories_subset_turns"] is not None
    assert "memories_partial" in report["skipped"]
    assert report["memories_n_memories"] == mem.height
    for c, blk in report["per_category"].items():
        assert blk["n"] > 0 and set(blk["turns"]) == set(budgets)
    wa = report["retrieval_with_adversarial"]["turns"]
    assert set(wa) == set(budgets)


@pytest.mark.slow
def test_unrequested_units_are_null_and_memories_decomposed_in_harness(tmp_path, monkeypatch):
    """A one-session slice with the product's episodes decomposed through a real (scripted) OpenAI-shaped server."""
    if not DEV.is_file():
        pytest.skip(f"LoCoMo dev file {DEV} not found; set {ENV_VAR} to the shared datasets directory")
    from qumem_pipeline.episodes.continuity import DEFAULT_ARTIFACT_DIR, ContinuityClassifier
    from qumem_pipeline.eval.locomo.harness import read_memories
    from fake_openai_server import RunningFakeServer

    if not (DEFAULT_ARTIFACT_DIR / "config.json").is_file():
        monkeypatch.setattr(ContinuityClassifier, "load", classmethod(lambda cls, *a, **k: StubClassifier()))
    hello = {"json": {"memories": [{"content": "Caroline greeted Melanie.", "evidence_turn_ids": [0]}]}}
    script = {"model": "fake-model", "rules": [{"match": "[0] Caroline (user): Hey Mel!", "responses": [hello]},
                                               {"match": "[0] Caroline (other): Hey Mel!", "responses": [hello]}]}
    with RunningFakeServer(script, tmp_path / "srv") as srv:
        monkeypatch.setenv("QUMEM_LLM_BASE_URL", srv.base_url)
        buf = io.StringIO()
        with redirect_stdout(buf):
            rc = main([str(DEV), "--json", "--conversations", "conv-26", "--max-sessions", "1",
                       "--units", "turns,episodes,memories", "--decompose", "--llm-kind", "openai",
                       "--memories-out", str(tmp_path / "data")])
    assert rc == 0
    report = json.loads(buf.getvalue().strip().splitlines()[-1])
    assert report["slice"]["conversations"] == ["conv-26"] and report["slice"]["max_sessions"] == 1
    assert report["n_conversations"] == 1 and report["n_questions"] == 4  # the four items with session-1 evidence
    assert report["units_requested"] == ["turns", "episodes", "memories"]
    for blk in [report["retrieval"], report["retrieval_with_adversarial"], *report["retrieval_by_scoring"].values(),
                *report["per_category"].values()]:
        assert set(UNIT_KINDS) <= set(blk)  # every unit key, always
        assert blk["fixed_chunks"] is None and blk["sessions"] is None  # not requested
        assert blk["turns"] is not None and blk["episodes"] is not None and blk["memories"] is not None
    assert report["decomposition"]["model"] == "fake-model" and report["memories_model"] == ["fake-model"]
    # one scripted memory per type for each speaker's first episode, written per user for reuse
    mem = read_memories(tmp_path / "data")
    assert mem.height == report["memories_n_memories"] == 6
    assert sorted(mem["user_id"].unique().to_list()) == ["conv-26-caroline", "conv-26-melanie"]
    assert mem["evidence_turn_ids"].to_list() == [[0]] * 6
    assert report["units"]["memories"]["mean_words"] == 3.0
    ms = report["memories_stats"]["conv-26"]
    assert ms["total_words"] == 18 and ms["turns_cited_by_any"] == 1 and ms["budgets_holding_every_memory"] == [128, 256, 512, 1024]
    assert "NOTE: every memory fits" in buf.getvalue()
    u = report["units"]["episodes"]
    assert u["mean_turns"] == pytest.approx(18 / u["n_units"], abs=0.01)  # session 1 has 18 turns


def test_harness_episodes_never_span_sessions(monkeypatch):
    """The harness's episodes are the product's, which start a new episode at every new session."""
    from datetime import datetime, timezone

    from qumem_pipeline.episodes.continuity import ContinuityClassifier
    from qumem_pipeline.eval.locomo.harness import build_episodes

    class AlwaysSame(StubClassifier):
        def predict_same_proba(self, pairs, batch_size=64, progress=None):
            return np.full(len(pairs), 0.9, dtype=np.float32)

    monkeypatch.setattr(ContinuityClassifier, "load", classmethod(lambda cls, *a, **k: AlwaysSame()))
    conv = _toy_conversation()
    conv.turns = conv.turns.with_columns(user_id=pl.lit("c-caroline"),
                                         timestamp=pl.lit(datetime(2023, 5, 1, tzinfo=timezone.utc)))
    split, _ = build_episodes([conv])  # the classifier says "same event" throughout
    assert split["c-caroline"]["turn_ids"].to_list() == [[0, 1, 2, 3], [4, 5]]
    assert split["c-caroline"]["episode_index"].to_list() == [0, 1]
    assert [u.turn_rows for u in episode_units(conv, split["c-caroline"])] == [(0, 1, 2, 3), (4, 5)]


def test_matched_windows_copy_episode_count_per_session_not_boundaries():
    """The control for episode boundaries: per session, as many equal windows as episodes there."""
    from qumem_pipeline.eval.locomo.harness import matched_window_units

    conv = _toy_conversation()
    # session 1 holds two episodes of uneven size (1 + 3 turns), session 2 one episode
    eps = pl.DataFrame({"episode_index": [0, 1, 2], "turn_ids": [[0], [1, 2, 3], [4, 5]]})
    ctrl = matched_window_units(conv, eps)
    assert [u.turn_rows for u in ctrl] == [(0, 1), (2, 3), (4, 5)]
    assert len(ctrl) == len(episode_units(conv, eps))
    assert sum(u.words for u in ctrl) == sum(u.words for u in episode_units(conv, eps))
    assert matched_window_units(conv, None) == []
