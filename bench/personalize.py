"""Bulk personalization (`personalize_job`, `qumem_pipeline/query/personalize.py`): a batch of queries over
many users through the fake OpenAI-compatible server (tests/fake_openai_server.py, a real local HTTP server
answering A1/A2/A3 from a script), all measured in one run.

Setup (not measured as personalization): `--users` users' tables are written directly through the product's
own writers, not by the main job (its classifier and per-episode decomposition would take hours at 1,000
users on this box): turns and memories via `DataLayout.replace_users`, memory embeddings via
`index.embeddings.embed_memories` with the real MiniLM embedder (unless `--fake-embedder`), FAISS indexes via
`index.vector_store.build_user_indexes` + `write_users_indexes` (what the `memory_embeddings` and
`memory_indexes` assets call). Each user has `--memories-per-user` memories, one per user turn, each citing its
turn. `--queries` queries go round-robin over the users with a random as_of_turn.

Measured, each on its own copy of the built tables (empty checkpoints, so every LLM call is paid):
- `batched`: the domain core, `personalize_batch` on the JSONL batch with the warehouse export (validation,
  table reads, stage-batched A1/A2/retrieval/A3, commits, export): wall, queries/s, and the seconds inside
  the strategy (`answering_s`).
- `dagster_job`: `personalize_job.execute_in_process` with run config on a fresh SQLite instance set up as
  `qumem` sets one up (bench/_instance.py), same batch, same resources. `orchestration_overhead` =
  (job wall - domain-core wall) / job wall, the domain-core wall being the `batched` run's;
  `orchestration_overhead_in_run` takes the domain seconds the job's own ops measured instead (same run:
  no LLM-server noise between two runs). Target <= 0.10.
- `one_at_a_time`: a seeded sample of `--one-at-a-time` queries, each answered alone by the same strategy
  (every stage a batch of one) over tables already loaded in memory, calls through the same checkpointing
  wrapper without a store: favourable to it (no per-query table reads or commits). Its queries/s is
  extrapolated to the whole batch (`extrapolated_wall_s` = queries / its rate); `speedup_throughput` =
  batched queries/s (full product path) / one-at-a-time queries/s, `speedup_answering` the same with the
  batched strategy seconds only.

    python bench/personalize.py --json                     # 1,000 users, 10,000 queries
    python bench/personalize.py --smoke --json             # 4 users, 24 queries (seconds)
"""

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import polars as pl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from fake_openai_server import RunningFakeServer  # noqa: E402
from qumem_pipeline.index import vector_store  # noqa: E402
from qumem_pipeline.index.embeddings import DIM, embed_memories  # noqa: E402
from qumem_pipeline.memories.call_ledger import CheckpointedLLM  # noqa: E402
from qumem_pipeline.query.personalize import personalize_batch  # noqa: E402
from qumem_pipeline.query.queries import read_queries, to_queries  # noqa: E402
from qumem_pipeline.query.retrievers import retriever_for  # noqa: E402
from qumem_pipeline.query.strategies.registry import get_strategy  # noqa: E402
from qumem_pipeline.storage.layout import DataLayout  # noqa: E402
from qumem_pipeline.storage.warehouse import Warehouse  # noqa: E402

TYPES = ("fact", "preference", "insight")
TOPICS = ("swimming", "a trip to Lisbon", "learning piano", "a vegan diet", "a new job", "their dog", "running",
          "a garden", "a book club", "saving money", "a knee injury", "coffee")
SCRIPT = {"model": "fake-model", "rules": [
    {"match": "information-need agent", "responses": [{"json": {"needs": [{"need": "recent plans", "why": "asked"}]}}]},
    {"match": "retrieval-planning agent", "responses": [{"json": {"queries": [{"query": "recent plans", "stores": ["fact", "preference"]}]}}]},
    {"match": "user-state inference agent", "responses": [{"json": {
        "facts": [{"statement": "The user has plans.", "memory_ids": ["M1"]}], "preference_trajectory": [],
        "insights": []}}]},
]}


class FakeEmbedder:
    """Random unit vectors (`--fake-embedder`): retrieval cost without the model."""

    dim, version, device = DIM, "fake@0", "cpu"

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)

    def encode(self, texts, batch_size=128, progress=None):
        v = self.rng.normal(size=(len(texts), DIM)).astype(np.float32)
        return v / np.linalg.norm(v, axis=1, keepdims=True).clip(1e-9)


