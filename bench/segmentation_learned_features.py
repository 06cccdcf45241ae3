"""The shipped learned decision rule against the rules before it, on TIAGE and the out-of-domain sets.

    python bench/segmentation_learned_features.py [--cache /tmp/seg_signals.pkl] [--json]

Signals (the classifier's P(same), the base-MiniLM adjacent cosine and every utterance's embedding
on TIAGE train/dev/test, OOD calib/eval, generated calib/eval) come from
:func:`qumem_pipeline.episodes.continuity.tune_learned.load_signals` (cached by adapter weights; about
2 min on an idle 2-core box, 30 on a loaded one). Rows, every parameter chosen without TIAGE test or
an eval half:

- ``shipped``: the artifact's rule (learned score with block-similarity features);
- ``learned_block_rechosen``: :func:`~qumem_pipeline.episodes.continuity.tune_learned.choose_learned_block`
  run again (says whether it equals the shipped rule: the artifact is reproducible from the cache);
- ``simdip_v1``: the rule shipped two versions back (P(same) < 0.42, or the adjacent cosine more than
  0.18 below the mean of 4 gaps each side while P(same) < 0.85), applied to this classifier's signals
  (its parameters were chosen for the TIAGE-only classifier of that time);
- ``learned_pc``: :func:`~qumem_pipeline.episodes.continuity.tune_decoding.choose_learned`, the
  learned score over P(same) and adjacent-cosine features only (no block similarity);
- ``classifier_alone``: the rule's steps 1-3 (P(same) below the artifact's threshold).

Last line with ``--json``: one JSON object (a Pk / WindowDiff / F1 that is NaN, e.g. on a set with no
reference boundary, is null there: JSON has no NaN).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SIMDIP_V1 = {"rule": "smooth-threshold-peaks-simdip-v1", "threshold": 0.42, "peak_threshold": None, "smoothing": 0.0,
             "min_segment": 1, "sim_threshold": None, "sim_window": 4, "sim_drop": 0.18, "sim_gate": 0.85,
             "sim_local_min": False}


def json_safe(o):
    """`o` with every NaN or infinite float (numpy scalars included) as None, containers walked: strict JSON."""
    if isinstance(o, dict):
        return {k: json_safe(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_safe(v) for v in o]
    if hasattr(o, "item") and getattr(o, "shape", None) == ():  # a numpy scalar
        o = o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default=None, help="signal cache (default: tune_learned's; computed when stale)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from qumem_pipeline.episodes.continuity.decoding import DecisionRule
    from qumem_pipeline.episodes.continuity.inference import ContinuityClassifier
    from qumem_pipeline.episodes.continuity.tune_decoding import choose_learned
    from qumem_pipeline.episodes.continuity.tune_learned import (DEFAULT_CACHE, choose_learned_block, load_signals,
                                                                 print_table, report_table)

    t0 = time.time()
    clf = ContinuityClassifier.load(device=args.device)
    S = load_signals(clf, Path(args.cache) if args.cache else DEFAULT_CACHE)
    shipped = clf.rule
    alone = shipped.without_similarity()
    rechosen, sel = choose_learned_block(shipped, S)
    learned_pc, sel_pc = choose_learned(alone, [(S[n]["p"], S[n]["c"], S[n]["refs"]) for n in ("dev", "ood_calib", "gen_calib")],
                                        names=["tiage_dev", "ood_calib", "gen_calib"])
    rules = {"shipped": shipped, "learned_block_rechosen": rechosen, "simdip_v1": DecisionRule.from_json(SIMDIP_V1),
             "learned_pc": learned_pc, "classifier_alone": alone}
    table = report_table(S, rules)
    print_table(table)
    result = {"classifier_version": clf.version, "shipped_rule": shipped.describe(),
              "rechosen_equals_shipped": rechosen == shipped,
              "learned_block": {k: v for k, v in sel.items() if k != "candidates"},
              "learned_pc": {k: v for k, v in sel_pc.items() if k != "candidates"},
              "systems": table, "elapsed_s": round(time.time() - t0, 1)}
    print(f"re-chosen rule equals the shipped one: {result['rechosen_equals_shipped']}")
    if args.json:
        print(json.dumps(json_safe(result), allow_nan=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
