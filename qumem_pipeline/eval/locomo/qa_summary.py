"""The QA report's per-strategy scores and ledger totals, and the table the CLI prints."""

import json
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from qumem_pipeline.eval.locomo.qa_contexts import QAQuestion
from qumem_pipeline.eval.locomo.qa_prompt import HEADLINE


def _ledger_totals(rows: list[dict]) -> dict:
    out: dict = defaultdict(lambda: {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0, "errors": 0})
    for r in rows:
        t = out[r.get("strategy") or "?"]
        t["calls"] += 1
        t["prompt_tokens"] += int(r.get("prompt_tokens") or 0)
        t["completion_tokens"] += int(r.get("completion_tokens") or 0)
        t["errors"] += r.get("status") != "ok"
    return dict(out)


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(float(np.mean(xs)), 4) if xs else None


PAIRED_BASELINE = "topk_turns"
BOOTSTRAP_RESAMPLES = 2000


def paired_difference(a: Sequence[float], b: Sequence[float], *, resamples: int = BOOTSTRAP_RESAMPLES,
                      seed: int = 0, clusters: Sequence | None = None) -> dict:
    """Mean of a - b over the same questions, with a seeded 95 % percentile bootstrap interval.

    Why: a few dozen questions per run make F1 gaps of a few hundredths noise; the interval says
    whether a gap is one (it straddles 0) before anyone reads a ranking into it. ``clusters`` (one label
    per question) resamples whole clusters instead: PersonaMem's contexts ask the same questions, and
    counting a question asked twice as two independent draws would narrow the interval falsely."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    if d.size == 0:
        return {"n": 0, "delta": None, "ci95": None}
    rng = np.random.default_rng(seed)
    if clusters is None:
        means = d[rng.integers(0, d.size, size=(resamples, d.size))].mean(axis=1)
    else:
        labels, inverse = np.unique(np.asarray([str(c) for c in clusters]), return_inverse=True)
        sums, counts = np.bincount(inverse, weights=d), np.bincount(inverse).astype(float)
        pick = rng.integers(0, labels.size, size=(resamples, labels.size))
        means = sums[pick].sum(axis=1) / counts[pick].sum(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    out = {"n": int(d.size), "delta": round(float(d.mean()), 4), "ci95": [round(float(lo), 4), round(float(hi), 4)]}
    if clusters is not None:
        out["clusters"] = int(labels.size)
    return out


def paired_against(selected: Sequence[QAQuestion], run: Sequence[str], done: dict,
                   baseline: str = PAIRED_BASELINE) -> dict:
    """strategy -> its F1 minus ``baseline``'s on the category 1-4 questions both answered."""
    if baseline not in run:
        return {}
    out = {}
    for s in run:
        if s == baseline:
            continue
        keys = [q.key for q in selected if q.category in HEADLINE and (s, q.key) in done and (baseline, q.key) in done]
        out[s] = paired_difference([done[(s, k)]["f1"] for k in keys], [done[(baseline, k)]["f1"] for k in keys])
    return out


