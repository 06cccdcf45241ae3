"""Episodes-stage cost of the rule's similarity signals: the shipped rule against the classifier's rule alone.

    python bench/episodes_similarity.py [--archive examples/archive] [--repeats 3] [--device auto] [--json]

Both runs call :func:`~qumem_pipeline.episodes.segmentation.build_episodes_for_users` on the same
turns with the same loaded classifier, as the `episodes` asset does: "shipped" = the artifact's rule
(classifier P(same) + the base-MiniLM embeddings of the user utterances: adjacent and block cosines),
"without_dips" = the rule's steps 1-3 alone (no embedding computed). Best of ``--repeats`` each, interleaved; the sentence encoder's
one-off load is timed separately. Table reads and writes are not part of either. With --json the
last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archive", default=str(ROOT / "examples" / "archive"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from qumem_pipeline.episodes.continuity import ContinuityClassifier
    from qumem_pipeline.episodes.segmentation import build_episodes_for_users
    from qumem_pipeline.embedding.minilm import Embedder
    from qumem_pipeline.ingest.archive import ArchiveConfig, load_archive

    turns = load_archive(ArchiveConfig(args.archive)).turns
    by_user = {u: t for (u,), t in turns.partition_by("user_id", as_dict=True).items()}
    t0 = time.perf_counter()
    clf = ContinuityClassifier.load(device=args.device)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    Embedder.load(device=clf.device)  # what the shipped rule adds to the classifier's load, measured alone
    encoder_load_s = time.perf_counter() - t0
    if not clf.rule.needs_similarity:
        raise SystemExit(f"the artifact's rule has no similarity dips ({clf.rule.describe()}): nothing to measure")
    rules = {"shipped": clf.rule, "without_dips": clf.rule.without_similarity()}

    def run(rule):
        t = time.perf_counter()
        out, stats = build_episodes_for_users(by_user, clf.predict_same_proba, rule=rule,
                                              similarity=clf.pair_cosine, embed_histories=clf.history_embeddings,
                                              classifier_version=clf.version)
        return time.perf_counter() - t, out, stats

    best = {k: float("inf") for k in rules}
    outs = {}
    run(rules["shipped"])  # warm-up (first forward, allocator)
    for _ in range(args.repeats):
        for name, rule in rules.items():
            s, out, stats = run(rule)
            best[name] = min(best[name], s)
            outs[name] = (out, stats)
    added = best["shipped"] - best["without_dips"]
    res = {
        "archive": os.path.relpath(args.archive, ROOT), "users": len(by_user), "turns": turns.height,
        "pairs": outs["shipped"][1].decisions, "device": str(clf.device), "classifier_version": clf.version,
        "rule": clf.rule.describe(), "repeats": args.repeats,
        "shipped_s": round(best["shipped"], 3), "without_dips_s": round(best["without_dips"], 3),
        "added_s": round(added, 3), "ratio": round(best["shipped"] / best["without_dips"], 3),
        "classifier_load_s": round(load_s, 2), "encoder_load_s": round(encoder_load_s, 2),
        "episodes_shipped": outs["shipped"][1].episodes, "episodes_without_dips": outs["without_dips"][1].episodes,
    }
    print(f"{res['users']} users, {res['turns']} turns, {res['pairs']} user pairs on {res['device']}")
    print(f"episodes build: shipped {res['shipped_s']} s, without dips {res['without_dips_s']} s "
          f"(+{res['added_s']} s, x{res['ratio']}); encoder load {res['encoder_load_s']} s; "
          f"episodes {res['episodes_shipped']} vs {res['episodes_without_dips']}")
    if args.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
