"""The evaluation command: inline edge-case file (segments format) and a slice of real TIAGE test."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from qumem_pipeline.runtime.datasets import missing_reason, tiage_dir
from qumem_pipeline.eval.segmentation import run_segmentation_eval
from qumem_pipeline.eval.segmentation.baselines import depth_scores, fixed_window, texttiling_from_embeddings


@pytest.fixture(scope="module")
def clf():
    from qumem_pipeline.episodes.continuity import ContinuityClassifier

    return ContinuityClassifier.load(device="cpu")


def _last_json(capsys):
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def _check_shape(res):
    assert set(res) >= {"dataset", "n_dialogues", "classifier", "baselines"}
    assert set(res["classifier"]) >= {"pk", "windowdiff", "f1"}
    assert {"fixed_window_4", "texttiling_minilm", "all_continue", "random_0.2"} <= set(res["baselines"])


def test_baseline_helpers():
    assert fixed_window(9) == [0, 0, 0, 1, 0, 0, 0, 1]
    assert fixed_window(1) == []
    assert list(depth_scores([0.9, 0.2, 0.8])) == pytest.approx([0.0, 1.3, 0.0])
    import numpy as np

    e = np.array([[1, 0], [1, 0], [1, 0], [0, 1], [0, 1], [0, 1]], dtype=np.float32)
    assert texttiling_from_embeddings(e, window=2) == [0, 0, 1, 0, 0]
    assert texttiling_from_embeddings(e[:1]) == []


def test_eval_edge_cases_segments_format(tmp_path, capsys, clf):
    data = [
        {"dial_id": "a", "utterances": ["i like dogs", "my dog is a poodle", "what is your job ?", "i teach"], "segments": [2, 2]},
        {"dial_id": "b", "utterances": ["alone"], "segments": [1]},
        {"dial_id": "c", "utterances": ["", "", ""], "segments": [3]},
        {"dial_id": "d", "utterances": [], "segments": []},
    ]
    p = tmp_path / "edge.json"
    p.write_text(json.dumps(data))
    res = run_segmentation_eval(str(p), None, as_json=True, classifier=clf)
    assert _last_json(capsys) == json.loads(json.dumps(res))
    _check_shape(res)
    assert res["format"] == "segments" and res["n_dialogues"] == 4
    assert res["n_dialogues_skipped_pk"] == 2


@pytest.mark.skipif(not (tiage_dir() / "anno_test.json").is_file(), reason=missing_reason(tiage_dir() / "anno_test.json"))
def test_eval_tiage_slice_both_formats(tmp_path, capsys, clf):
    anno = json.loads((tiage_dir() / "anno_test.json").read_text())
    keys = list(anno)[:8]
    p1 = tmp_path / "slice_anno.json"
    p1.write_text(json.dumps({k: anno[k] for k in keys}))
    r1 = run_segmentation_eval(str(p1), "tiage", as_json=True, classifier=clf)
    _check_shape(_last_json(capsys))
    assert r1["n_dialogues"] == 8 and r1["format"] == "tiage"

    segs = json.loads((tiage_dir() / "tiage_test_segments.json").read_text())
    p2 = tmp_path / "slice_segments.json"
    p2.write_text(json.dumps([s for s in segs if str(s["dial_id"]) in keys]))
    r2 = run_segmentation_eval(str(p2), None, as_json=True, classifier=clf)
    capsys.readouterr()
    # the two files hold the same dialogues: identical scores
    assert r2["classifier"] == r1["classifier"]
    assert r2["baselines"]["fixed_window_4"] == r1["baselines"]["fixed_window_4"]


def test_module_cli_help():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "qumem_pipeline.eval.segmentation", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--format" in out.stdout


def test_eval_applies_the_classifiers_decision_rule(clf):
    """The command turns P(same) into boundaries with the artifact's rule, per dialogue — the same
    rule object the episodes stage applies."""
    import copy

    import numpy as np

    from qumem_pipeline.episodes.continuity.decoding import DecisionRule
    from qumem_pipeline.eval.segmentation.evaluate import classifier_boundaries
    from qumem_pipeline.episodes.dialogues import Dialogue

    texts = ["i adopted a puppy", "she is a golden retriever", "what is your job ?", "i teach maths",
             "do you like jazz ?", "i play the saxophone"]
    dialogues = [Dialogue("x", texts, [0, 1, 0, 1, 0]), Dialogue("y", texts[::-1], [0, 1, 0, 1, 0]),
                 Dialogue("z", ["alone"], [])]
    per_dialogue = [clf.predict_same_proba(list(zip(d.utterances, d.utterances[1:]))) for d in dialogues]
    # every gap a boundary vs at most one boundary per 6 utterances: the rule must show in the output
    rules = [DecisionRule(1.0), DecisionRule(1.0, min_segment=6)]
    outs = []
    for rule in rules:
        c = copy.copy(clf)
        c.rule = rule
        got = classifier_boundaries(dialogues, c, batch_size=4)
        assert got == [rule.boundaries(p).tolist() for p in per_dialogue]
        outs.append(got)
    assert outs[0] == [[1] * 5, [1] * 5, []]
    assert [sum(h) for h in outs[1]] == [1, 1, 0]
    # the committed artifact's own rule is what the command reports
    assert clf.rule == DecisionRule.from_config(clf.config)
    assert np.isclose(clf.threshold, clf.rule.threshold)
