"""In-domain and out-of-domain segmentation side by side: TIAGE test beside the LoCoMo-joined set.

    python -m qumem_pipeline.eval.segmentation.robustness [--artifact DIR[=LABEL] ...] [--calib] [--json]

Why: a classifier tuned on TIAGE can look good there and fail on other dialogue (issue 18 item 5).
This runs every system on both sets with nothing chosen on the evaluated sets:

- ``classifier`` (one row per ``--artifact``; default the committed one): the artifact's own
  decision rule, exactly as the episodes stage applies it (with the similarity dips, when the
  artifact has them, from the classifier's own base-MiniLM cosines: ``clf.pair_cosine``);
- ``classifier/no_sim_dip``: the same rule without its similarity dips (the reference: the
  classifier's decision alone), only for artifacts whose rule has them;
- ``minilm_adjacent_sim``: the plain baseline — cosine of the base all-MiniLM-L6-v2 embeddings of
  adjacent utterances (the index stage's encoder, as the rule uses), boundary when below a
  threshold chosen on TIAGE dev (lowest Pk);
- ``texttiling_minilm``, ``fixed_window_4``, ``all_continue``, ``random_0.2`` as in
  ``qumem eval segmentation``.

Sets: ``tiage_test``, ``ood_eval`` (:mod:`.ood`, built from LoCoMo at run time, seeded) and
``gen_eval`` (:mod:`~qumem_pipeline.episodes.continuity.generated_dialogues`: whole user–assistant task
dialogues from templates, joined; its tasks never in ``gen_calib``); ``--calib`` adds ``ood_calib``
and ``gen_calib``, the halves that decision parameters may be chosen on (so not clean reports). ``--sim-dip`` re-runs, per classifier, the choice of the
similarity dips (:func:`~qumem_pipeline.episodes.continuity.tune_decoding.choose_sim_dip`, TIAGE dev
+ OOD calib) on the rule without them, adds it as ``LABEL+sim_dip(rechosen)`` and says whether it
equals the shipped rule. ``--learned`` adds ``LABEL+learned(rechosen)``: the learned score (decision
step 5, :func:`~qumem_pipeline.episodes.continuity.tune_decoding.choose_learned`, chosen by CV on
TIAGE dev + OOD calib + generated calib), with its selection in ``classifiers.LABEL.learned_rechosen``.
Last line with ``--json``: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

from qumem_pipeline.episodes.continuity.decoding import rule_of
from qumem_pipeline.episodes.dialogues import Dialogue
from qumem_pipeline.episodes.metrics import Scores, evaluate
from qumem_pipeline.eval.segmentation import baselines as bl
from qumem_pipeline.episodes.continuity import generated_dialogues as gen
from qumem_pipeline.episodes.continuity import ood_data as ood

SIM_THRESHOLDS = tuple(round(float(t), 2) for t in np.arange(0.0, 0.91, 0.01))


def _r(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(float(x), 4)


def scores_dict(s: Scores) -> dict:
    return {"pk": _r(s.pk), "windowdiff": _r(s.windowdiff), "f1": _r(s.f1),
            "precision": _r(s.precision), "recall": _r(s.recall)}


def adjacent_similarity(dialogues: list[Dialogue], embedder) -> list[np.ndarray]:
    """Cosine of adjacent utterances' MiniLM embeddings, per dialogue (one batched encode)."""
    flat = [u for d in dialogues for u in d.utterances]
    emb = embedder.encode(flat)
    out, pos = [], 0
    for d in dialogues:
        e = emb[pos : pos + len(d.utterances)]
        out.append(np.sum(e[:-1] * e[1:], axis=1) if len(e) > 1 else np.zeros(0, np.float32))
        pos += len(d.utterances)
    return out


def choose_sim_threshold(sims: list[np.ndarray], dialogues: list[Dialogue]) -> float:
    """The similarity threshold with the lowest macro Pk on ``dialogues`` (TIAGE dev)."""
    from qumem_pipeline.episodes.continuity.tune_decoding import PkScorer

    score = PkScorer([d.boundaries for d in dialogues])
    best = min(SIM_THRESHOLDS, key=lambda t: (round(score([(s < t).astype(int) for s in sims]), 6), t))
    return float(best)


def baseline_hyps(dialogues: list[Dialogue], sims: list[np.ndarray], sim_threshold: float, embedder) -> dict:
    from qumem_pipeline.eval.segmentation.evaluate import RANDOM_SEED, texttiling_boundaries

    rng = np.random.default_rng(RANDOM_SEED)
    return {
        "minilm_adjacent_sim": [[int(x) for x in (s < sim_threshold)] for s in sims],
        "texttiling_minilm": texttiling_boundaries(dialogues, embedder),
        f"fixed_window_{bl.DEFAULT_FIXED_SIZE}": [bl.fixed_window(len(d.utterances)) for d in dialogues],
        "all_continue": [bl.all_continue(len(d.utterances)) for d in dialogues],
        f"random_{bl.DEFAULT_RANDOM_RATE}": [bl.random_boundaries(len(d.utterances), rng) for d in dialogues],
    }


