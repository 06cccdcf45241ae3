"""Choose the learned decision rule with block-similarity features and store it in the artifact.

    python -m qumem_pipeline.episodes.continuity.tune_learned [--cache PATH] [--write] [--json]

Why this procedure (issue 29 item 5): out of domain, joins between unrelated dialogues show as drops
of *block* similarity (the mean embedding of the utterances before a gap against those after it),
which P(same) and the adjacent cosine miss; a history's own scale matters (TIAGE's short turns are
alike to each other at ~0.31 cosine, LoCoMo's at ~0.41, task dialogues at ~0.24), so every feature
also comes standardised over the 32 gaps on each side (:mod:`.gap_features`, ``z32:``).

Data roles (nothing is chosen on TIAGE test or on an ``eval`` half):

- **fit**: TIAGE train (the classifier's own training dialogues: allowed data), OOD calib and
  generated calib (:mod:`.ood_data`, :mod:`.generated_dialogues`), every domain weighing the same and
  classes balanced inside each;
- **guard**: TIAGE dev, never fitted on: a candidate must score no worse than the classifier's own
  decision (steps 1-3 of the rule) there;
- **objective**: the mean of OOD calib's and generated calib's held-out Pk, 5-fold CV over each one's
  dialogues (the model fitted on the other folds, the other domains and TIAGE train).

Candidates: block windows x standardised or not x L2 strength x decoding (plain cutoff or local
maxima) x cutoff. The winner is refitted on all of the fit data and keeps its CV cutoff.

The classifier's P(same), the adjacent cosine and every utterance's base-MiniLM embedding on all
seven sets are computed once (about 30 min on a loaded 2-core box: the classifier is the cost) and
cached (``--cache``, keyed by the adapter weights' version: the rule does not change them).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from qumem_pipeline.episodes.continuity.decoding import DecisionRule, LearnedScore, artifact_version
from qumem_pipeline.episodes.continuity.gap_features import feature_matrix
from qumem_pipeline.episodes.continuity.tune_decoding import (LEARNED_CUTOFFS, N_FOLDS, PkScorer, _balanced_fit,
                                                              _decode, _rounded, versioned_config,
                                                              write_config_atomic)

SETS = ("train", "dev", "test", "ood_calib", "ood_eval", "gen_calib", "gen_eval")
REPORT = ("test", "ood_eval", "gen_eval", "dev", "ood_calib", "gen_calib")
FIT, GUARD, OBJECTIVE = ("train", "ood_calib", "gen_calib"), "dev", ("ood_calib", "gen_calib")
PC_FEATURES = ("lp", "c", "c_rel1", "lp_rel1", "c_rel2", "lp_rel2", "c_rel4", "lp_rel4", "c_rel8", "lp_rel8",
               "c_lmin", "lp_lmin", "c_depth2", "c_depth4", "lp_depth2", "edge")
BLOCK_WINDOWS = ((2, 3), (2, 3, 4, 6), (3, 5))
Z_WINDOW = 32
L2S = (1.0, 10.0, 100.0)
DEFAULT_CACHE = Path(os.environ.get("QUMEM_SEG_SIGNALS", "/tmp/seg_signals.pkl"))


def block_features(windows: Sequence[int], z: bool) -> tuple[str, ...]:
    names = list(PC_FEATURES)
    for k in windows:
        names += [f"b{k}", f"b{k}_rel4", f"b{k}_depth3", f"b{k}_lmin"]
    return tuple(names + [f"z{Z_WINDOW}:{n}" for n in names] if z else names)


def candidate_feature_sets() -> dict[str, tuple[str, ...]]:
    return {f"block{'+'.join(map(str, w))}{'+z' if z else ''}": block_features(w, z)
            for w in BLOCK_WINDOWS for z in (False, True)}


# ---- signals ---------------------------------------------------------------------------------------
def load_sets(seed: int | None = None) -> dict:
    from qumem_pipeline.episodes.continuity import generated_dialogues as gen
    from qumem_pipeline.episodes.continuity import ood_data as ood
    from qumem_pipeline.episodes.continuity.data import load_tiage

    seed = ood.DEFAULT_SEED if seed is None else seed
    return {"train": load_tiage("train"), "dev": load_tiage("dev"), "test": load_tiage("test"),
            "ood_calib": ood.ood_dialogues("calib", seed=seed), "ood_eval": ood.ood_dialogues("eval", seed=seed),
            "gen_calib": gen.generated_dialogues("calib", seed=seed), "gen_eval": gen.generated_dialogues("eval", seed=seed)}


def compute_signals(clf) -> dict:
    """Per set: P(same), adjacent cosine and utterance embeddings per dialogue (as the episodes stage
    computes them: ``clf.history_signals``), and the references."""
    out = {"version": clf.version, "weights_version": clf.config.get("weights_version")}
    for name, ds in load_sets().items():
        t0 = time.time()
        p, c, e = zip(*clf.history_signals([list(d.utterances) for d in ds], embeddings=True))
        out[name] = {"p": list(p), "c": list(c), "emb": list(e), "refs": [list(d.boundaries) for d in ds]}
        print(f"signals {name}: {sum(len(x) for x in p)} gaps, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return out


def load_signals(clf, cache: Path | None) -> dict:
    """The cached signals when they were computed with this classifier's weights, else computed (and cached)."""
    want = clf.config.get("weights_version")
    if cache is not None and cache.is_file():
        with open(cache, "rb") as f:  # written by this module (or bench/segmentation_learned_features.py)
            S = pickle.load(f)
        if S.get("weights_version") == want and all(n in S for n in SETS):
            return S
        print(f"signal cache {cache}: weights {S.get('weights_version')!r}, not {want!r}: recomputing", file=sys.stderr)
    S = compute_signals(clf)
    if cache is not None:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=cache.parent)
        with os.fdopen(fd, "wb") as f:
            pickle.dump(S, f)
        os.replace(tmp, cache)
    return S