def build_report(selected: Sequence[QAQuestion], run: Sequence[str], done: dict, skipped: dict,
                 requested: Sequence[str]) -> dict:
    """``qa.<strategy>``: f1 / bleu1 over categories 1-4, per category, and category 5 apart."""
    from qumem_pipeline.ingest.importers.locomo import CATEGORY_NAMES

    by_cat: dict = defaultdict(int)
    for q in selected:
        by_cat[q.category] += 1
    qa: dict = {}
    for s in run:
        rows = [done[(s, q.key)] for q in selected if (s, q.key) in done]
        head = [r for r in rows if r["category"] in HEADLINE]
        adv = [r for r in rows if r["category"] == 5]
        per_cat = {}
        for c in HEADLINE:
            rc = [r for r in head if r["category"] == c]
            if rc:
                per_cat[str(c)] = {"name": CATEGORY_NAMES.get(c), "n": len(rc), "f1": _mean(r["f1"] for r in rc),
                                   "bleu1": _mean(r["bleu1"] for r in rc)}
        if adv:
            per_cat["5"] = {"name": CATEGORY_NAMES.get(5), "n": len(adv), "abstain": _mean(r["abstain"] for r in adv)}
        qa[s] = {
            "f1": _mean(r["f1"] for r in head), "bleu1": _mean(r["bleu1"] for r in head), "n": len(head),
            "per_category": per_cat,
            "adversarial": {"n": len(adv), "abstain": _mean(r["abstain"] for r in adv)},
            "no_answer": sum(1 for r in rows if r["prediction"] is None),
            "state_failed": sum(1 for r in rows if r.get("state_ok") is False),
            "not_answered": len(selected) - len(rows),
            "mean_context_words": _mean(r.get("context_words") for r in rows),
            "answer_prompt_tokens": sum(int(r.get("answer_prompt_tokens") or 0) for r in rows),
            "answer_completion_tokens": sum(int(r.get("answer_completion_tokens") or 0) for r in rows),
        }
    return {
        "qa": qa,
        "strategies": list(run),
        "strategies_requested": list(requested),
        "n_questions": sum(v for c, v in by_cat.items() if c in HEADLINE),
        "n_questions_adversarial": by_cat.get(5, 0),
        "questions_by_category": {str(c): n for c, n in sorted(by_cat.items(), key=lambda x: (x[0] is None, x[0]))},
        "scoring": ("token F1 and BLEU-1 over categories 1-4 (LoCoMo normalisation and per-category F1 rule, "
                    "see qa_metrics); category 5: share of answers that abstain (LoCoMo's rule)"),
        "skipped": skipped,
        "f1_vs_topk_turns": paired_against(selected, run, done),
        # the product's strategy against each other one: its changes (qumem_hybrid) and the top-k baselines
        "f1_vs_qumem": paired_against(selected, run, done, baseline="qumem"),
        # AdaMem's strategy against the others: which of the candidates for the product default is ahead
        "f1_vs_adamem": paired_against(selected, run, done, baseline="adamem"),
    }


def format_table(report: dict) -> str:
    cats = ["1", "2", "3", "4"]
    lines = [f"LoCoMo QA ({report.get('dataset')}, {report['n_questions']} questions cat 1-4 + "
             f"{report['n_questions_adversarial']} cat 5; model {report.get('model')}; topk budget "
             f"{report.get('words_budget')} words)",
             f"  {'strategy':<14}{'F1':>7}{'BLEU-1':>8}" + "".join(f"{'F1 c' + c:>8}" for c in cats)
             + f"{'c5 abst':>9}{'n':>5}{'ctx words':>10}"]

    def f(v) -> str:
        return "n/a" if v is None else f"{v:.3f}"

    for s, v in report["qa"].items():
        pc = v["per_category"]
        lines.append(f"  {s:<14}{f(v['f1']):>7}{f(v['bleu1']):>8}"
                     + "".join(f"{f(pc.get(c, {}).get('f1')):>8}" for c in cats)
                     + f"{f(v['adversarial']['abstain']):>9}{v['n'] + v['adversarial']['n']:>5}"
                     + f"{(v['mean_context_words'] or 0):>10.0f}")
    for baseline in (PAIRED_BASELINE, "qumem", "adamem"):
        paired = report.get(f"f1_vs_{baseline}") or {}
        if not paired:
            continue
        lines.append(f"F1 minus {baseline}'s on the same questions (95 % bootstrap interval, "
                     f"{BOOTSTRAP_RESAMPLES} resamples, seed 0):")
        for s, v in paired.items():
            ci = v["ci95"]
            lines.append(f"  {s:<14}{f(v['delta']):>7}  [{f(ci[0]) if ci else 'n/a'}, {f(ci[1]) if ci else 'n/a'}]"
                         f"  n={v['n']}")
    lines.append(f"skipped: {json.dumps(report['skipped'])}")
    used = report.get("llm_calls", {}).get("by_strategy_this_run") or {}
    if used:
        lines.append("LLM calls behind this run's answers (replayed or sent):")
        lines.append(f"  {'strategy':<14}{'calls':>7}{'errors':>8}{'salvaged':>10}{'prompt tok':>12}{'compl. tok':>12}")
        for s, v in used.items():
            lines.append(f"  {s:<14}{v['calls']:>7}{v['errors']:>8}{v['salvaged']:>10}{v['prompt_tokens']:>12}{v['completion_tokens']:>12}")
    lines.append(f"LLM calls (ledger, every run): {json.dumps(report.get('llm_calls', {}).get('ledger_by_strategy', {}))}")
    lines.append(f"report: {report.get('html')}; checkpoint: {report.get('checkpoint')}; wall time {report.get('wall_s')}s")
    return "\n".join(lines)
