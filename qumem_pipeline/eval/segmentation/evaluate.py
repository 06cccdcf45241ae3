"""The segmentation evaluation command: classifier + baselines on one reference file.

    python -m qumem_pipeline.eval.segmentation PATH [--format tiage|segments] [--json]

The classifier judges every adjacent pair of utterances of every dialogue (as in published TIAGE
numbers); its P(same) sequence per dialogue becomes boundaries by the artifact's dev-chosen decision
rule (:mod:`qumem_pipeline.episodes.continuity.decoding`), the same rule the episodes stage applies. Metrics: see
:mod:`.metrics`; baselines: see :mod:`.baselines`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from qumem_pipeline.episodes.continuity.decoding import rule_of as classifier_rule
import qumem_pipeline.eval.segmentation.baselines as bl
from qumem_pipeline.episodes.metrics import Scores, evaluate
from qumem_pipeline.episodes.dialogues import FORMATS, Dialogue, read_dialogues

RANDOM_SEED = 0


def _clean(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(float(x), 4)


def _score_dict(s: Scores) -> dict:
    return {"pk": _clean(s.pk), "windowdiff": _clean(s.windowdiff), "f1": _clean(s.f1)}


def classifier_boundaries(dialogues: list[Dialogue], classifier, batch_size: int = 64) -> list[list[int]]:
    """All pairs of all dialogues in one batched pass; then the decision rule per dialogue (with the
    classifier's base-MiniLM cosines when the rule has similarity dips, as the episodes stage does)."""
    rule = classifier_rule(classifier)
    signals = classifier.history_signals([list(d.utterances) for d in dialogues], batch_size)
    return [[int(x) for x in rule.boundaries(p, c, e)] for p, c, e in signals]


def texttiling_boundaries(dialogues: list[Dialogue], embedder=None, window: int = 2) -> list[list[int]]:
    embedder = embedder or bl.SentenceEmbedder()
    flat = [u for d in dialogues for u in d.utterances]
    emb = embedder.encode(flat)
    out, pos = [], 0
    for d in dialogues:
        n = len(d.utterances)
        out.append(bl.texttiling_from_embeddings(emb[pos : pos + n], window=window))
        pos += n
    return out


def format_table(rows: dict[str, Scores]) -> str:
    lines = [f"{'system':<22} {'Pk':>7} {'WD':>7} {'F1':>7} {'P':>7} {'R':>7}"]
    lines.append("-" * len(lines[0]))
    for name, s in rows.items():
        f = lambda x: "   n/a" if x is None or math.isnan(x) else f"{x:7.4f}"  # noqa: E731
        lines.append(f"{name:<22} {f(s.pk)} {f(s.windowdiff)} {f(s.f1)} {f(s.precision)} {f(s.recall)}")
    return "\n".join(lines)


def run_segmentation_eval(path: str, fmt: str | None = None, as_json: bool = False, classifier=None,
                          batch_size: int = 64, device=None, embedder=None) -> dict:
    """Evaluate the continuity classifier and the baselines on ``path``; print a table.

    ``fmt``: ``"tiage"``, ``"segments"`` or ``None`` (auto-detect). ``classifier``: a loaded
    :class:`~qumem_pipeline.episodes.continuity.ContinuityClassifier` (default: the committed artifact).
    With ``as_json`` the last printed line is the returned dict as one JSON object.
    """
    t0 = time.time()
    rr = read_dialogues(path, fmt)
    dialogues = rr.dialogues
    refs = [d.boundaries for d in dialogues]
    if classifier is None:
        from qumem_pipeline.episodes.continuity import ContinuityClassifier

        classifier = ContinuityClassifier.load(device=device)

    rows: dict[str, Scores] = {}
    rows["classifier"] = evaluate(refs, classifier_boundaries(dialogues, classifier, batch_size))
    rng = np.random.default_rng(RANDOM_SEED)
    base_hyps = {
        f"fixed_window_{bl.DEFAULT_FIXED_SIZE}": [bl.fixed_window(len(d.utterances)) for d in dialogues],
        "texttiling_minilm": texttiling_boundaries(dialogues, embedder),
        "all_continue": [bl.all_continue(len(d.utterances)) for d in dialogues],
        f"random_{bl.DEFAULT_RANDOM_RATE}": [bl.random_boundaries(len(d.utterances), rng) for d in dialogues],
    }
    for name, hyps in base_hyps.items():
        rows[name] = evaluate(refs, hyps)

    n_utt = sum(len(d.utterances) for d in dialogues)
    result = {
        "dataset": Path(path).name,
        "format": rr.fmt,
        "n_dialogues": len(dialogues),
        "n_utterances": n_utt,
        "n_reference_boundaries": sum(sum(r) for r in refs),
        "n_dialogues_skipped_pk": rows["classifier"].n_skipped,
        "classifier": _score_dict(rows["classifier"]),
        "classifier_version": getattr(classifier, "version", None),
        "classifier_threshold": classifier_rule(classifier).threshold,
        "classifier_rule": classifier_rule(classifier).to_json(),
        "baselines": {k: _score_dict(v) for k, v in rows.items() if k != "classifier"},
        "metric_impl": "own (qumem_pipeline.episodes.metrics): nltk pk/windowdiff definitions on the n-1 gap "
                       "string, k=max(2, round(n/n_segments/2)) per dialogue, macro-averaged; boundary F1 micro",
        "warnings": len(rr.warnings),
        "elapsed_s": round(time.time() - t0, 2),
    }
    print(f"dataset: {path} (format {rr.fmt}; {len(dialogues)} dialogues, {n_utt} utterances, "
          f"{result['n_reference_boundaries']} reference boundaries)")
    if rr.warnings:
        print(f"reader warnings: {len(rr.warnings)} (first: {rr.warnings[0]})")
    print(f"classifier: {result['classifier_version']} ({classifier_rule(classifier).describe()})")
    print(format_table(rows))
    sys.stdout.flush()
    if as_json:
        print(json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qumem_pipeline.eval.segmentation", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--format", choices=FORMATS, default=None, help="default: auto-detect")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--artifact", default=None, help="continuity artifact dir (default: committed one)")
    ap.add_argument("--device", default=None, help="cpu | cuda (default: auto)")
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args(argv)
    clf = None
    if args.artifact or args.device:
        from qumem_pipeline.episodes.continuity import ContinuityClassifier

        clf = ContinuityClassifier.load(args.artifact, device=args.device)
    run_segmentation_eval(args.path, args.format, args.json, classifier=clf, batch_size=args.batch_size,
                          device=args.device)
    return 0