# ---- the choice ------------------------------------------------------------------------------------
def _rows(S: dict, name: str, feats: Sequence[str]) -> list[np.ndarray]:
    d = S[name]
    return [feature_matrix(feats, p, c, e) for p, c, e in zip(d["p"], d["c"], d["emb"])]


def _refs(S: dict, name: str) -> list[np.ndarray]:
    return [np.asarray(r, dtype=np.float64) for r in S[name]["refs"]]


def _score(X: np.ndarray, coef: np.ndarray, b: float) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-(X @ coef + b)))


def choose_learned_block(rule: DecisionRule, S: dict, feature_sets: dict[str, tuple[str, ...]] | None = None,
                         l2s: Sequence[float] = L2S, n_folds: int = N_FOLDS, seed: int = 0) -> tuple[DecisionRule, dict]:
    """The module docstring's procedure on the signals ``S`` (:func:`load_signals`); ``rule``'s
    steps 1-3 stay as the classifier-alone reference and set the TIAGE dev guard."""
    feature_sets = feature_sets or candidate_feature_sets()
    base = rule.without_similarity()
    pk = {n: PkScorer(S[n]["refs"]) for n in (GUARD, *OBJECTIVE)}
    floor = pk[GUARD]([base.boundaries(p) for p in S[GUARD]["p"]])
    folds = {n: np.random.default_rng(seed).permutation(len(S[n]["p"])) % n_folds for n in OBJECTIVE}
    table, best = [], None
    for fs_name, feats in feature_sets.items():
        rows = {n: _rows(S, n, feats) for n in (*FIT, GUARD)}
        refs = {n: _refs(S, n) for n in FIT}
        for l2 in l2s:
            held = {n: [None] * len(rows[n]) for n in OBJECTIVE}
            for f in range(n_folds):
                parts = [(np.vstack(rows["train"]), np.concatenate(refs["train"]))]
                for n in OBJECTIVE:
                    idx = np.flatnonzero(folds[n] != f)
                    parts.append((np.vstack([rows[n][i] for i in idx]), np.concatenate([refs[n][i] for i in idx])))
                coef, b = _balanced_fit(parts, l2)
                for n in OBJECTIVE:
                    for i in np.flatnonzero(folds[n] == f):
                        held[n][i] = _score(rows[n][i], coef, b)
            coef, b = _balanced_fit([(np.vstack(rows[n]), np.concatenate(refs[n])) for n in FIT], l2)
            held[GUARD] = [_score(x, coef, b) for x in rows[GUARD]]
            for local_max in (False, True):
                kept = None
                for t in LEARNED_CUTOFFS:
                    cv = {n: pk[n]([_decode(s, t, local_max) for s in held[n]]) for n in (GUARD, *OBJECTIVE)}
                    if cv[GUARD] > floor + 1e-9:
                        continue
                    obj = float(np.mean([cv[n] for n in OBJECTIVE]))
                    if kept is None or obj < kept["objective"] - 1e-9:
                        kept = {"objective": round(obj, 4), "cutoff": t, "cv_pk": {n: round(x, 4) for n, x in cv.items()}}
                row = {"features": fs_name, "n_features": len(feats), "l2": l2, "local_max": local_max,
                       **(kept or {"objective": None})}
                table.append(row)
                if kept is not None and (best is None or (row["objective"], row["n_features"], -l2, local_max)
                                         < (best[0]["objective"], best[0]["n_features"], -best[0]["l2"], best[0]["local_max"])):
                    best = (row, coef, b)
    if best is None:
        raise ValueError("no learned candidate keeps TIAGE dev no worse than the classifier alone")
    row, coef, b = best
    learned = LearnedScore(feature_sets[row["features"]], tuple(round(float(x), 6) for x in coef), round(float(b), 6),
                           row["cutoff"], row["local_max"])
    chosen = DecisionRule(base.threshold, base.peak_threshold, base.smoothing, base.min_segment, learned=learned)
    selection = {
        "chosen_on": "fit: TIAGE train + OOD calib + generated calib; guard: TIAGE dev no worse than the classifier "
                     f"alone ({round(floor, 4)}); objective: mean {n_folds}-fold CV Pk of OOD calib and generated calib",
        "feature_set": row["features"], "l2": row["l2"], "local_max": row["local_max"], "cutoff": row["cutoff"],
        "cv_pk": row["cv_pk"], "objective": row["objective"], "dev_pk_classifier_alone": round(floor, 4),
        "candidates": table,
        "method": "logistic regression, every domain weighing the same and classes balanced inside each",
        "command": "python -m qumem_pipeline.episodes.continuity.tune_learned --write",
    }
    return chosen, selection


