"""What a learned decision rule gains out of domain, with and without block-similarity features.

    python bench/segmentation_learned_features.py [--cache /tmp/seg_signals.pkl] [--json]

Per set (TIAGE train/dev/test, OOD calib/eval, generated calib/eval) the classifier's P(same), the
base-MiniLM adjacent cosine (``clf.pair_cosine``, as the episodes stage computes it) and the base
MiniLM embedding of every utterance are computed once and cached (``--cache``; ~30 min on 2 loaded
CPU cores, the classifier is the cost). Then, every parameter chosen on TIAGE dev + OOD calib +
generated calib only (TIAGE test and the eval halves are reports):

- ``shipped``: the artifact's rule; ``classifier_alone``: its steps 1-3;
- ``learned_pc``: :func:`~qumem_pipeline.episodes.continuity.tune_decoding.choose_learned` (what
  ``tune_decoding --learned`` would write: features of P(same) and the adjacent cosine only);
- ``learned_block``: the same logistic fit with block-similarity features added
  (:func:`~qumem_pipeline.episodes.continuity.gap_features.block_cosine`, windows 2 and 3, each with
  its relative dip and depth), cutoff by the lowest mean Pk over the three calibration sets;
- ``learned_block_or_classifier``: a gap is a boundary when the classifier alone says so OR the
  block score is above a cutoff, the cutoff chosen as the lowest mean OOD/gen calib Pk among those
  that keep TIAGE dev no worse than the classifier alone.

Last line with ``--json``: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

SETS = ("train", "dev", "test", "ood_calib", "ood_eval", "gen_calib", "gen_eval")
CALIB = ("dev", "ood_calib", "gen_calib")
REPORT = ("test", "ood_eval", "gen_eval", "dev", "ood_calib", "gen_calib")
PC_FEATURES = ("lp", "c", "c_rel1", "lp_rel1", "c_rel2", "lp_rel2", "c_rel4", "lp_rel4", "c_rel8", "lp_rel8",
               "c_lmin", "lp_lmin", "c_depth2", "c_depth4", "lp_depth2", "edge")
BLOCK_WINDOWS = (2, 3)


def load_sets() -> dict:
    from qumem_pipeline.episodes.continuity import generated_dialogues as gen
    from qumem_pipeline.episodes.continuity import ood_data as ood
    from qumem_pipeline.episodes.continuity.data import load_tiage

    return {"train": load_tiage("train"), "dev": load_tiage("dev"), "test": load_tiage("test"),
            "ood_calib": ood.ood_dialogues("calib"), "ood_eval": ood.ood_dialogues("eval"),
            "gen_calib": gen.generated_dialogues("calib"), "gen_eval": gen.generated_dialogues("eval")}


def compute_signals(device=None) -> dict:
    from qumem_pipeline.episodes.continuity.inference import ContinuityClassifier
    from qumem_pipeline.eval.segmentation.robustness import adjacent_pairs, per_dialogue

    clf = ContinuityClassifier.load(device=device)
    enc = clf.sentence_encoder()
    out = {"version": clf.version}
    for name, ds in load_sets().items():
        t0 = time.time()
        pairs = adjacent_pairs(ds)
        flat = [u for d in ds for u in d.utterances]
        emb = np.asarray(enc.encode(flat, batch_size=32), np.float32)
        embs, pos = [], 0
        for d in ds:
            embs.append(emb[pos : pos + len(d.utterances)])
            pos += len(d.utterances)
        out[name] = {"p": per_dialogue(clf.predict_same_proba(pairs, batch_size=64), ds),
                     "c": per_dialogue(clf.pair_cosine(pairs), ds), "emb": embs,
                     "refs": [list(d.boundaries) for d in ds]}
        print(f"{name}: {len(pairs)} gaps, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return out


def block_rows(p, c, emb) -> np.ndarray:
    from qumem_pipeline.episodes.continuity.gap_features import block_cosine, depth, feature_matrix, neighbour_mean

    cols = [feature_matrix(PC_FEATURES, p, c)]
    for k in BLOCK_WINDOWS:
        bc = block_cosine(emb, k)
        cols.append(np.column_stack([bc, bc - neighbour_mean(bc, 4), depth(bc, 3)]))
    return np.hstack(cols)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default="/tmp/seg_signals.pkl", help="signal cache (written when missing)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from qumem_pipeline.episodes.continuity.decoding import DecisionRule
    from qumem_pipeline.episodes.continuity.inference import DEFAULT_ARTIFACT_DIR
    from qumem_pipeline.episodes.continuity.tune_decoding import (LEARNED_CUTOFFS, PkScorer, _balanced_fit,
                                                                    _decode, choose_learned)
    from qumem_pipeline.episodes.metrics import evaluate

    t0 = time.time()
    cache = Path(args.cache)
    if cache.is_file():
        with open(cache, "rb") as f:  # written by this script
            S = pickle.load(f)
    else:
        S = compute_signals(args.device)
        with open(cache, "wb") as f:
            pickle.dump(S, f)
    shipped = DecisionRule.from_config(json.loads((DEFAULT_ARTIFACT_DIR / "config.json").read_text()))
    alone = shipped.without_similarity()

    def table_row(hyps_of) -> dict:
        row = {}
        for name in REPORT:
            s = evaluate(S[name]["refs"], hyps_of(name))
            row[name] = {"pk": round(s.pk, 4), "windowdiff": round(float(s.windowdiff), 4), "f1": round(s.f1, 4)}
        return row

    def by_rule(rule):
        return lambda name: [rule.boundaries(p, c) for p, c in zip(S[name]["p"], S[name]["c"])]

    systems = {"shipped": table_row(by_rule(shipped)), "classifier_alone": table_row(by_rule(alone))}
    learned, sel = choose_learned(alone, [(S[n]["p"], S[n]["c"], S[n]["refs"]) for n in CALIB],
                                  names=["tiage_dev", "ood_calib", "gen_calib"])
    systems["learned_pc"] = table_row(by_rule(learned))

    rows = {n: [block_rows(p, c, e) for p, c, e in zip(S[n]["p"], S[n]["c"], S[n]["emb"])] for n in REPORT}
    parts = [(np.vstack(rows[n]), np.concatenate([np.asarray(r, float) for r in S[n]["refs"]])) for n in CALIB]
    coef, b = _balanced_fit(parts, 1.0)
    score = {n: [1 / (1 + np.exp(-(x @ coef + b))) for x in rows[n]] for n in REPORT}
    pk = {n: PkScorer(S[n]["refs"]) for n in REPORT}

    def block_hyps(name, t, with_alone):
        out = []
        for s, p in zip(score[name], S[name]["p"]):
            h = _decode(s, t, False)
            out.append(np.maximum(h, alone.boundaries(p)) if with_alone else h)
        return out

    t_alone = min(LEARNED_CUTOFFS, key=lambda t: (round(float(np.mean([pk[n](block_hyps(n, t, False)) for n in CALIB])), 6), t))
    systems["learned_block"] = table_row(lambda n: block_hyps(n, t_alone, False))
    floor = pk["dev"]([alone.boundaries(p) for p in S["dev"]["p"]])
    ok = [t for t in LEARNED_CUTOFFS if pk["dev"](block_hyps("dev", t, True)) <= floor + 1e-6]
    t_or = (min(ok, key=lambda t: (round(float(np.mean([pk[n](block_hyps(n, t, True)) for n in CALIB[1:]])), 6), t))
            if ok else None)
    if t_or is not None:
        systems["learned_block_or_classifier"] = table_row(lambda n: block_hyps(n, t_or, True))

    result = {"classifier_version": S.get("version"), "shipped_rule": shipped.describe(),
              "learned_pc": {"rule": learned.describe(), **{k: v for k, v in sel.items() if k != "candidates"}},
              "learned_block": {"cutoff": t_alone, "cutoff_or_classifier": t_or, "block_windows": list(BLOCK_WINDOWS),
                                "n_features": int(len(coef))},
              "chosen_on": "TIAGE dev + OOD calib + generated calib", "systems": systems,
              "elapsed_s": round(time.time() - t0, 1)}
    head = f"{'system':<30}" + "".join(f" | {n + ' Pk/WD/F1':>26}" for n in REPORT)
    print(head)
    for name, row in systems.items():
        print(f"{name:<30}" + "".join(f" | {row[n]['pk']:8.4f} {row[n]['windowdiff']:7.4f} {row[n]['f1']:7.4f}"
                                      for n in REPORT))
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
