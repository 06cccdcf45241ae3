"""Continuity classifier throughput: pipeline pairs/s vs raw model forward pairs/s.

    python bench/classifier_throughput.py [--n 2000] [--batch-size 64] [--device auto] [--json]

"pipeline" = ``ContinuityClassifier.predict_same_proba`` end to end (tokenise, length-bucket, pad,
forward, sigmoid, scatter back). "raw" = the same model's forward only, on the same pre-tokenised,
padded, length-bucketed batches, in the same run. ratio = pipeline / raw (target >= 0.8).
forwards_per_pair = rows passed through the model's forward per pair on one more, untimed pipeline
pass (a pre-hook on the model counts them; 1.0 = every pair classified by exactly one forward row),
forward_calls = the forward calls of that pass.
Pairs: adjacent utterance pairs of TIAGE test (repeated up to --n), or generated sentences when the
shared datasets are absent. With --json the last printed line is one JSON object.

--histories adds what classifying each history in calls of its own costs (the episodes stage does, so a
user's P(same) never depends on the other users of its run): P(same) for every dialogue of TIAGE test
(else the generated calib dialogues) one dialogue at a time (``ContinuityClassifier.history_signals``,
signals the rule needs: P(same) and embeddings) against the same pairs and texts in one pooled call
each, best of --repeats, in the same run: ``per_history_ratio`` = pooled / per history.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from qumem_pipeline.episodes.continuity import ContinuityClassifier  # noqa: E402


def tiage_test_histories() -> list[list[str]] | None:
    """TIAGE test's dialogues as utterance lists, or None when the shared datasets are absent."""
    from qumem_pipeline.runtime.datasets import tiage_path

    path = tiage_path("test")
    if not path.is_file():
        return None
    from qumem_pipeline.episodes.dialogues import read_dialogues

    return [list(d.utterances) for d in read_dialogues(path, "tiage").dialogues]


def make_pairs(n: int, seed: int = 0) -> tuple[list[tuple[str, str]], str]:
    histories = tiage_test_histories()
    if histories is not None:
        base = [(h[i], h[i + 1]) for h in histories for i in range(len(h) - 1)]
        src = f"TIAGE test pairs ({len(base)} unique)"
    else:
        rng = random.Random(seed)
        words = ("i like my dog we went hiking last weekend the weather was great do you cook "
                 "pasta tonight work is busy my sister moved to alaska music guitar lessons").split()
        base = [(" ".join(rng.choices(words, k=rng.randint(4, 20))),
                 " ".join(rng.choices(words, k=rng.randint(4, 20)))) for _ in range(1000)]
        src = "generated pairs (TIAGE absent)"
    pairs = (base * (n // max(1, len(base)) + 1))[:n]
    return pairs, src


def count_forwards(clf: ContinuityClassifier, fn) -> tuple[int, int]:
    """Run fn with a pre-hook on the classifier's model: (forward calls, rows through them)."""
    calls = rows = 0

    def hook(_module, inputs):
        nonlocal calls, rows
        calls += 1
        rows += int(inputs[0].shape[0])

    handle = clf.net.register_forward_pre_hook(hook)
    try:
        fn()
    finally:
        handle.remove()
    return calls, rows


def per_history_cost(clf: ContinuityClassifier, batch_size: int, repeats: int, once) -> dict:
    """Seconds for the rule's signals of every dialogue one at a time (the product's path) against pooled calls."""
    histories, src = tiage_test_histories(), "TIAGE test"
    if histories is None:
        from qumem_pipeline.episodes.continuity.generated_dialogues import generated_dialogues

        histories = [list(d.utterances) for d in generated_dialogues("calib")]
        src = "generated calib dialogues (TIAGE absent)"
    pairs = [(h[i], h[i + 1]) for h in histories for i in range(len(h) - 1)]
    emb = clf.rule.needs_embeddings

    def pooled():
        clf.predict_same_proba(pairs, batch_size)
        if emb:
            clf.history_embeddings(histories)

    t_one = t_pool = float("inf")
    for _ in range(repeats):
        t_one = min(t_one, once(lambda: clf.history_signals(histories, batch_size)))
        t_pool = min(t_pool, once(pooled))
    return {"histories": len(histories), "history_pairs": len(pairs), "history_source": src,
            "history_embeddings": emb, "per_history_s": round(t_one, 3), "pooled_s": round(t_pool, 3),
            "per_history_ratio": round(t_pool / t_one, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats; best is reported")
    ap.add_argument("--artifact", default=None)
    ap.add_argument("--histories", action="store_true", help="also: per-history calls against pooled ones")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    clf = ContinuityClassifier.load(args.artifact, device=args.device)
    pairs, src = make_pairs(args.n)
    # warm-up (allocator, kernels) on a slice
    clf.predict_same_proba(pairs[: min(len(pairs), 4 * args.batch_size)], batch_size=args.batch_size)
    batches = clf.prepare(pairs, args.batch_size)
    clf.raw_forward(batches[:2])

    def once(fn) -> float:
        if clf.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if clf.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    # alternate raw / pipeline repeats so both see the same machine state; keep the best of each
    t_raw = t_pipe = float("inf")
    for _ in range(args.repeats):
        t_raw = min(t_raw, once(lambda: clf.raw_forward(batches)))
        t_pipe = min(t_pipe, once(lambda: clf.predict_same_proba(pairs, batch_size=args.batch_size)))
    n = len(pairs)
    forward_calls, forward_rows = count_forwards(clf, lambda: clf.predict_same_proba(pairs, batch_size=args.batch_size))
    res = {
        "pairs": n,
        "source": src,
        "device": str(clf.device),
        "dtype": "bf16-autocast" if clf.use_bf16 else "float32",
        "batch_size": args.batch_size,
        "threads": torch.get_num_threads(),
        "version": clf.version,
        "pipeline_s": round(t_pipe, 4),
        "raw_s": round(t_raw, 4),
        "pairs_per_s": round(n / t_pipe, 1),
        "raw_pairs_per_s": round(n / t_raw, 1),
        "ratio": round(t_raw / t_pipe, 3),
        # counted on an untimed pipeline pass: rows through the model's forward per pair, and forward calls
        "forwards_per_pair": round(forward_rows / n, 3) if n else None,
        "forward_calls": forward_calls,
    }
    print(f"continuity classifier throughput — {n} pairs from {src}; device {res['device']} "
          f"({res['dtype']}), batch {args.batch_size}, threads {res['threads']}")
    print(f"{'path':<12} {'seconds':>9} {'pairs/s':>10}")
    print(f"{'pipeline':<12} {t_pipe:9.3f} {res['pairs_per_s']:10.1f}")
    print(f"{'raw forward':<12} {t_raw:9.3f} {res['raw_pairs_per_s']:10.1f}")
    print(f"ratio pipeline/raw = {res['ratio']:.3f} (target >= 0.8)")
    print(f"model forwards per pair = {res['forwards_per_pair']} ({forward_calls} forward calls for {n} pairs)")
    if args.histories:
        res.update(per_history_cost(clf, args.batch_size, args.repeats, once))
        print(f"{res['histories']} histories ({res['history_pairs']} pairs, {res['history_source']}): one at a time "
              f"{res['per_history_s']:.2f} s, pooled {res['pooled_s']:.2f} s, ratio {res['per_history_ratio']:.3f}")
    if args.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
