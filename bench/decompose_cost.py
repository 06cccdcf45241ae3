#!/usr/bin/env python
"""Decomposition cost on the LoCoMo dev file, in the paper's Table 4 units; the paper's QUMem and Mem0 figures beside it.

    python bench/decompose_cost.py [--data PATH] [--sample-episodes 4] [--json]
    python bench/decompose_cost.py --smoke --json   # smallest configuration: 1 sampled episode, 32-token budget

Every figure under the top-level keys is computed in this run with SmolLM2's tokenizer; the ones named
`*_projected` are projections (below). The peer figures (`references`: the QUMem paper's Table 4, its
QUMem and Mem0 rows, with their own models and tokenizers) come from elsewhere, are printed with their
source, and are never divided into a ratio. `first_episode` is the cost of the first episode alone (the
first LoCoMo session with `--episodes sessions`).

Episodes: the pipeline's own (continuity classifier; `--episodes sessions` for one per LoCoMo
session). Each conversation is decomposed once, from
speaker_a's side (the pipeline runs it once per participant: same calls per 100 turns).

Counts: `planned_llm_calls` / `planned_calls_per_100_turns` are the stage's first-attempt calls, three
per episode (a formula, not a count of sent calls: the stage's one retry after unusable output is not
included). Prompt tokens are exact (the chat template rendered and tokenized with the model's own
tokenizer) for every planned call. Completion tokens are measured by running the local backend on the
stage's own first-attempt requests (`decompose_requests`: `--max-tokens` is the configured budget, the
request's cap is twice that) for the first `--sample-episodes` episodes, and their mean per call is
projected to every call: `completion_tokens_per_turn_projected` and `tokens_per_turn_projected`, from
`sampled_calls` calls (equal to `planned_llm_calls` with `--sample-episodes all`: then measured on every
call; ~1 h on 2 CPU cores). With nothing sampled (`--sample-episodes 0`) they, and
`completion_tokens_per_call`, are null. Prefill a prefix cache would compute: per episode the first
call's whole prompt plus, for the other two calls, what follows the shared prefix (exact token-level
common prefix of the three prompts).

Also prints the local backend's throughput on this CPU, batched vs one request at a time.
"""

import argparse
import json
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qumem_pipeline.memories.decompose import MEMORY_TYPES, build_messages, coerce_episode, decompose_requests  # noqa: E402
from qumem_pipeline.ingest.importers.locomo import parse_locomo_datetime  # noqa: E402

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "datasets" / "locomo" / "locomo_dev5.json"
# Peer figures, not measured by this bench: printed as references with their source, never divided into a ratio.
REFERENCES = {
    "qumem_paper": {
        "source": "QUMem paper (arXiv:2608.16168v1), Table 4 (PersonaMem), QUMem row; its own model and tokenizer",
        "calls_per_100_turns": 81.4, "tokens_per_turn": 1221.2,
    },
    "mem0_per_qumem_paper": {
        "source": "QUMem paper (arXiv:2608.16168v1), Table 4 (PersonaMem), Mem0 row; the paper's model and tokenizer",
        "calls_per_100_turns": 380.7, "tokens_per_turn": 6401.9,
    },
}


def locomo_episodes(path: Path) -> list[dict]:
    data = json.loads(path.read_text(encoding="utf-8"))
    episodes = []
    for sample in data:
        conv = sample["conversation"]
        a = conv.get("speaker_a")
        sessions = sorted(
            (int(k.split("_")[1]), v) for k, v in conv.items()
            if k.startswith("session_") and k.count("_") == 1 and isinstance(v, list)
        )
        turn_index = 0
        for n, turns in sessions:
            iso = parse_locomo_datetime(conv.get(f"session_{n}_date_time") or "")
            ts = datetime.fromisoformat(iso.replace("Z", "+00:00")) if iso else None
            ep_turns = []
            for t in turns:
                text = t.get("text") or ""
                if t.get("blip_caption"):
                    text += f" [shares a photo: {t['blip_caption']}]"
                ep_turns.append({"turn_index": turn_index, "role": "user" if t.get("speaker") == a else "other",
                                 "speaker": t.get("speaker"), "text": text, "timestamp": ts})
                turn_index += 1
            episodes.append({"user_id": str(sample.get("sample_id")), "episode_id": f"{sample.get('sample_id')}-s{n}",
                             "turns": ep_turns})
    return episodes


