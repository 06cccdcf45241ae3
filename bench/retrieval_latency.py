"""Retrieval stage latency per query (all of its planned sub-queries), stage-batched vs query-at-a-time,
in the same run, over the same indexes and requests.

Per-user, per-type indexes are built from random unit vectors (index contents do not change the cost of
an exact search); each request has `--subqueries` planned queries over random non-empty store subsets
and a random as_of. The cost includes embedding the sub-queries with the real MiniLM embedder (unless
`--fake-embedder`), faiss search with the as_of selector, and merge/de-dup.

- batched: all requests through one `execute_plans` call (one encode call, one search per
  (user, store), rows filtered by their own as_of), the same batch `--repeats` times. `execute_plans` hands back every
  query's results when the call returns, so each query's completion time within its batch is the batch's
  wall time: `batched_latency_ms` is the p50/p95 of those per-query completion times (over all queries of
  all batches). `batched_amortized_ms_per_query` (batch wall / queries in it) is cost, not latency.
- query-at-a-time: one `execute_plans` call per request, over the same requests as the batches;
  `query_at_a_time_ms` is p50/p95 over requests.
- Both modes time the same request set (one seed). Neither the embedder nor `execute_plans` caches
  embeddings or results, so repeating requests does not hit a result cache; to keep the first timed
  mode from paying one-off costs (lazy init, allocator, CPU caches), both modes are first warmed up
  on a separate warm-up request set (batched once, then each of its requests one at a time).
- `throughput_speedup`: query-at-a-time mean ms per query over batched amortized ms per query.

    python bench/retrieval_latency.py [--users 20] [--memories-per-user 300] [--queries 200] [--json]
    python bench/retrieval_latency.py --smoke --json   # smallest configuration (seconds)
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from qumem_pipeline.index import vector_store as vi  # noqa: E402
from qumem_pipeline.index.embeddings import DIM, embedding_schema  # noqa: E402
from qumem_pipeline.query.retrieval import PlannedQuery, RetrievalRequest, execute_plans  # noqa: E402
from qumem_pipeline.storage.layout import DataLayout  # noqa: E402

WORDS = ("trip plan dinner vegan window seat swim run knee doctor budget book piano lesson weekend flight "
         "hotel recipe garden dog cat meeting deadline report coffee tea prefer like moved started").split()


class FakeEmbedder:
    dim = DIM
    version = "fake@0"

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)

    def encode(self, texts, batch_size=128, progress=None):
        v = self.rng.normal(size=(len(texts), DIM)).astype(np.float32)
        return v / np.linalg.norm(v, axis=1, keepdims=True).clip(1e-9)


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q)) if xs else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, default=20)
    ap.add_argument("--memories-per-user", type=int, default=300)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--subqueries", type=int, default=3)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--fake-embedder", action="store_true", help="random query vectors: search + merge only")
    ap.add_argument("--device", default=None)
    ap.add_argument("--smoke", action="store_true", help="2 users x 30 memories, 10 queries, 2 batches")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.users, args.memories_per_user, args.queries, args.repeats = 2, 30, 10, 2

    rng = np.random.default_rng(0)
    if args.fake_embedder:
        emb = FakeEmbedder()
    else:
        from qumem_pipeline.embedding.minilm import Embedder

        emb = Embedder.load(device=args.device)

    tmp = tempfile.mkdtemp(prefix="qumem-retrieval-bench-")
    layout = DataLayout(tmp)
    users = [f"user-{u:04d}" for u in range(args.users)]
    t0 = time.perf_counter()
    for u in users:
        n = args.memories_per_user
        v = rng.normal(size=(n, DIM)).astype(np.float32)
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        df = pl.DataFrame(
            {
                "memory_id": [f"{u}-m{i}" for i in range(n)],
                "user_id": [u] * n,
                "type": [vi.MEMORY_TYPES[i % 3] for i in range(n)],
                "position": rng.integers(0, 1000, n).tolist(),
                "embedding": pl.Series(v, dtype=pl.Array(pl.Float32, DIM)),
                "embedding_model": [emb.version] * n,
            },
            schema=embedding_schema(DIM),
        )
        vi.build_and_write_user_indexes(layout, df, u)
    build_s = time.perf_counter() - t0
    store = vi.VectorStore(layout)
    for u in users:  # load once: the query-state stage keeps a user's indexes loaded for its queries
        store.user(u)

    def make_requests(seed):
        r = np.random.default_rng(seed)
        reqs = []
        for q in range(args.queries):
            plan = []
            for s in range(args.subqueries):
                types = [t for t in vi.MEMORY_TYPES if r.random() < 0.6] or [vi.MEMORY_TYPES[int(r.integers(3))]]
                text = " ".join(r.choice(WORDS, size=int(r.integers(6, 16))))
                plan.append(PlannedQuery(f"{text} ({q}.{s})", tuple(types)))
            reqs.append(RetrievalRequest(f"q{q}", users[int(r.integers(len(users)))], plan, int(r.integers(100, 1000))))
        return reqs

    warm = make_requests(99)[:8]  # warm-up of both modes on requests that are not timed
    execute_plans(warm, store, emb, args.k)
    for req in warm:
        execute_plans([req], store, emb, args.k)
    reqs = make_requests(0)  # the one request set both modes are timed on
    completion_ms, batch_wall_ms = [], []
    for _rep in range(args.repeats):
        t = time.perf_counter()
        results = execute_plans(reqs, store, emb, args.k)
        done = (time.perf_counter() - t) * 1000
        assert len(results) == len(reqs)
        batch_wall_ms.append(done)
        completion_ms.extend([done] * len(reqs))  # every query's results arrive when the call returns
    amortized = [w / args.queries for w in batch_wall_ms]
    single = []
    for req in reqs:
        t = time.perf_counter()
        execute_plans([req], store, emb, args.k)
        single.append((time.perf_counter() - t) * 1000)
    out = {
        "bench": "retrieval_latency",
        "users": args.users,
        "memories_per_user": args.memories_per_user,
        "queries": args.queries,
        "subqueries_per_query": args.subqueries,
        "k": args.k,
        "embedder": emb.version,
        "device": str(getattr(emb, "device", "n/a")),
        "faiss_gpu_build": vi.gpu_available(),
        "index_build_s": round(build_s, 2),
        "batched_latency_ms": {"p50": round(pct(completion_ms, 50), 3), "p95": round(pct(completion_ms, 95), 3),
                               "n_queries": len(completion_ms), "batches": args.repeats,
                               "batch_size": args.queries},
        "batched_amortized_ms_per_query": {"mean": round(float(np.mean(amortized)), 3),
                                           "min": round(min(amortized), 3), "max": round(max(amortized), 3)},
        "query_at_a_time_ms": {"p50": round(pct(single, 50), 3), "p95": round(pct(single, 95), 3),
                               "mean": round(float(np.mean(single)), 3), "n": len(single)},
    }
    out["throughput_speedup"] = round(out["query_at_a_time_ms"]["mean"]
                                      / max(out["batched_amortized_ms_per_query"]["mean"], 1e-9), 2)
    print(f"retrieval stage ({args.queries} queries x {args.subqueries} planned sub-queries, k={args.k}, "
          f"{args.users} users x {args.memories_per_user} memories, {out['embedder']} on {out['device']})")
    bl, am = out["batched_latency_ms"], out["batched_amortized_ms_per_query"]
    print(f"  stage-batched   : per-query latency p50 {bl['p50']:.2f} ms, p95 {bl['p95']:.2f} ms "
          f"({bl['n_queries']} queries in {args.repeats} batches of {args.queries}); "
          f"amortized cost {am['mean']:.3f} ms/query")
    print(f"  query-at-a-time : per-query latency p50 {out['query_at_a_time_ms']['p50']:.2f} ms, "
          f"p95 {out['query_at_a_time_ms']['p95']:.2f} ms")
    print(f"  throughput speedup of batching: {out['throughput_speedup']}x")
    if args.json:
        print(json.dumps(out))
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
