"""AdaMem's BM25 index on ``bm25s`` (``adamem.lexical.BM25Index``) against the hand-written Python
loop it replaced (kept verbatim as ``tests/bm25_reference.py``): same rankings, and which is faster
for what the retriever does (one index per user per query batch, then one backoff per question).

    python bench/bm25_lexical.py [--repeats 3] [--json]

Rankings are compared on the lexical tests' texts (tests/adamem_data.py plus the rare word of
tests/test_adamem_lexical.py) and on every LoCoMo dev conversation (its turns as documents, its
questions as queries): for each query the full ranking of every document with a positive score
(``search``), and the salient-word ``backoff`` top 10 with as_of at mid-conversation. Timing: one
build plus one backoff per question (the retriever's pattern) and, apart, plus one full-question
search per question; best of ``--repeats``, the two implementations interleaved. Prints one JSON
object as the last line.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qumem_pipeline.query.strategies.adamem.lexical import BM25Index as Lib  # noqa: E402
from tests.bm25_reference import BM25Index as Ref  # noqa: E402

IMPLS = {"hand_written": Ref, "bm25s": Lib}


def corpora() -> list[tuple[str, list[str], list[str]]]:
    from qumem_pipeline.runtime.datasets import shared_datasets_dir
    from tests import adamem_data

    rare = "We finally named the new sourdough starter Brembleworth, it bubbles every morning."
    qs = ["Did the adoption agency mention Brembleworth?", "Does the adoption agency know about Brembleworth yet?",
          "red apple pie", "the of and", "sky"] + list(adamem_data.TEXTS)
    out = [("tests", adamem_data.TEXTS + [rare], qs)]
    dev = shared_datasets_dir() / "locomo" / "locomo_dev5.json"
    if dev.is_file():
        for sample in json.loads(dev.read_text()):
            conv = sample["conversation"]
            texts = [t.get("text", "") for k, v in conv.items() if k.startswith("session_") and isinstance(v, list)
                     for t in v]
            out.append((sample["sample_id"], texts, [q["question"] for q in sample["qa"]]))
    return out


def compare(name: str, texts: list[str], queries: list[str]) -> dict:
    pos = list(range(len(texts)))
    ref, lib = (cls.build([str(i) for i in pos], texts, pos) for cls in (Ref, Lib))
    same_rank = same_backoff = same_terms = 0
    max_rel = 0.0
    for q in queries:
        a, b = ref.search(q, len(texts)), lib.search(q, len(texts))
        same_rank += [d for d, _, _ in a] == [d for d, _, _ in b]
        if a and len(a) == len(b):
            sa, sb = np.array([s for _, s, _ in a]), np.array([s for _, s, _ in b])
            max_rel = max(max_rel, float(np.max(np.abs(sa - sb) / sa)))
        same_terms += ref.salient_terms(q) == lib.salient_terms(q)
        same_backoff += [d for d, _, _ in ref.backoff(q, 10, len(texts) // 2)] == \
            [d for d, _, _ in lib.backoff(q, 10, len(texts) // 2)]
    return {"corpus": name, "docs": len(texts), "queries": len(queries), "same_full_ranking": same_rank,
            "same_salient_terms": same_terms, "same_backoff_hits": same_backoff, "max_rel_score_diff": max_rel}


def timing(texts: list[str], queries: list[str], repeats: int, full_search: bool) -> dict[str, float]:
    pos, ids = list(range(len(texts))), [str(i) for i in range(len(texts))]
    best = {k: float("inf") for k in IMPLS}
    for _ in range(repeats):
        for k, cls in IMPLS.items():
            t0 = time.perf_counter()
            index = cls.build(ids, texts, pos)
            for q in queries:
                index.backoff(q, 10)
                if full_search:
                    index.search(q, 10)
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cs = corpora()
    res: dict = {"rankings": [compare(*c) for c in cs]}
    res["all_equal"] = all(r["same_full_ranking"] == r["same_backoff_hits"] == r["same_salient_terms"] == r["queries"]
                           for r in res["rankings"])
    for label, full in (("build_plus_backoff_per_question", False), ("build_plus_backoff_and_search", True)):
        per = [(n, len(t), timing(t, q, args.repeats, full)) for n, t, q in cs]
        tot = {k: sum(s[k] for _, _, s in per) for k in IMPLS}
        res[label] = {"per_corpus": [{"corpus": n, "docs": d, **{f"seconds_{k}": round(v, 4) for k, v in s.items()},
                                      "speedup": round(s["hand_written"] / s["bm25s"], 2)} for n, d, s in per],
                      "total_seconds_hand_written": round(tot["hand_written"], 3),
                      "total_seconds_bm25s": round(tot["bm25s"], 3),
                      "bm25s_speedup": round(tot["hand_written"] / tot["bm25s"], 2)}
    print(json.dumps(res, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
