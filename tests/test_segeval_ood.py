"""The out-of-domain segmentation set (LoCoMo excerpts joined at known boundaries) and the
side-by-side TIAGE / OOD evaluation."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

from qumem_pipeline.episodes.dialogues import parse_segments
from qumem_pipeline.episodes.continuity import ood_data as ood
from qumem_pipeline.runtime.datasets import missing_reason, tiage_dir


def _locomo_file(tmp_path, n_conv=3, n_sess=4, n_turns=13):
    """A LoCoMo-format file whose turn texts name where they come from (conv, session, turn)."""
    data = []
    for c in range(n_conv):
        conv = {"speaker_a": "A", "speaker_b": "B"}
        for s in range(1, n_sess + 1):
            conv[f"session_{s}_date_time"] = "1:00 pm on 1 May, 2023"
            conv[f"session_{s}"] = [{"speaker": "AB"[t % 2], "dia_id": f"D{s}:{t + 1}", "text": f"c{c} s{s} t{t}"}
                                    for t in range(n_turns + s)]
        conv[f"session_{n_sess + 1}_date_time"] = "no turns for this one"  # a date with no session list
        data.append({"sample_id": f"conv-{c}", "conversation": conv, "qa": []})
    p = tmp_path / "locomo.json"
    p.write_text(json.dumps(data))
    return p


def _origin(text):
    c, s, t = text.split()
    return c, int(s[1:]), int(t[1:])


def test_build_is_deterministic_and_seeded(tmp_path):
    p = _locomo_file(tmp_path)
    a, b = ood.build_ood(p, seed=0), ood.build_ood(p, seed=0)
    assert a == b
    assert ood.build_ood(p, seed=1) != a


def test_joins_are_known_boundaries_between_conversations(tmp_path):
    p = _locomo_file(tmp_path)
    built = ood.build_ood(p, seed=3)
    used: dict[str, set] = {s: set() for s in ood.SPLITS}
    for split, records in built.items():
        assert records, split
        dialogues = parse_segments(records).dialogues  # the evaluation's own reader accepts it
        for rec, d in zip(records, dialogues):
            assert sum(rec["segments"]) == len(rec["utterances"])
            assert 2 <= len(rec["segments"]) <= ood.CHUNKS_PER_DIALOGUE[1]
            pos = 0
            convs = []
            for length, src in zip(rec["segments"], rec["sources"]):
                part = [_origin(t) for t in rec["utterances"][pos : pos + length]]
                conv, sess, start = src.rsplit(":", 2)
                # one contiguous excerpt of one session, starting where ``sources`` says
                assert part == [(conv.replace("conv-", "c"), int(sess[1:]), int(start) + i) for i in range(length)]
                assert length >= ood.CHUNK_LEN[0]
                convs.append(conv)
                for o in part:
                    assert o not in used["calib"] | used["eval"], f"turn {o} used twice"
                used[split].update(part)
                pos += length
            assert all(x != y for x, y in zip(convs, convs[1:])), "consecutive excerpts share a conversation"
            # the reference boundary is exactly each join
            joins = list(np.cumsum(rec["segments"])[:-1] - 1)
            assert [i for i, b in enumerate(d.boundaries) if b] == joins
    sessions = {s: {(c, ss) for c, ss, _ in used[s]} for s in ood.SPLITS}
    assert not sessions["calib"] & sessions["eval"], "a session feeds both splits"


def test_bad_input_is_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"sample_id": "conv-x"}]))
    with pytest.raises(ValueError, match="conv-x"):
        ood.build_ood(bad)
    with pytest.raises(FileNotFoundError, match="LoCoMo"):
        ood.build_ood(tmp_path / "absent.json")
    with pytest.raises(ValueError, match="split"):
        ood.ood_dialogues("test", path=_locomo_file(tmp_path))


def test_cli_writes_segments_file(tmp_path, capsys):
    p = _locomo_file(tmp_path)
    out = tmp_path / "o" / "ood_eval.json"
    assert ood.main(["--locomo", str(p), "--out", str(out), "--split", "eval"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    records = json.loads(out.read_text())
    assert records == ood.build_ood(p)["eval"]
    assert stats["n_dialogues"] == len(records) and stats["builder"] == ood.BUILDER_VERSION
    assert stats["n_boundaries"] == sum(len(r["segments"]) - 1 for r in records)


@pytest.mark.skipif(not ood.locomo_dev_path().is_file(), reason=missing_reason(ood.locomo_dev_path()))
def test_real_locomo_set_size():
    built = ood.build_ood()
    for split in ood.SPLITS:
        s = ood.describe(built[split])
        assert s["n_dialogues"] >= 30 and s["n_boundaries"] >= 100, s
        assert 5.0 <= s["mean_segment_len"] <= 9.0, s


@pytest.mark.skipif(not (tiage_dir() / "anno_test.json").is_file() or not ood.locomo_dev_path().is_file(),
                    reason=missing_reason(tiage_dir() / "anno_test.json"))
def test_side_by_side_on_slices(capsys):
    """Real classifier and real MiniLM on small slices of both sets; JSON last; rows agree with the
    single-file evaluation."""
    from qumem_pipeline.episodes.continuity import ContinuityClassifier
    from qumem_pipeline.episodes.continuity.data import load_tiage
    from qumem_pipeline.episodes.metrics import evaluate
    from qumem_pipeline.eval.segmentation import robustness as rb
    from qumem_pipeline.eval.segmentation.evaluate import classifier_boundaries

    clf = ContinuityClassifier.load(device="cpu")
    sets = {"tiage_test": load_tiage("test")[:6], "ood_eval": ood.ood_dialogues("eval")[:3]}
    res = rb.run(as_json=True, sets=sets, dev=load_tiage("dev")[:12], classifiers={"classifier": clf},
                 sim_dip=True, calib=ood.ood_dialogues("calib")[:3], learned=True)
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1]) == json.loads(json.dumps(res))
    assert any(line.startswith("minilm_adjacent_sim") for line in out)
    rechosen = res["classifiers"]["classifier"]["sim_dip_rechosen"]
    assert "kept" in rechosen or rechosen["dev_pk"] <= rechosen["dev_pk_without_dips"]
    assert res["classifiers"]["classifier"]["version"] == clf.version
    assert clf.rule.needs_similarity, "the committed artifact ships the similarity dips"
    learned = res["classifiers"]["classifier"]["learned_rechosen"]
    assert learned["rule"]["rule"] == "learned-logistic-v1" and learned["equals_shipped_rule"] is False
    assert set(learned["cv_pk"]) == {"tiage_dev", "calib0"} and learned["n_candidates"] == 18
    assert any(line.startswith("classifier+learned(rechosen): boundary when a logistic score") for line in out)
    assert set(res["systems"]) == {"classifier", "classifier/no_sim_dip", "classifier+sim_dip(rechosen)",
                                   "classifier+learned(rechosen)", "minilm_adjacent_sim", "texttiling_minilm",
                                   "fixed_window_4", "all_continue", "random_0.2"}
    for system, by_set in res["systems"].items():
        assert set(by_set) == set(sets), system
        for s in by_set.values():
            assert 0.0 <= s["pk"] <= 1.0 and 0.0 <= s["f1"] <= 1.0
    for name, ds in sets.items():
        # the `classifier` row is the episodes stage's rule: the classifier's predict_boundaries per dialogue
        shipped = [clf.predict_boundaries([(d.utterances[i], d.utterances[i + 1]) for i in range(len(d.utterances) - 1)])
                   for d in ds]
        assert res["systems"]["classifier"][name]["pk"] == round(evaluate([d.boundaries for d in ds], shipped).pk, 4)
        # the reference row is the classifier's decision alone, as the single-file evaluation scores it
        alone = evaluate([d.boundaries for d in ds], [clf.rule.without_similarity().boundaries(
            clf.predict_same_proba([(d.utterances[i], d.utterances[i + 1]) for i in range(len(d.utterances) - 1)]))
            for d in ds])
        assert res["systems"]["classifier/no_sim_dip"][name]["pk"] == round(alone.pk, 4)
    assert res["systems"]["all_continue"]["ood_eval"]["f1"] == 0.0
    assert 0.0 <= res["minilm_adjacent_sim_threshold"] <= 0.9


def test_sim_threshold_is_chosen_by_pk():
    from qumem_pipeline.episodes.dialogues import Dialogue
    from qumem_pipeline.eval.segmentation.robustness import choose_sim_threshold

    ds = [Dialogue("a", list("abcdef"), [0, 0, 1, 0, 0]), Dialogue("b", list("abcde"), [0, 1, 0, 0])]
    sims = [np.array([0.8, 0.7, 0.305, 0.9, 0.75]), np.array([0.6, 0.2, 0.65, 0.7])]
    t = choose_sim_threshold(sims, ds)
    assert 0.305 < t <= 0.6  # separates both boundaries from every continuation
    assert [list((s < t).astype(int)) for s in sims] == [d.boundaries for d in ds]


def test_training_dialogues_come_from_calib_sessions_only_and_join_differently(tmp_path):
    """The classifier may train on `build_ood_train`: every turn of it is from a calib session (never
    eval's), its excerpts and joins differ from calib's, and the calib/eval halves are unchanged."""
    p = _locomo_file(tmp_path)
    built = ood.build_ood(p, seed=3)
    train = ood.build_ood_train(p, seed=3, rejoin_seed=1)
    assert train == ood.build_ood_train(p, seed=3, rejoin_seed=1) and train != ood.build_ood_train(p, seed=3, rejoin_seed=2)
    sessions = {split: {_origin(t)[:2] for r in recs for t in r["utterances"]} for split, recs in built.items()}
    train_sessions = {_origin(t)[:2] for r in train for t in r["utterances"]}
    assert train_sessions and train_sessions <= sessions["calib"] and not train_sessions & sessions["eval"]
    assert {tuple(r["sources"]) for r in train}.isdisjoint({tuple(r["sources"]) for r in built["calib"]})
    assert all(r["dial_id"].startswith("ood-train-") for r in train)
    assert parse_segments(train).dialogues  # the training reader takes it


def test_generated_training_dialogues_use_calib_domains_only():
    from qumem_pipeline.episodes.continuity import generated_dialogues as gen

    built = gen.build_generated(seed=0)
    train = gen.build_generated_train(seed=0, instance_seed=1)
    calib = {d for r in built["calib"] for d in r["sources"]}
    evald = {d for r in built["eval"] for d in r["sources"]}
    used = {d for r in train for d in r["sources"]}
    assert used <= calib and not used & evald
    assert train == gen.build_generated_train(seed=0, instance_seed=1)
    assert [r["utterances"] for r in train] != [r["utterances"] for r in built["calib"]]  # other instances


def test_mixed_training_pairs_add_other_domains_to_tiage(tmp_path, monkeypatch):
    from qumem_pipeline.episodes.continuity import generated_dialogues as gen
    from qumem_pipeline.episodes.continuity.train import mixed_pairs

    monkeypatch.setattr(ood, "locomo_dev_path", lambda: _locomo_file(tmp_path))
    o, g = mixed_pairs(("ood",)), mixed_pairs(("gen",))
    assert len(mixed_pairs(("ood", "gen"))) == len(o) + len(g) and o and g
    n_bnd = sum(len(r["segments"]) - 1 for r in gen.build_generated_train())
    assert sum(1 - p.same for p in g) == n_bnd  # every join is a "new event" pair, nothing else is
    with pytest.raises(ValueError, match="unknown training domains"):
        mixed_pairs(("multiwoz",))