def build_tables(root: Path, users: list[str], per_user: int, embedder, rng) -> dict:
    """Every user's turns, memories, embeddings and indexes through the product's writers (module doc)."""
    t0 = time.perf_counter()
    layout = DataLayout(root)
    start = datetime(2024, 1, 1, tzinfo=timezone.utc)
    turns, mems = [], []
    for ui, u in enumerate(users):
        for j in range(per_user):
            topic = TOPICS[(ui + j) % len(TOPICS)]
            for r, text in enumerate((f"I have been busy with {topic} lately ({u}, {j}).", "Tell me more.")):
                ti = 2 * j + r
                turns.append({"user_id": u, "conversation_id": f"{u}-c{j // 4}", "session_id": f"{u}-s{j // 4}",
                              "turn_index": ti, "role": "user" if r == 0 else "assistant", "speaker": u if r == 0 else None,
                              "text": text, "timestamp": start + timedelta(days=j, minutes=r), "source_ref": f"{u}-{ti}"})
            mems.append({"memory_id": f"{u}-m{j}", "user_id": u, "type": TYPES[j % 3],
                         "content": f"The user is into {topic} ({j}).", "episode_id": f"{u}-e{j // 4}",
                         "evidence_turn_ids": [2 * j], "position": 2 * j, "valid_from": start + timedelta(days=j)})
    turns_df = pl.DataFrame(turns, schema_overrides={"timestamp": pl.Datetime("us", "UTC")})
    mems_df = pl.DataFrame(mems, schema_overrides={"evidence_turn_ids": pl.List(pl.Int64),
                                                   "valid_from": pl.Datetime("us", "UTC")})
    layout.replace_users("turns", users, turns_df)
    layout.replace_users("memories", users, mems_df)
    t_emb = time.perf_counter()
    emb = embed_memories(mems_df, embedder)
    emb_s = time.perf_counter() - t_emb
    layout.replace_users("memory_embeddings", users, emb)
    by_user = emb.partition_by("user_id", as_dict=True)
    vector_store.write_users_indexes(layout, [vector_store.build_user_indexes(by_user[(u,)], u) for u in users])
    return {"build_s": round(time.perf_counter() - t0, 2), "embed_memories_s": round(emb_s, 2),
            "memories": mems_df.height, "turns": turns_df.height}


def write_queries(path: Path, users: list[str], n: int, per_user: int, rng) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            u = users[i % len(users)]
            f.write(json.dumps({"query_id": f"q{i:06d}", "user_id": u,
                                "query": f"What should I plan next around {TOPICS[i % len(TOPICS)]}? ({i})",
                                "as_of_turn": int(rng.integers(1, 2 * per_user))}) + "\n")


def one_at_a_time(root: Path, source: Path, sample: int, backend, embedder, seed: int, strategy_name: str) -> dict:
    """Each sampled query alone through the strategy, over tables loaded beforehand (not timed)."""
    layout = DataLayout(root)
    valid, _ = read_queries(source)
    rng = np.random.default_rng(seed)
    idx = sorted(rng.choice(valid.height, size=min(sample, valid.height), replace=False).tolist())
    picked = valid[idx]
    users = sorted(set(picked["user_id"].to_list()))
    turns = layout.read_users("turns", users)
    mems = layout.read_table("memories", users)
    strategy = get_strategy(strategy_name)
    retriever = retriever_for(strategy, layout, users, turns, mems, embedder)
    queries = to_queries(picked, turns)
    retriever.retrieve([(q.user_id, [(q.query, ["fact"])], q.as_of_position) for q in queries[:1]], 1)  # warm
    calls = CheckpointedLLM(backend, None, code_version="bench", prompt_version=strategy.version)
    t0 = time.perf_counter()
    for q in queries:
        strategy.infer([q], calls, retriever, k=5)
    wall = time.perf_counter() - t0
    return {"sampled": len(queries), "wall_s": round(wall, 3), "qps": round(len(queries) / wall, 2),
            "llm_calls_sent": calls.sent}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, default=1000)
    ap.add_argument("--queries", type=int, default=10_000)
    ap.add_argument("--memories-per-user", type=int, default=6)
    ap.add_argument("--one-at-a-time", type=int, default=200, help="queries sampled for the one-at-a-time rate")
    ap.add_argument("--chunk-rows", type=int, default=10_000)
    ap.add_argument("--fake-embedder", action="store_true", help="random vectors instead of MiniLM")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strategy", default="qumem", choices=("qumem", "topk"),
                    help="the same on every path; the fake server's script answers these (the bench builds no memory graph)")
    ap.add_argument("--smoke", action="store_true", help="4 users, 24 queries, 6 sampled")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.users, args.queries, args.memories_per_user, args.one_at_a_time = 4, 24, 4, 6
    return args


def batched(root: Path, source: Path, backend, embedder, args) -> tuple:
    """The domain core over the whole batch, with the warehouse export the job also does: (report, wall s, figures)."""
    t = time.perf_counter()
    rep = personalize_batch(DataLayout(root), str(source), backend, embedder, batch_id="bench",
                            chunk_rows=args.chunk_rows, strategy=args.strategy, warehouse=Warehouse(root / "warehouse.duckdb"))
    wall = time.perf_counter() - t
    return rep, wall, {"wall_s": round(wall, 3), "qps": round(rep.answered / wall, 2),
                       "answering_s": round(rep.seconds_answering, 3), "answered": rep.answered,
                       "chunks": rep.chunks, "llm_calls_sent": rep.llm_calls_sent,
                       "llm_calls_replayed": rep.llm_calls_replayed, "quarantined": rep.quarantined_input
                       + rep.quarantined_user + rep.quarantined_llm, "warehouse_rows": rep.warehouse_rows}


