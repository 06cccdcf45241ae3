"""PersonaMem: the importer (both layouts), the question loader and split, the as-of cut, and a whole
evaluation recorded with the embedded model then replayed from the record with no model."""

import json

import polars as pl
import pytest

from qumem_pipeline.eval.personamem.data import load, parse_correct, parse_options, split_of, up_to
from qumem_pipeline.ingest.importers import detect_format, import_archive
from qumem_pipeline.ingest.importers.personamem import import_personamem, user_id_for
from qumem_pipeline.runtime.datasets import ENV_VAR, shared_datasets_dir

PM = shared_datasets_dir() / "personamem"
needs_data = pytest.mark.skipif(not (PM / "questions_128k.csv").exists(),
                                reason=f"PersonaMem files not at {PM} (set {ENV_VAR})")

OPTIONS = ["(a) Try a jazz workshop, like the one you loved.", "(b) Go hiking in the mountains.",
           "(c) Take up competitive chess.", "(d) Learn to bake sourdough bread."]


def _shared(tmp_path, broken_line=False):
    msgs = [{"role": "system", "content": "Current user persona: Ana, a nurse who loves jazz."},
            {"role": "user", "content": "Patient: I went to a jazz workshop and loved improvising."},
            {"role": "assistant", "content": "Therapist: That sounds freeing."},
            {"role": "user", "content": "How do I reverse a list in Python?"},
            {"role": "assistant", "content": "Use reversed() or slicing."},
            {"role": "system", "content": "Current user persona: Ana."},
            {"role": "user", "content": "User: Lately I prefer quiet evenings to loud concerts."},
            {"role": "assistant", "content": "Assistant: Quiet evenings can be restful."}]
    lines = [json.dumps({"ctxA" * 5: msgs}), json.dumps({"ctxB" * 5: msgs[:4]})]
    if broken_line:
        lines.insert(1, "{not json")
    p = tmp_path / "shared_contexts_test.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def _questions(tmp_path, rows):
    import csv

    p = tmp_path / "questions_test.csv"
    with open(p, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return p


def test_shared_layout_one_user_per_context_sessions_at_system_messages_roles_from_speaker_marks(tmp_path):
    p = _shared(tmp_path)
    assert detect_format(p) == "personamem"
    res = import_archive(p)
    assert not res.failures
    a = res.raw.filter(pl.col("user_id") == user_id_for("ctxA" * 5)).sort("turn_index")
    assert a["turn_index"].to_list() == list(range(8))
    assert a["role"].to_list() == ["other", "user", "assistant", "user", "assistant", "other", "user", "assistant"]
    assert a["speaker"].to_list()[:3] == ["system", "Patient", "Therapist"]
    assert a["text"][1] == "I went to a jazz workshop and loved improvising."  # the mark is the speaker, not text
    assert a["session_id"].to_list() == ["session-0"] * 5 + ["session-1"] * 3
    assert a["text"][3] == "How do I reverse a list in Python?"  # filler kept
    assert res.raw["user_id"].n_unique() == 2


def test_a_broken_line_is_a_failure_naming_its_row_and_the_rest_is_kept(tmp_path):
    res = import_personamem(str(_shared(tmp_path, broken_line=True)))
    assert [(f.source_row, f.field) for f in res.failures] == [(2, "(line)")]
    assert res.raw["user_id"].n_unique() == 2 and res.raw.height == 12


def test_per_question_layout_with_speakers_marked_in_the_text(tmp_path):
    ctx = {"q-1": [{"role": "user", "content": "Patient: I started painting again."},
                   {"role": "user", "content": "Therapist: How does it feel?"},
                   {"role": "user", "content": "Patient: Calm. I now prefer watercolors to oils."}],
           "q-2": [{"role": "user", "content": "Patient: I run every morning."}, {"role": "user", "content": 7}]}
    (tmp_path / "contexts.json").write_text(json.dumps(ctx))
    res = import_personamem(str(tmp_path / "contexts.json"))
    assert [(f.source_row, f.field) for f in res.failures] == [(2, "q-2[1]")]
    q1 = res.raw.filter(pl.col("user_id") == user_id_for("q-1"))
    assert q1["role"].to_list() == ["user", "assistant", "user"]
    with pytest.raises(ValueError, match=r"row 2 field q-2\[1\]"):  # no evaluation over a partial context
        load(tmp_path / "contexts.json", tmp_path / "none.csv")
    del ctx["q-2"]
    (tmp_path / "contexts.json").write_text(json.dumps(ctx))
    qs = _questions(tmp_path, [
        {"question_id": "q-1", "question_type": "recalling_the_latest_user_preferences", "topic": "art",
         "context_length": "30", "distance_to_ref_in_blocks": "1", "distance_to_ref_in_tokens": "10",
         "question": "What should I paint with?", "correct_answer": "(b)",
         "all_options": repr(["(a) Oils, as always.", "(b) Watercolors.", "(c) Charcoal.", "(d) Acrylics."])}])
    data = load(tmp_path / "contexts.json", qs)
    q = data.questions[0]
    assert q.options[1] == "Watercolors." and q.correct == 1 and q.as_of == 2  # asked after its last message


def test_loader_refuses_a_bad_question_row_naming_its_line(tmp_path):
    p = _shared(tmp_path)
    qs = _questions(tmp_path, [
        {"question_id": "x1", "question_type": "t", "topic": "", "question": "Q?", "correct_answer": "(e)",
         "all_options": repr(OPTIONS), "shared_context_id": "ctxA" * 5, "end_index_in_shared_context": "4"}])
    with pytest.raises(ValueError, match=r"line 2 \(question_id x1\).*correct_answer"):
        load(p, qs)


def test_questions_are_asked_as_of_their_end_index_and_see_nothing_after(tmp_path):
    p = _shared(tmp_path)
    qs = _questions(tmp_path, [
        {"question_id": "x1", "question_type": "t", "topic": "", "question": "Any plans tonight?",
         "correct_answer": "(a)", "all_options": repr(OPTIONS), "shared_context_id": "ctxA" * 5,
         "end_index_in_shared_context": "4"}])
    data = load(p, qs)
    q = data.questions[0]
    assert q.as_of == 4 and q.options[0].startswith("Try a jazz") and q.correct == 0
    conv = next(c for c in data.conversations if c.sample_id == q.sample_id)
    cut = up_to(conv, q.as_of)
    assert cut.turns["turn_index"].max() == 4 and "quiet evenings" not in " ".join(cut.turns["text"].to_list())


def test_split_is_by_question_text_stable_and_about_half():
    texts = [f"question number {i}?" for i in range(400)]
    splits = [split_of(t) for t in texts]
    assert splits == [split_of(t) for t in texts] and 150 < splits.count("dev") < 250
    assert split_of("  same text ") == split_of("same text")


def test_option_and_answer_cells():
    assert parse_options(repr(OPTIONS))[2] == "Take up competitive chess."
    assert parse_correct("(c)") == 2 and parse_correct("d") == 3
    with pytest.raises(ValueError):
        parse_options(repr(OPTIONS[:3]))


@needs_data
def test_the_128k_release_imports_whole():
    res = import_archive(PM / "shared_contexts_128k.jsonl")
    assert not res.failures and res.raw.height == 698 + 718 and res.raw["user_id"].n_unique() == 2
    data = load(PM / "shared_contexts_128k.jsonl", PM / "questions_128k.csv")
    assert data.info["questions"] == 270 and data.info["distinct_questions"] == 131
    assert data.info["quarantined_turns"] == 0
    # the same question text lands in the same split in both contexts
    by_text: dict = {}
    for q in data.questions:
        by_text.setdefault(q.question, set()).add(q.split)
    assert all(len(v) == 1 for v in by_text.values())


def test_an_evaluation_recorded_with_the_embedded_model_replays_with_no_model(tmp_path, capsys):
    """A real run (SmolLM2, in-process) of two cheap strategies on a small context records every call; the
    replay answers from the record alone and gives the same figures."""
    from qumem_pipeline.eval.personamem.run import main

    p = _shared(tmp_path)
    qs = _questions(tmp_path, [
        {"question_id": f"x{i}", "question_type": t, "topic": "", "question": q, "correct_answer": "(a)",
         "all_options": repr(OPTIONS), "shared_context_id": "ctxA" * 5, "end_index_in_shared_context": "7"}
        for i, (t, q) in enumerate([("recalling_facts", "What workshop did I go to?"),
                                    ("recommendation", "What should I do this weekend?")])])
    rec = tmp_path / "record"
    common = ["--contexts", str(p), "--questions", str(qs), "--strategies", "none,topk_turns", "--methods", "choice",
              "--record", str(rec), "--json"]
    assert main([str(tmp_path), *common, "--llm-kind", "local", "--out", str(tmp_path / "live.json")]) == 0
    live = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert live["n_questions"] == 2 and set(live["accuracy"]) == {"none", "topk_turns"}
    assert live["record"]["appended"] == 4  # 2 strategies x 2 questions, each call kept
    assert main([str(tmp_path), *common, "--replay-only"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["replay"]["missing"]["calls"] == 0 and again["replay"]["calls_replayed"] == 4
    assert again["accuracy"] == live["accuracy"] and again["vs_topk_turns"] == live["vs_topk_turns"]


def test_report_over_two_contexts_resamples_each_question_once():
    """The same question asked of two contexts is one cluster in the interval; within one context the
    report resamples rows, as the record's single-context tables were measured."""
    from types import SimpleNamespace

    from qumem_pipeline.eval.personamem.data import PMQuestion
    from qumem_pipeline.eval.personamem.run import build_report

    def q(i, ctx):
        return PMQuestion(f"{ctx}-{i}", f"{ctx}-{i}", ctx, "t", "topic", f"question {i}", tuple(OPTIONS), 0, 9, "test")

    def runs(ctxs):
        qs = [q(i, c) for c in ctxs for i in range(30)]
        done = {}
        for x in qs:
            i = int(x.key.rsplit("-", 1)[1])
            done[("topk_turns", x.key)] = {"choice": 0 if i % 2 else 1, "correct": 0, "likelihood_scores": None}
            done[("adamem", x.key)] = {"choice": 0 if i % 3 else 1, "correct": 0, "likelihood_scores": None}
        r = SimpleNamespace(data=SimpleNamespace(info={}), skipped={}, _backend=None, scorer=None, replay_only=False)
        return build_report(qs, ["topk_turns", "adamem"], ["choice"], done, r)

    one, two = runs(["pm-a"]), runs(["pm-a", "pm-b"])
    assert one["ci_resampling"] == "question" and "clusters" not in one["vs_topk_turns"]["adamem"]
    assert two["ci_resampling"] == "question text (clusters)"
    v1, v2 = one["vs_topk_turns"]["adamem"], two["vs_topk_turns"]["adamem"]
    assert v2["n"] == 60 and v2["clusters"] == 30 and v1["delta"] == v2["delta"]
    w1, w2 = v1["ci95"][1] - v1["ci95"][0], v2["ci95"][1] - v2["ci95"][0]
    assert abs(w2 - w1) < 0.2 * w1  # the second context's copies add no independent evidence
    # question by question (correct is 0): top-k right on odd i, adamem where i % 3 != 0
    odd, third = {i for i in range(30) if i % 2}, {i for i in range(30) if i % 3}
    assert one["agreement_vs_topk_turns"]["adamem"] == {
        "both": len(odd & third), "neither": 30 - len(odd | third), "only_topk_turns": len(odd - third),
        "only_adamem": len(third - odd)}
