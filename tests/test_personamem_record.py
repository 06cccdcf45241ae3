"""The published PersonaMem table (docs/evaluation.md#personamem) regenerated from eval_record/ alone, with no
model: every figure equal to its committed JSON, each comparison with its n and interval. System tier: the
replay decomposes the context again from the record and embeds its memories (minutes on two cores)."""

import json

import pytest

from qumem_pipeline.eval.record import REPO_ROOT, EvalRecord
from qumem_pipeline.runtime.datasets import ENV_VAR, shared_datasets_dir

RECORD_ROOT = REPO_ROOT / "eval_record"
# the dev half (every strategy: where the change was chosen) and the test half (the served default, its baseline and
# the dev leader: where it was confirmed)
TABLES = {"personamem_qwen15b_ctx1_dev": {"none", "topk_turns", "qumem", "adamem", "qumem_hybrid"},
          "personamem_qwen15b_ctx1_test": {"topk_turns", "adamem", "qumem_hybrid"},
          # the second answer method: each option's log-likelihood as the reply (the record holds the scores)
          "personamem_qwen15b_ctx1_dev_likelihood": {"none", "topk_turns", "adamem"},
          # the state in front of the question's top-k turns: chosen on dev, not confirmed on test
          "personamem_qwen15b_ctx1_dev_state_turns": {"topk_turns", "adamem", "adamem_turns"},
          "personamem_qwen15b_ctx1_test_state_turns": {"topk_turns", "adamem", "adamem_turns"},
          # both contexts of the release: the test halves (the goal's measurement) and everything, intervals
          # resampling question texts (each question is asked of both contexts)
          "personamem_qwen15b_ctx12_test": {"none", "topk_turns", "adamem", "adamem_turns"},
          "personamem_qwen15b_ctx12": {"none", "topk_turns", "adamem", "adamem_turns"}}
PM = shared_datasets_dir() / "personamem"


@pytest.mark.skipif(not (PM / "questions_128k.csv").exists(), reason=f"PersonaMem files not at {PM} (set {ENV_VAR})")
@pytest.mark.parametrize("table", sorted(TABLES))
def test_the_personamem_table_replays_from_the_record_with_no_model(monkeypatch, capsys, table):
    from qumem_pipeline.eval.record_cli import check

    TABLE = table
    monkeypatch.setenv("QUMEM_LLM_KIND", "no-such-backend")  # any model start would fail loudly
    path = RECORD_ROOT / "tables" / f"{TABLE}.json"
    assert path.is_file(), f"{path} not committed"
    rc = check(EvalRecord(RECORD_ROOT), [TABLE], as_json=True)
    out = capsys.readouterr().out
    assert rc == 0 and json.loads(out.strip().splitlines()[-1]) == {"tables": {TABLE: "same"}, "rc": 0}, out
    fig = json.loads(path.read_text())["figures"]
    assert fig["replayed"]["missing_calls"] == 0 and fig["n_questions"] > 0
    assert TABLES[table] <= set(fig["accuracy"])
    split = "dev" if "_dev" in table else "test" if "_test" in table else None
    assert set(fig["splits"]) == {"dev", "test"}
    assert (fig["splits"][split] if split else sum(fig["splits"].values())) == fig["n_questions"]
    if "ctx12" in table:  # two contexts: one cluster per question text, fewer clusters than rows
        assert all(v["clusters"] == fig["distinct_questions"] < v["n"] for v in fig["vs_topk_turns"].values())
    if "likelihood" in table:  # every option score replayed from the record, none missing
        assert TABLES[table] <= set(fig["accuracy_likelihood"])
        assert fig["likelihood_calls"]["missing"] == 0 and fig["likelihood_calls"]["replayed"] > 0
        assert all(fig["n_scored_likelihood"][s] == fig["n_questions"] for s in TABLES[table])
    for s, v in fig["vs_topk_turns"].items():
        assert 0 < v["n"] <= fig["n_scored"][s] and v["ci95"][0] <= v["delta"] <= v["ci95"][1], s