def prompt_stats(episodes: list[dict], tokenizer) -> list[dict]:
    rows = []
    for raw in episodes:
        ep = coerce_episode(raw)
        seqs = [
            tokenizer.apply_chat_template(build_messages(ep, t), tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
            for t in MEMORY_TYPES
        ]
        shared = 0
        for toks in zip(*seqs):
            if len(set(toks)) != 1:
                break
            shared += 1
        rows.append({"episode_id": ep.episode_id, "turns": len(ep.turns), "prompt_tokens": [len(s) for s in seqs],
                     "shared_prefix": shared})
    return rows


def cost(rows: list[dict], completion: list[int]) -> dict:
    """Planned calls and exact prompt tokens of `rows`; completion tokens projected from the `completion`
    tokens of the sampled calls (their mean per call times the planned calls), None when none was sampled."""
    turns = sum(r["turns"] for r in rows)
    calls = 3 * len(rows)  # the stage's first-attempt calls: one per memory type per episode
    prompt = sum(sum(r["prompt_tokens"]) for r in rows)
    computed = sum(sum(r["prompt_tokens"]) - 2 * r["shared_prefix"] for r in rows)
    projected = statistics.fmean(completion) * calls if completion else None
    return {
        "episodes": len(rows),
        "turns": turns,
        "planned_llm_calls": calls,
        "planned_calls_per_100_turns": 100.0 * calls / turns,
        "prompt_tokens_per_turn": prompt / turns,
        "sampled_calls": len(completion),
        "completion_tokens_per_turn_projected": None if projected is None else projected / turns,
        "tokens_per_turn_projected": None if projected is None else (prompt + projected) / turns,
        "computed_prefill_tokens_per_turn": computed / turns,
        "prefill_saved_fraction": 1 - computed / prompt,
    }


def classifier_episodes(path: Path) -> list[dict]:
    """The pipeline's own episodes: LoCoMo import -> validation -> continuity classifier (speaker_a users)."""
    import polars as pl

    from qumem_pipeline.episodes.continuity import ContinuityClassifier
    from qumem_pipeline.episodes.segmentation import build_episodes_for_users
    from qumem_pipeline.ingest.importers.locomo import import_locomo
    from qumem_pipeline.ingest.validate import validate

    turns = validate(import_locomo(str(path))).turns
    data = json.loads(path.read_text(encoding="utf-8"))
    users = {}
    for sample in data:  # one user per conversation (speaker_a), as with session episodes
        uid = next(u for u in turns["user_id"].unique().to_list()
                   if u.startswith(f"{sample['sample_id']}-") and
                   turns.filter((pl.col("user_id") == u) & (pl.col("role") == "user"))["speaker"].head(1).to_list()
                   == [sample["conversation"].get("speaker_a")])
        users[uid] = turns.filter(pl.col("user_id") == uid)
    clf = ContinuityClassifier.load()
    by_user, _ = build_episodes_for_users(users, clf.predict_same_proba, rule=clf.rule,
                                          similarity=clf.pair_cosine, embed_histories=clf.history_embeddings,
                                          classifier_version=clf.version)
    out = []
    for uid, eps in by_user.items():
        rows = {r["turn_index"]: r for r in users[uid].iter_rows(named=True)}
        for e in eps.iter_rows(named=True):
            out.append({"user_id": uid, "episode_id": e["episode_id"], "turns": [rows[t] for t in e["turn_ids"]]})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    ap.add_argument("--sample-episodes", default="4", help="episodes to decompose for completion tokens ('all' or N)")
    ap.add_argument("--max-tokens", type=int, default=384,
                    help="the stage's configured budget; its requests are capped at twice this (decompose_requests)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--no-throughput", action="store_true", help="skip the batched vs one-at-a-time comparison")
    ap.add_argument("--episodes", choices=["sessions", "classifier"], default="classifier",
                    help="episode boundaries: the pipeline's continuity classifier (default) or LoCoMo sessions")
    ap.add_argument("--smoke", action="store_true",
                    help="smallest configuration: session episodes, 1 sampled episode, a 32-token budget (64-token "
                         "cap), no throughput")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.episodes, args.sample_episodes, args.max_tokens, args.no_throughput = "sessions", "1", 32, True

    data = Path(args.data)
    if not data.exists():
        print(f"LoCoMo file not found: {data}", file=sys.stderr)
        return 2
    from qumem_pipeline.llm import make_backend

    t0 = time.perf_counter()
    backend = make_backend("local", batch_size=args.batch_size)
    load_s = time.perf_counter() - t0
    episodes = classifier_episodes(data) if args.episodes == "classifier" else locomo_episodes(data)
    rows = prompt_stats(episodes, backend.tokenizer)

    n_sample = len(episodes) if args.sample_episodes == "all" else min(int(args.sample_episodes), len(episodes))
    sample_reqs = decompose_requests(episodes[:n_sample], max_tokens=args.max_tokens)  # what the stage sends first
    t1 = time.perf_counter()
    batched = backend.generate(sample_reqs)
    batched_s = time.perf_counter() - t1
    completion = [r.completion_tokens for r in batched]
    completion_per_call = statistics.fmean(completion) if completion else None
    ok = sum(1 for r in batched if r.ok)
    # exact prompt counts must agree with what the backend itself fed the model
    assert [r.prompt_tokens for r in batched] == [p for row in rows[:n_sample] for p in row["prompt_tokens"]]

    throughput = {}
    if not args.no_throughput and sample_reqs:
        seq_reqs = sample_reqs[: min(len(sample_reqs), 6)]
        bat_tok = sum(r.completion_tokens for r in batched)
        t2 = time.perf_counter()
        single = [backend.generate([r])[0] for r in seq_reqs]
        single_s = time.perf_counter() - t2
        t3 = time.perf_counter()
        again = backend.generate(seq_reqs)
        again_s = time.perf_counter() - t3
        throughput = {
            "batched_requests": len(sample_reqs),
            "batched_out_tok_per_s": bat_tok / batched_s,
            "subset_requests": len(seq_reqs),
            "subset_one_at_a_time_out_tok_per_s": sum(r.completion_tokens for r in single) / single_s,
            "subset_batched_out_tok_per_s": sum(r.completion_tokens for r in again) / again_s,
        }
        throughput["batched_speedup"] = throughput["subset_batched_out_tok_per_s"] / throughput["subset_one_at_a_time_out_tok_per_s"]

    full = cost(rows, completion)
    first = cost(rows[:1], completion[:3])  # the first episode's own three calls, when sampled
    result = {
        "data": data.name,
        "episodes_from": "continuity classifier" if args.episodes == "classifier" else "LoCoMo session boundaries",
        "model": backend.model_name,
        "tokenizer": backend.model_dir,
        "sample_episodes": n_sample,
        "sample_calls_ok": ok,
        "max_tokens_budget": args.max_tokens,
        "completion_tokens_per_call": completion_per_call,
        "model_load_s": load_s,
        **{k: v for k, v in full.items()},
        "first_episode": first,
        "throughput": throughput,
        "references": REFERENCES,
    }

    print(f"LoCoMo {data.name}: {full['episodes']} episodes ({result['episodes_from']}), {full['turns']} turns; "
          f"tokenizer {backend.model_name}; completion tokens measured on {n_sample} episodes "
          f"({len(completion)} calls, {ok} ok, "
          + (f"{completion_per_call:.1f}/call) and projected to every call" if completion else "none sampled: no projection)"))
    hdr = (f"{'':34}{'calls/100 turns':>16}{'prompt tok/turn':>16}{'compl tok/turn':>15}{'tokens/turn':>12}"
           f"{'prefill/turn':>13}   (calls planned; compl and tokens projected)")
    print(hdr)
    def line(name, c, p, o, tot, pf):
        fmt = lambda v: f"{v:.1f}" if isinstance(v, (int, float)) else ("n/a" if v is None else str(v))
        print(f"{name:34}{fmt(c):>16}{fmt(p):>16}{fmt(o):>15}{fmt(tot):>12}{fmt(pf):>13}")
    line("this pipeline, dev file", full["planned_calls_per_100_turns"], full["prompt_tokens_per_turn"],
         full["completion_tokens_per_turn_projected"], full["tokens_per_turn_projected"], full["computed_prefill_tokens_per_turn"])
    line("this pipeline, first episode", first["planned_calls_per_100_turns"], first["prompt_tokens_per_turn"],
         first["completion_tokens_per_turn_projected"], first["tokens_per_turn_projected"],
         first["computed_prefill_tokens_per_turn"])
    print(f"prefill a prefix cache computes: {full['computed_prefill_tokens_per_turn']:.1f} tok/turn; "
          f"prefix cache skips {100 * full['prefill_saved_fraction']:.0f}% of prompt tokens")
    print("references (not measured here; other models and tokenizers, so not comparable token for token):")
    paper, mem0 = REFERENCES["qumem_paper"], REFERENCES["mem0_per_qumem_paper"]
    line("  QUMem paper: QUMem", paper["calls_per_100_turns"], "-", "-", paper["tokens_per_turn"], "-")
    line("  QUMem paper: Mem0", mem0["calls_per_100_turns"], "-", "-", mem0["tokens_per_turn"], "-")
    for name, ref in REFERENCES.items():
        print(f"    {name}: {ref['source']}")
    if throughput:
        print(f"local backend on this CPU: batched {throughput['subset_batched_out_tok_per_s']:.1f} out tok/s vs one-at-a-time "
              f"{throughput['subset_one_at_a_time_out_tok_per_s']:.1f} ({throughput['batched_speedup']:.2f}x) on "
              f"{throughput['subset_requests']} requests; whole sample batched {throughput['batched_out_tok_per_s']:.1f} out tok/s")
    if args.json:
        print(json.dumps(result))
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