def dagster_job(root: Path, home: Path, source: Path, llm, embedder, args) -> tuple:
    """The same batch as the Dagster job on a product instance: (wall s, the export op's report, export step s)."""
    from assets.personalize import personalize_job, run_config
    from bench._instance import drop_instance, product_instance
    from resources import PipelineConfig
    from resources.models import EmbedderResource

    home.mkdir()
    instance = product_instance(home)
    resources = {"pipeline": PipelineConfig(data_root=str(root), archive_path=str(root),
                                            warehouse_path=str(root / "warehouse.duckdb"), query_strategy=args.strategy),
                 "llm": llm, "embedder": EmbedderResource(device="cpu")}
    if args.fake_embedder:
        import resources.models as rm

        rm._loaded[("embedder", "cpu")] = embedder
    try:
        t = time.perf_counter()
        result = personalize_job.execute_in_process(
            run_config=run_config(str(source), "bench", chunk_rows=args.chunk_rows), instance=instance, resources=resources)
        wall = time.perf_counter() - t
        if not result.success:
            raise SystemExit("personalize_job failed")
        stats = instance.get_run_step_stats(result.run_id)
        export_s = next((s.end_time - s.start_time for s in stats if s.step_key == "export_personalization_op"
                         and s.end_time is not None and s.start_time is not None), None)
        if export_s is None:  # no silent 0: it would inflate orchestration_overhead_in_run
            raise SystemExit("personalize_job: no timed step export_personalization_op in the run's step "
                             f"stats ({sorted(s.step_key for s in stats)}); orchestration_overhead_in_run cannot be measured")
        return wall, result.output_for_node("export_personalization_op"), export_s
    finally:
        drop_instance(instance, home)


def main(argv=None) -> int:
    args = parse_args(argv)
    from resources.models import LLMResource, _embedder

    rng = np.random.default_rng(args.seed)
    work = Path(tempfile.mkdtemp(prefix="bench-personalize-"))
    out: dict = {"strategy": args.strategy, "users": args.users, "queries": args.queries, "memories_per_user": args.memories_per_user,
                 "chunk_rows": args.chunk_rows, "embedder": "fake" if args.fake_embedder else "all-MiniLM-L6-v2",
                 "build_method": "tables written directly through the product's writers (not the main job)"}
    try:
        t = time.perf_counter()
        embedder = FakeEmbedder(args.seed) if args.fake_embedder else _embedder("cpu")
        out["embedder_load_s"] = round(time.perf_counter() - t, 2)
        users = [f"u{i:05d}" for i in range(args.users)]
        built = work / "built"
        out.update(build_tables(built, users, args.memories_per_user, embedder, rng))
        source = work / "queries.jsonl"
        write_queries(source, users, args.queries, args.memories_per_user, rng)

        def fresh(name: str) -> Path:
            shutil.copytree(built, work / name)
            return work / name

        with RunningFakeServer(SCRIPT, work / "srv") as srv:
            llm = LLMResource(kind="openai", base_url=srv.base_url, model="fake-model")
            backend = llm._build()
            # warm-up (not measured): a first request, the embedder's first encode, faiss
            warm = work / "warm.jsonl"
            warm.write_text("".join(source.read_text().splitlines(keepends=True)[:8]))
            personalize_batch(DataLayout(fresh("warm")), str(warm), backend, embedder, batch_id="warm", chunk_rows=4,
                              strategy=args.strategy)
            rep, core_wall, out["batched"] = batched(fresh("core"), source, backend, embedder, args)
            job_wall, job_rep, export_s = dagster_job(fresh("job"), work / "home", source, llm, embedder, args)
            out["dagster_job"] = {"wall_s": round(job_wall, 3), "answered": job_rep["answered"],
                                  "op_domain_s": round(job_rep["seconds"], 3), "export_step_s": round(export_s, 3),
                                  "llm_calls_sent": job_rep["llm_calls_sent"]}
            out["domain_core_wall_s"] = round(core_wall, 3)
            out["dagster_job_wall_s"] = round(job_wall, 3)
            out["orchestration_overhead"] = round((job_wall - core_wall) / job_wall, 4)
            out["orchestration_overhead_in_run"] = round((job_wall - job_rep["seconds"] - export_s) / job_wall, 4)
            out["overhead_target"] = 0.10
            # one query at a time, same run, same server
            one = one_at_a_time(work / "core", source, args.one_at_a_time, backend, embedder, args.seed, args.strategy)
            one["extrapolated_wall_s"] = round(args.queries / one["qps"], 1)
            out["one_at_a_time"] = one
            out["speedup_throughput"] = round(out["batched"]["qps"] / one["qps"], 2)
            out["speedup_answering"] = round((rep.answered / rep.seconds_answering) / one["qps"], 2)
            out["fake_server_requests"] = len(srv.requests())
        out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not args.json:
        for k, v in out.items():
            print(f"{k:<32}{v}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