def report_table(S: dict, rules: dict[str, DecisionRule]) -> dict:
    """Pk / WindowDiff / F1 per rule and set, from the cached signals (each rule reads what it needs)."""
    from qumem_pipeline.episodes.metrics import evaluate

    out = {}
    for label, r in rules.items():
        out[label] = {}
        for n in REPORT:
            d = S[n]
            s = evaluate(d["refs"], [r.boundaries(p, c, e) for p, c, e in zip(d["p"], d["c"], d["emb"])])
            out[label][n] = _rounded({"pk": s.pk, "windowdiff": s.windowdiff, "f1": s.f1})
    return out


def print_table(table: dict) -> None:
    print(f"{'system':<26}" + "".join(f" | {n + ' Pk/WD/F1':>24}" for n in REPORT))
    for label, row in table.items():
        print(f"{label:<26}" + "".join(f" | {row[n]['pk']:7.4f} {row[n]['windowdiff']:7.4f} {row[n]['f1']:7.4f}"
                                      for n in REPORT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", default=None, help="artifact dir (default: the committed one)")
    ap.add_argument("--cache", default=str(DEFAULT_CACHE), help="signal cache (computed when missing or stale)")
    ap.add_argument("--write", action="store_true", help="store the chosen rule in the artifact's config.json")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    from qumem_pipeline.episodes.continuity.inference import DEFAULT_ARTIFACT_DIR

    result = learned_rule(Path(args.artifact) if args.artifact else DEFAULT_ARTIFACT_DIR,
                          Path(args.cache) if args.cache else None, write=args.write)
    if args.json:
        print(json.dumps(result))
    return 0


def learned_rule(adir: Path, cache: Path | None = DEFAULT_CACHE, write: bool = False) -> dict:
    """Choose the learned block rule for the artifact in `adir` (the rule kind that ships) and, with
    `write`, store it (and the version it makes) in the artifact's config.json. Returns the choice and
    the systems' figures (`main --json`)."""
    from qumem_pipeline.episodes.continuity.inference import ContinuityClassifier

    t0 = time.time()
    clf = ContinuityClassifier.load(adir, verify_version=False)  # this tool rewrites the version
    S = load_signals(clf, cache)
    current = clf.rule
    chosen, selection = choose_learned_block(current, S)
    table = report_table(S, {"chosen": chosen, "current": current, "classifier_alone": current.without_similarity()})
    print_table(table)
    print(f"chosen: {chosen.describe()[:160]}... ({ {k: v for k, v in selection.items() if k != 'candidates'} })",
          file=sys.stderr)
    metrics = {n: table["chosen"][n] for n in REPORT}
    result = {"rule": chosen.to_json(), "selection": {k: v for k, v in selection.items() if k != "candidates"},
              "n_candidates": len(selection["candidates"]), "systems": table,
              "version": artifact_version(clf.config.get("weights_version", clf.config["version"]), chosen),
              "elapsed_s": round(time.time() - t0, 1)}
    if write:
        steps_1_3 = {k: v for k, v in (clf.config.get("decision", {}).get("selection") or {}).items()
                     if k not in ("sim_dip", "learned", "learned_block")}  # the classifier-alone part stays
        config = versioned_config(clf.config, chosen, {**steps_1_3, "learned_block": selection})
        config["threshold_rule"] = (f"{chosen.describe()}; chosen by `{selection['command']}` "
                                    f"({selection['chosen_on']}; see decision.selection)")
        config["metrics"] = metrics
        write_config_atomic(adir, config)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
