"""LoCoMo harness with --strategies: three strategies in one run, one table, equal budgets
(a one-conversation, four-session slice of the shared dev file; skipped when it is absent)."""

import io
import json
import re
from contextlib import redirect_stdout

import pytest

from qumem_pipeline.runtime.datasets import ENV_VAR, shared_datasets_dir
from qumem_pipeline.eval.locomo.harness import main

DEV = shared_datasets_dir() / "locomo" / "locomo_dev5.json"
BUDGETS = ["128", "256", "512", "1024"]


@pytest.fixture(scope="module")
def slice_file(tmp_path_factory):
    if not DEV.is_file():
        pytest.skip(f"LoCoMo dev file {DEV} not found; set {ENV_VAR} to the shared datasets directory")
    sample = json.loads(DEV.read_text())[0]
    conv = sample["conversation"]
    for key in list(conv):
        m = re.match(r"^session_(\d+)(_date_time)?$", key)
        if m and int(m.group(1)) > 4:
            del conv[key]
    sample["qa"] = [q for q in sample["qa"] if q.get("evidence") and all(
        (m := re.match(r"^D(\d+):\d+$", str(e))) and int(m.group(1)) <= 4 for e in q["evidence"])]
    p = tmp_path_factory.mktemp("locomo") / "slice.json"
    p.write_text(json.dumps([sample]))
    return p


def test_three_strategies_side_by_side(slice_file):
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main([str(slice_file), "--json", "--units", "turns", "--strategies", "qumem,adamem,topk"]) == 0
    out = buf.getvalue()
    report = json.loads(out.strip().splitlines()[-1])
    r = report["retrieval"]
    assert list(r["strategies"]) == ["qumem", "adamem", "topk"]
    assert r["strategies"]["qumem"] is None and "needs an LLM" in report["skipped"]["strategy_qumem"]
    # without a memories table the top-k baseline ranks turns by dense similarity: the turns row exactly
    assert r["strategies"]["topk"] == r["turns"]
    ada = [r["strategies"]["adamem"][b] for b in BUDGETS]
    assert all(0.0 <= v <= 1.0 for v in ada) and ada == sorted(ada)
    for blk in report["per_category"].values():
        assert set(blk["strategies"]["adamem"]) == set(BUDGETS)
    assert "strategy adamem" in out and "strategy topk" in out


def test_unknown_strategy_is_refused(tmp_path):
    """Argument validation needs no dataset: a one-session LoCoMo-format file (as in test_qumem_harness.py)."""
    conv = {"speaker_a": "Ann", "speaker_b": "Bo", "session_1_date_time": "1:00 pm on 1 May, 2023",
            "session_1": [{"speaker": "Ann", "dia_id": "D1:1", "text": "I adopted a puppy named Rex."},
                          {"speaker": "Bo", "dia_id": "D1:2", "text": "How is he settling in?"}]}
    toy = tmp_path / "toy_locomo.json"
    toy.write_text(json.dumps([{"sample_id": "toy-1", "conversation": conv, "qa": [
        {"question": "What is the puppy's name?", "answer": "Rex", "evidence": ["D1:1"], "category": 1}]}]))
    with pytest.raises(ValueError, match="unknown strategies"):
        main([str(toy), "--units", "turns", "--strategies", "adamem,bogus"])
