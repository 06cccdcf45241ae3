"""Digest of every query strategy's output and requests on the scripted test cases (qumem, topk with and
without Psi, repaired/quarantined outputs, adamem's two-round research loop): states, quarantine, stats
and every LLM request (messages, schema, max_tokens). Equal digests = byte-identical behaviour.

    python bench/strategy_outputs_digest.py [--out OUT.json] [--json]   # run on two checkouts, compare `sha256`
    python bench/strategy_outputs_digest.py OUT.json                    # the same as --out OUT.json

Run from the repository root. `--out` writes the digested JSON itself (to diff two checkouts' outputs);
the last stdout line is always one JSON object (`sha256`, `requests` per case), as before `--json`
existed, so an older checkout's output compares with this one's.
"""
import argparse
import hashlib
import json
import sys
from datetime import datetime, timezone

AT = datetime(2024, 5, 1, tzinfo=timezone.utc)


def digest() -> dict:
    sys.path[:0] = [".", "tests"]
    import test_query_state as T
    from tests import adamem_data as data
    try:
        from qumem_pipeline.query.strategies.registry import infer_user_states
        from qumem_pipeline.query.strategies.adamem.retriever import AdaMemRetriever, UserBundle
    except ImportError:
        from qumem_pipeline.query.strategies.qumem import infer_user_states
        from qumem_pipeline.query.strategies.adamem.strategy import AdaMemRetriever
        from qumem_pipeline.query.strategies.adamem.retriever import UserBundle
    from qumem_pipeline.embedding.minilm import Embedder
    Query = T.Query

    class Rec(T.ScriptedLLM):
        def generate(self, requests):
            for r in requests:
                self.prompts.append([r.request_id, r.messages, r.json_schema, r.max_tokens, r.schema_name])
            return super().generate(requests)

    out = {}

    def dump(name, o, llm):
        out[name] = {"states": o.states.write_ndjson(), "q": o.quarantine.write_ndjson(), "stats": o.stats,
                     "prompts": llm.prompts}

    qs = [Query("q1", "alice", "Where should I eat?", 100, "dinner"), Query("q2", "alice", "Dinner idea?", 10)]
    for strat in ("qumem", "topk"):
        for respond in (False, True):
            script = dict(T.GOOD); script["psi"] = lambda r: json.dumps({"answer": "veg place"})
            llm = Rec(script); llm.prompts = []
            dump(f"{strat}-{respond}", infer_user_states(qs, llm, T.ListRetriever(T.MEMS), strategy=strat, k=5,
                                                         respond=respond, created_at=AT), llm)
    bad = dict(T.GOOD); bad["a2"] = lambda r: '{"queries": [{"query": "x", "stores": ["nonsense"]}'; bad["a3"] = lambda r: "nope"
    llm = Rec(bad); llm.prompts = []
    dump("bad", infer_user_states(qs, llm, T.ListRetriever(T.MEMS), created_at=AT), llm)
    emb = Embedder.load(device="cpu")
    bundle = UserBundle.build(data.USER, data.turns(), data.memories(), emb, episodes=data.episodes())

    def research(cite, sufficient=True, follow_up=""):
        return lambda r: json.dumps({"facts": [{"statement": "x", "memory_ids": cite}], "preference_trajectory": [],
                                     "insights": [], "sufficient": sufficient, "follow_up": follow_up})
    llm = Rec({"research1": research(["M1", "M2"], False, "Snorlaxia stitches"), "research2": research(["M1", "M99"], False, "more"),
               "working": lambda r: json.dumps({"answer": "short"})}); llm.prompts = []
    aq = [Query("q1", data.USER, "When did Caroline go to the adoption meeting?", 3), Query("q2", data.USER, "How is Snorlaxia?", 11)]
    dump("adamem", infer_user_states(aq, llm, AdaMemRetriever({data.USER: bundle}, emb), strategy="adamem", k=10,
                                     created_at=AT), llm)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_path", nargs="?", default=None, metavar="OUT.json", help="the same as --out")
    ap.add_argument("--out", default=None, help="write the digested JSON here")
    ap.add_argument("--json", action="store_true", help="the last stdout line is one JSON object (always the case)")
    args = ap.parse_args(argv)
    if args.out and args.out_path and args.out != args.out_path:
        ap.error("give the output path once: --out OUT.json or OUT.json")
    out_path = args.out or args.out_path
    out = digest()
    s = json.dumps(out, sort_keys=True, default=str)
    if out_path:
        with open(out_path, "w") as f:
            f.write(s)
    print(json.dumps({"sha256": hashlib.sha256(s.encode()).hexdigest(),
                      "requests": {k: len(v["prompts"]) for k, v in out.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