def classifier_signals(clf, dialogues: list[Dialogue], batch_size: int = 64, with_cosine: bool = True,
                       with_embeddings: bool = False):
    """(P(same), cosine or None, utterance embeddings or None) per dialogue, as the episodes stage
    computes them (``clf.history_signals``)."""
    signals = clf.history_signals([list(d.utterances) for d in dialogues], batch_size, cosine=with_cosine,
                                  embeddings=with_embeddings)
    return tuple(list(x) for x in zip(*signals)) if signals else ([], [], [])


def classifier_hyps(clf, dialogues: list[Dialogue], batch_size: int = 64) -> list[list[int]]:
    """The shipped rule's boundaries, from the signals it reads (as the episodes stage computes them)."""
    rule = rule_of(clf)
    signals = clf.history_signals([list(d.utterances) for d in dialogues], batch_size)
    return [[int(x) for x in rule.boundaries(p, c, e)] for p, c, e in signals]


def load_sets(with_calib: bool = False, seed: int = ood.DEFAULT_SEED) -> dict[str, list[Dialogue]]:
    from qumem_pipeline.episodes.continuity.data import load_tiage

    sets = {"tiage_test": load_tiage("test"), "ood_eval": ood.ood_dialogues("eval", seed=seed),
            "gen_eval": gen.generated_dialogues("eval", seed=seed)}
    if with_calib:
        sets["ood_calib"] = ood.ood_dialogues("calib", seed=seed)
        sets["gen_calib"] = gen.generated_dialogues("calib", seed=seed)
    return sets


def format_side_by_side(table: dict[str, dict[str, dict]], set_names: list[str]) -> str:
    head = f"{'system':<28}" + "".join(f" | {n + ' Pk':>15} {'WD':>7} {'F1':>7}" for n in set_names)
    lines = [head, "-" * len(head)]
    f = lambda x: "    n/a" if x is None else f"{x:7.4f}"  # noqa: E731
    for system, by_set in table.items():
        cells = "".join(f" | {f(by_set[n]['pk']):>15} {f(by_set[n]['windowdiff'])} {f(by_set[n]['f1'])}"
                        for n in set_names)
        lines.append(f"{system:<28}{cells}")
    return "\n".join(lines)


def run(artifacts: list[tuple[str | None, str]] | None = None, with_calib: bool = False, as_json: bool = False,
        seed: int = ood.DEFAULT_SEED, device: str | None = None, batch_size: int = 64,
        sets: dict[str, list[Dialogue]] | None = None, dev: list[Dialogue] | None = None,
        classifiers: dict | None = None, embedder=None, sim_dip: bool = False,
        calib: list[Dialogue] | None = None, learned: bool = False) -> dict:
    """``sets`` / ``dev`` / ``calib`` / ``classifiers`` (label -> loaded classifier) replace the
    defaults (tests). ``sim_dip``: also a ``LABEL+sim_dip(rechosen)`` row per classifier."""
    from qumem_pipeline.episodes.continuity import ContinuityClassifier
    from qumem_pipeline.episodes.continuity.data import load_tiage
    from qumem_pipeline.episodes.continuity.tune_decoding import choose_learned, choose_sim_dip
    from qumem_pipeline.embedding.minilm import Embedder

    t0 = time.time()
    sets = sets if sets is not None else load_sets(with_calib, seed)
    embedder = embedder or Embedder.load(device=device)
    dev = dev if dev is not None else load_tiage("dev")
    dev_cos = adjacent_similarity(dev, embedder)
    sim_thr = choose_sim_threshold(dev_cos, dev)
    cos = {n: adjacent_similarity(ds, embedder) for n, ds in sets.items()}
    if sim_dip or learned:
        calib = calib if calib is not None else [sets.get("ood_calib") or ood.ood_dialogues("calib", seed=seed),
                                                 sets.get("gen_calib") or gen.generated_dialogues("calib", seed=seed)]
        if calib and isinstance(calib[0], Dialogue):  # one calibration set given (tests)
            calib = [calib]

    table: dict[str, dict[str, dict]] = {}
    versions = {}
    loaders = ({label: (lambda c=c: c) for label, c in classifiers.items()} if classifiers else
               {label: (lambda a=adir: ContinuityClassifier.load(a, device=device))
                for adir, label in artifacts or [(None, "classifier")]})

    def scored(rule, signals: dict) -> dict:
        return {n: scores_dict(evaluate([d.boundaries for d in sets[n]],
                                        [rule.boundaries(p, c, e) for p, c, e in zip(*signals[n])]))
                for n in sets}

    for label, load in loaders.items():
        clf = load()
        rule = rule_of(clf)
        versions[label] = {"version": clf.version, "rule": rule.to_json(), "describe": rule.describe()}
        signals = {n: classifier_signals(clf, ds, batch_size, with_embeddings=rule.needs_embeddings)
                   for n, ds in sets.items()}
        table[label] = scored(rule, signals)
        if rule.needs_similarity:
            table[f"{label}/no_sim_dip"] = scored(rule.without_similarity(), signals)
        if sim_dip or learned:
            dev_p, dev_c, _ = classifier_signals(clf, dev, batch_size)
            cal = [(*classifier_signals(clf, c, batch_size)[:2], [d.boundaries for d in c]) for c in calib]
            dev_sig = (dev_p, dev_c, [d.boundaries for d in dev])
        if sim_dip:
            rechosen, sel = choose_sim_dip(rule, dev_sig, cal)
            versions[label]["sim_dip_rechosen"] = {**sel, "rule": rechosen.to_json(),
                                                   "equals_shipped_rule": rechosen == rule}
            table[f"{label}+sim_dip(rechosen)"] = scored(rechosen, signals)
        if learned:
            names = ["tiage_dev"] + (["ood_calib", "gen_calib"] if len(cal) == 2 else [f"calib{k}" for k in range(len(cal))])
            rechosen, sel = choose_learned(rule, [dev_sig, *cal], names=names)
            sel = {k: v for k, v in sel.items() if k != "candidates"} | {"n_candidates": len(sel["candidates"])}
            versions[label]["learned_rechosen"] = {**sel, "rule": rechosen.to_json(), "describe": rechosen.describe(),
                                                   "equals_shipped_rule": rechosen == rule}
            table[f"{label}+learned(rechosen)"] = scored(rechosen, signals)
        del clf
    for name, ds in sets.items():
        refs = [d.boundaries for d in ds]
        for system, hyps in baseline_hyps(ds, cos[name], sim_thr, embedder).items():
            table.setdefault(system, {})[name] = scores_dict(evaluate(refs, hyps))

    stats = {n: {"n_dialogues": len(ds), "n_utterances": sum(len(d.utterances) for d in ds),
                 "n_boundaries": sum(sum(d.boundaries) for d in ds)} for n, ds in sets.items()}
    result = {"sets": stats, "ood_builder": ood.BUILDER_VERSION, "ood_seed": seed,
              "generated_builder": gen.BUILDER_VERSION,
              "minilm_adjacent_sim_threshold": sim_thr, "minilm_adjacent_sim_threshold_chosen_on": "TIAGE dev",
              "classifiers": versions, "systems": table, "elapsed_s": round(time.time() - t0, 1)}
    _print_summary(result, list(sets))
    if as_json:
        print(json.dumps(result))
    return result


def _print_summary(result: dict, set_names: list[str]) -> None:
    """The sets, the classifiers and their re-chosen rules, then the side-by-side table."""
    for n, s in result["sets"].items():
        print(f"{n}: {s['n_dialogues']} dialogues, {s['n_utterances']} utterances, {s['n_boundaries']} boundaries")
    for label, v in result["classifiers"].items():
        print(f"{label}: {v['version']} ({v['describe']})")
        if "sim_dip_rechosen" in v:
            print(f"{label}+sim_dip(rechosen): {v['sim_dip_rechosen']}")
        if "learned_rechosen" in v:
            print(f"{label}+learned(rechosen): {v['learned_rechosen']['describe']} "
                  f"(cv_pk {v['learned_rechosen']['cv_pk']})")
    print(f"minilm_adjacent_sim: boundary when cosine < {result['minilm_adjacent_sim_threshold']} (chosen on TIAGE dev)")
    print(format_side_by_side(result["systems"], set_names))
    sys.stdout.flush()


def _artifact_arg(s: str) -> tuple[str, str]:
    path, _, label = s.partition("=")
    return path, label or f"classifier:{path.rstrip('/').rsplit('/', 1)[-1]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qumem_pipeline.eval.segmentation.robustness", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", action="append", type=_artifact_arg, default=None,
                    help="continuity artifact dir, optionally DIR=LABEL; repeat to compare (default: committed)")
    ap.add_argument("--calib", action="store_true", help="also report the OOD calibration half")
    ap.add_argument("--sim-dip", action="store_true",
                    help="also a CLASSIFIER+sim_dip(rechosen) row: the similarity dips chosen again on dev + calib")
    ap.add_argument("--learned", action="store_true",
                    help="also a CLASSIFIER+learned(rechosen) row: a learned score chosen by CV on dev + both calibs")
    ap.add_argument("--seed", type=int, default=ood.DEFAULT_SEED, help="OOD set seed")
    ap.add_argument("--device", default=None)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    run(args.artifact, args.calib, args.json, args.seed, args.device, args.batch_size, sim_dip=args.sim_dip,
        learned=args.learned)
    return 0


if __name__ == "__main__":
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    raise SystemExit(main())
