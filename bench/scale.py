"""Scale: the LLM-free stages over one generated archive, in real Dagster runs of 1, 10, 100 or 1,000 users.

    python bench/scale.py [--users 1000] [--turns 100] [--configs 1,10,100] [--scheme users|user_buckets]
                          [--schemes users,user_buckets] [--stages turns,episodes,...] [--archive DIR]
                          [--instance sqlite|postgres] [--max-runs N] [--ui] [--json]

Every configuration reads the SAME archive (generated once, or --archive), because every `turns` run
reads the whole archive: per-turn rates of configurations over different archives do not compare.
Each configuration starts from an empty data root and a fresh Dagster instance, configured by the
repository's dagster.yaml (SQLite) exactly as `qumem` sets up a new DAGSTER_HOME, or with
--instance postgres by deploy/postgres/dagster.yaml on a fresh database of the DAGSTER_PG_* server
(`eval "$(bash scripts/install_system_deps.sh)"`; dropped afterwards), in the partition
scheme of QUMEM_PARTITION_SCHEME (--scheme; --schemes runs this script once per scheme, on the same
archive, and reports them side by side). It is driven by the nightly schedule itself
(assets/schedules.py) with users_per_run = each of --configs: its first evaluation registers every
user and plans the runs, each run is executed with the in-process executor
(turns -> episodes -> memories* -> memory_embeddings -> memory_indexes, or --stages). The
1-user-per-run configuration executes only its first --one-per-run-users runs (1,000 runs of one user
would take hours; its figures are per-turn rates over the same archive, so they compare).

After a configuration has built every user:
* `second_nightly_*`: the nightly schedule evaluated again over the unchanged archive; whatever it
  requests is executed and its stage seconds are summed (`second_nightly_stage_s`, measured);
* `tick_s`: that evaluation's wall time; `sensor_tick_s`: the discovery sensor's evaluation without a
  cursor (the full compare against the instance), and the runs it requests (should be 0).

* Memories need an LLM, so this bench substitutes a SYNTHETIC `memories` asset (same key, same
  partitions/backfill policy): one memory per user utterance, citing that turn, typed round-robin.
  `memory_embeddings`/`memory_indexes` then run for real on as many sentences as there are user turns.
* Stage time = the `seconds` metadata each asset records around its own code; orchestration overhead
  = run wall time (execute_in_process, including model loads) - stage time, as a share of wall.
  Models are loaded once per process (resources/models.py), so the first run carries the load:
  `first_run` and `later_runs_overhead` say how much of the overhead that is.
* --max-runs N executes only the first N runs of the plan: a SLICE of the rebuild (`slice: true`),
  whose nightly re-check then requests the runs not yet built (`second_nightly_expected_runs`).
* --ui: after the largest configuration, bench/ui_load.py opens the `turns` asset's Partitions page
  on that instance in headless Chromium (`ui_load_s`; tests/test_ui_browser.py's harness).
* Bound = the turns/s the two models alone allow: the classifier's raw forward over exactly the pairs
  the episodes stage classified, plus the embedder's raw forward over exactly the memory sentences,
  both measured in this run on pre-tokenised batches. bound_ratio = achieved turns/s (all stages,
  all orchestration, at the largest users-per-run) / bound.
* A configuration in which no run executed has `overhead` and `turns_per_s` null (not a measured 0);
  then `overhead_at_*` is null and no `bound_ratio` is reported.

The issue's 100,000-user target (2 turns each, runs of 1,000 users, bucket scheme, PostgreSQL):
    QUMEM_PARTITION_SCHEME=user_buckets python bench/scale.py --users 100000 --turns 2 --configs 1000 \
        --instance postgres --ui --no-bound --json            # add --max-runs 10 for a 10-run slice
and the tick at 100,000 users alone (ingest only, large runs): --stages turns --configs 10000.

The registry scale (from --users 200,000 on without --configs, or --registry-scale; bucket scheme):
    python bench/scale.py --users 1000000 --instance postgres --json
generates 2 turns per user (--turns N: N) in files of 1,000 users, ingests them in one `archive_sync` run
(`ingest_s`: the job the ticks request, assets/archive_sync.py), registers every user in the data root's
`user_registry` (`register_s`; again: `register_again_s`), plans them all into runs of ~a bucket
(`plan_s`; --build-users-per-run N: runs of N) and builds `turns` for all (their fingerprints
published), then changes --changed (1%) of the users (one more turn each, in 1% of the files) and
times, on every user, the ticks and the sync apart, as they run apart:
  * `sensor_before_sync_s`: the discovery sensor's tick right after the change: it lists the archive
    (no file read), requests the `archive_sync` run (`sensor_sync_requested`) and plans from the
    fingerprints table, which does not hold the change yet (`sensor_before_sync_rebuild_runs`: 0);
  * `sync_run_s`: that `archive_sync` run (the changed files read, their users rebuilt; `sync_run`: its
    metadata);
  * `tick_s`: the nightly tick over the synced table, plan only (the compare and the plan; no archive read);
  * `sensor_s`: the discovery sensor without a cursor (the full compare, plan only);
  * `*_cpu_s`: this process's CPU seconds (all threads) of those ticks, which the box's other load moves
    less than their wall time (the PostgreSQL server's own work is not in them);
  * `tick_timeout_s`: Dagster's schedule and sensor evaluation timeouts in this environment (60 s by default);
then a planned bucket run's user resolution (`resolve_users_s`: the max over the tick's runs) and a whole
bucket's (`resolve_bucket_users_s`, a UI backfill), then runs every LLM-free stage on the tick's runs of
1,000 users only (a sample of buckets; --max-runs N: the first N; models loaded first, `model_load_s`;
--no-stages: skipped): `overhead_at_1000`; then the asset page (`ui_load_s`, --no-ui: skipped). The
issue's size, ticks only:
    python bench/scale.py --users 1000000 --turns 10 --instance postgres --no-stages --no-ui --json

With --json the last printed line is one JSON object.
"""

import argparse
import json
import os
import random
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
# The partition scheme is read when the asset modules are imported, as a deployment reads it.
for _i, _a in enumerate(sys.argv):
    if _a == "--scheme" and _i + 1 < len(sys.argv):
        os.environ["QUMEM_PARTITION_SCHEME"] = sys.argv[_i + 1]
REGISTRY_SCALE_USERS = 200_000  # from this many users on, the run is the registry-scale configuration
for _i, _a in enumerate(sys.argv):
    if ((_a == "--users" and _i + 1 < len(sys.argv) and int(sys.argv[_i + 1]) >= REGISTRY_SCALE_USERS
         and "--configs" not in sys.argv) or _a == "--registry-scale") and "--scheme" not in sys.argv:
        os.environ["QUMEM_PARTITION_SCHEME"] = "user_buckets"

import dagster as dg  # noqa: E402
import polars as pl  # noqa: E402

from assets.episodes import episodes  # noqa: E402
from assets.ingest import turns  # noqa: E402
from assets.partitions import run_user_ids, user_backfill_policy, users_partitions  # noqa: E402
from assets.retrieval import memory_embeddings, memory_indexes  # noqa: E402
from assets.partitions import SCHEME  # noqa: E402
from assets.archive_sync import archive_sync_job  # noqa: E402
from assets.schedules import build_nightly_schedule  # noqa: E402
from assets.sensors import build_discovery_sensor  # noqa: E402
from bench._instance import drop_instance, product_instance  # noqa: E402
from qumem_pipeline.memories.decompose import MEMORY_SCHEMA, MEMORY_TYPES  # noqa: E402
from qumem_pipeline.episodes.segmentation import user_pairs  # noqa: E402
from resources import PipelineConfig  # noqa: E402
from resources.models import ContinuityClassifierResource, EmbedderResource  # noqa: E402

TOPICS = {
    "travel": "trip flight hotel Lisbon beach passport window seat museum train itinerary",
    "pets": "dog vet walk leash puppy food cat adoption park fur",
    "cooking": "pasta recipe oven garlic dinner spicy vegetarian bread sauce kitchen",
    "work": "deadline manager project meeting promotion remote laptop report team client",
    "music": "guitar piano lessons concert band scales song practice chords jazz",
    "health": "running knee doctor sleep yoga diet marathon stretching water injury",
}
STARTS = ["I think", "Yesterday I", "My plan is that", "Honestly", "I really want to say", "Last week", "I noticed"]
STAGES = ["turns", "episodes", "memories", "memory_embeddings", "memory_indexes"]


# ------------------------------------------------------------------------------------ generated data

def generate_archive(path: Path, n_users: int, n_turns: int, seed: int = 0, per_file: int = 100) -> int:
    """JSONL, one file per `per_file` users; user turns drift across topics in blocks (so episodes vary)."""
    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    t0 = datetime(2025, 1, 1, tzinfo=timezone.utc)
    total, names = 0, list(TOPICS)
    for start in range(0, n_users, per_file):
        with open(path / f"users-{start:07d}.jsonl" if per_file != 100 else path / f"users-{start:05d}.jsonl", "w") as f:
            for u in range(start, min(start + per_file, n_users)):
                user = f"user{u:05d}"
                topic = rng.choice(names)
                for i in range(n_turns):
                    if i % 2 == 0 and rng.random() < 0.15:
                        topic = rng.choice(names)
                    words = TOPICS[topic].split()
                    if i % 2 == 0:
                        text = f"{rng.choice(STARTS)} the {' '.join(rng.choices(words, k=rng.randint(5, 14)))}."
                    else:
                        text = f"That sounds {rng.choice(['good', 'hard', 'fun'])}; tell me more about the {rng.choice(words)}."
                    row = {"user_id": user, "conversation_id": f"{user}-c{i // 20}", "session_id": f"{user}-s{i // 20}",
                           "turn_index": i, "role": "user" if i % 2 == 0 else "assistant",
                           "speaker": user if i % 2 == 0 else "assistant", "text": text,
                           "timestamp": (t0 + timedelta(minutes=i)).isoformat(), "source_ref": f"{user}:{i}"}
                    f.write(json.dumps(row) + "\n")
                    total += 1
    return total


@dg.asset(
    key="memories",
    partitions_def=users_partitions,
    backfill_policy=user_backfill_policy,
    deps=[episodes],
    group_name="bench",
    description="SYNTHETIC memories for the scale bench (no LLM): one per user utterance, citing it.",
)
def synthetic_memories(context: dg.AssetExecutionContext, pipeline: PipelineConfig) -> dg.MaterializeResult:
    users = run_user_ids(context)
    layout = pipeline.layout()
    t0 = time.perf_counter()
    rows, frames = 0, []
    turns_of, episodes_of = layout.read_users("turns", users), layout.read_users("episodes", users)
    for u in users:
        t = turns_of[u].filter(pl.col("role") == "user").sort("turn_index")
        eps = episodes_of[u].select("episode_id", "turn_ids").explode("turn_ids")
        ep_of = dict(zip(eps["turn_ids"].to_list(), eps["episode_id"].to_list()))
        idx = t["turn_index"].to_list()
        df = pl.DataFrame({
            "memory_id": [f"{u}-syn-{i}" for i in idx],
            "user_id": [u] * len(idx),
            "type": [MEMORY_TYPES[k % len(MEMORY_TYPES)] for k in range(len(idx))],
            "content": t["text"].to_list(),
            "episode_id": [ep_of[i] for i in idx],
            "evidence_turn_ids": [[i] for i in idx],
            "position": idx,
            "valid_from": t["timestamp"].to_list(),
            "model": ["synthetic-bench"] * len(idx),
            "prompt_version": ["synthetic"] * len(idx),
            "code_version": ["synthetic"] * len(idx),
            "created_at": [datetime(2025, 1, 1, tzinfo=timezone.utc)] * len(idx),
        }, schema=MEMORY_SCHEMA)
        frames.append(df)
        rows += df.height
    # one transaction for the run's users, as the real memories asset writes (replace_users)
    layout.replace_users("memories", users, pl.concat(frames) if frames else pl.DataFrame(schema=MEMORY_SCHEMA))
    return dg.MaterializeResult(metadata={"users": len(users), "dagster/row_count": rows, "synthetic": True,
                                          "seconds": round(time.perf_counter() - t0, 3)})


BENCH_ASSETS = {"turns": turns, "episodes": episodes, "memories": synthetic_memories,
                "memory_embeddings": memory_embeddings, "memory_indexes": memory_indexes}


# ------------------------------------------------------------------------------------ one configuration

def _execute(job, instance, requests, stages, walls: list | None = None) -> tuple[float, dict, int]:
    """Execute run requests; returns (wall seconds, stage seconds by asset, turns ingested); each run's
    (wall, stage) seconds are appended to `walls`."""
    wall, per_stage, n_turns = 0.0, dict.fromkeys(stages, 0.0), 0
    for req in requests:
        tags = dict(req.tags)
        if req.partition_key:
            tags["dagster/partition"] = req.partition_key
        t = time.perf_counter()
        result = job.execute_in_process(instance=instance, tags=tags, raise_on_error=True)
        run_wall = time.perf_counter() - t
        wall += run_wall
        run_stage = 0.0
        for name in stages:
            # one event per partition, all with the run's metadata: read the first
            evs = [e for e in result.get_asset_materialization_events() if e.asset_key.to_user_string() == name]
            if not evs:
                raise RuntimeError(f"run {result.run_id}: no materialization of {name}")
            md = evs[0].step_materialization_data.materialization.metadata
            per_stage[name] += md["seconds"].value
            run_stage += md["seconds"].value
            if name == "turns":
                n_turns += md["dagster/row_count"].value
        if walls is not None:
            walls.append((run_wall, run_stage))
    return wall, per_stage, n_turns


def run_config(archive: Path, work: Path, per_run: int, device: str | None, stages: list[str],
               max_runs: int | None = None, instance_kind: str = "sqlite", ui: bool = False) -> dict:
    """Fresh data root + instance; the nightly schedule plans the runs; execute them; then re-check.
    max_runs executes only the first runs of the plan (a slice); ui: time the asset page on this instance."""
    (work / "home").mkdir(parents=True)
    pipeline = PipelineConfig(data_root=str(work / "data"), archive_path=str(archive))
    assets = [BENCH_ASSETS[s] for s in stages]
    job_def = dg.define_asset_job("scale_bench_job", selection=assets)
    schedule = build_nightly_schedule(job=job_def, users_per_run=per_run, name=f"bench_nightly_{per_run}",
                                      final_asset=stages[-1])
    sensor = build_discovery_sensor(job=job_def, users_per_run=per_run, name=f"bench_sensor_{per_run}")
    defs = dg.Definitions(
        assets=assets, jobs=[job_def, archive_sync_job], schedules=[schedule], sensors=[sensor],
        executor=dg.in_process_executor,
        resources={"pipeline": pipeline, "continuity": ContinuityClassifierResource(device=device or ""),
                   "embedder": EmbedderResource(device=device or "")},
    )
    job = defs.resolve_job_def(job_def.name)
    instance = product_instance(work / "home", instance_kind)

    def evaluate():
        with dg.build_schedule_context(instance=instance, scheduled_execution_time=datetime.now(timezone.utc),
                                       resources={"pipeline": pipeline}, repository_def=defs.get_repository_def()) as ctx:
            t = time.perf_counter()
            data = schedule.evaluate_tick(ctx)
            return data, time.perf_counter() - t

    # the archive sync is a run of its own (the ticks only plan: assets/archive_sync.py)
    t = time.perf_counter()
    defs.resolve_job_def(archive_sync_job.name).execute_in_process(instance=instance, raise_on_error=True)
    sync_run_s = time.perf_counter() - t
    first, first_check_s = evaluate()
    requests = first.run_requests[:max_runs] if max_runs else first.run_requests
    walls: list[tuple[float, float]] = []
    wall, per_stage, n_turns = _execute(job, instance, requests, stages, walls)
    stage = sum(per_stage.values())
    later = walls[1:]  # runs after the first: the process's models are loaded
    users_built = sum(int(r.tags.get("qumem/nightly_users", "1")) for r in requests)
    out = {
        "scheme": SCHEME, "users_per_run": per_run, "users": users_built, "runs": len(requests),
        "runs_planned": len(first.run_requests), "turns": n_turns,
        "wall_s": round(wall, 2), "stage_s": round(stage, 2),
        "stage_s_by_asset": {k: round(v, 2) for k, v in per_stage.items()},
        # None when no run executed (no wall time): not a measured 0
        "overhead": round((wall - stage) / wall, 4) if requests and wall else None,
        "turns_per_s": round(n_turns / wall, 1) if requests and wall else None,
        "sync_run_s": round(sync_run_s, 2),  # the archive_sync run that read the archive before the first tick
        "first_check_s": round(first_check_s, 2),  # the first nightly evaluation: registers every user, plans
        # where the overhead is: the first run loads the models (counted above), the others do not
        "first_run": {"wall_s": round(walls[0][0], 2), "stage_s": round(walls[0][1], 2)} if walls else None,
        "later_runs_overhead_s_per_run": round(sum(w - s for w, s in later) / len(later), 2) if later else None,
        "later_runs_overhead": round(sum(w - s for w, s in later) / sum(w for w, _ in later), 4) if later else None,
    }
    if max_runs and len(requests) < len(first.run_requests):  # a slice: re-check the unchanged archive anyway
        second, second_check_s = evaluate()
        out.update({"slice": True, "tick_s": round(second_check_s, 2),
                    "second_nightly_runs_requested": len(second.run_requests),
                    "second_nightly_expected_runs": len(first.run_requests) - len(requests)})
    if len(requests) == len(first.run_requests):  # every user built: the nightly over the unchanged archive
        second, second_check_s = evaluate()
        wall2, per_stage2, _ = _execute(job, instance, second.run_requests, stages)
        with dg.build_sensor_context(instance=instance, resources={"pipeline": pipeline},
                                     repository_def=defs.get_repository_def()) as sctx:
            t = time.perf_counter()
            sensed = sensor.evaluate_tick(sctx)
            sensor_s = time.perf_counter() - t
        out.update({
            "second_nightly_runs_requested": len(second.run_requests),
            "second_nightly_skip": second.skip_message,
            "second_nightly_stage_s": round(sum(per_stage2.values()), 3),
            "second_nightly_wall_s": round(wall2, 3),
            "tick_s": round(second_check_s, 2),
            "sensor_tick_s": round(sensor_s, 2),
            "sensor_runs_requested": len([r for r in sensed.run_requests if r.job_name != archive_sync_job.name]),
            "sensor_cursor_chars": len(sensed.cursor or ""),
        })
    out["runs_in_instance"] = len(instance.get_run_records())
    out["registered_users"] = len(instance.get_dynamic_partitions("users"))
    if ui:
        from bench.ui_load import asset_page_load

        out["ui"] = asset_page_load(work / "home", archive=archive, data_root=work / "data")
        out["ui_load_s"] = out["ui"]["load_s"]
    drop_instance(instance, work / "home")
    return out


# ------------------------------------------------------------------------------------ registry scale

def _change_files(archive: Path, fraction: float) -> int:
    """Give every user of the first `fraction` of the archive's files one more turn; returns the users changed."""
    files = sorted(archive.glob("*.jsonl"))
    n_files = max(1, round(len(files) * fraction))
    changed = set()
    for path in files[:n_files]:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        last = {}
        for r in rows:
            last[r["user_id"]] = r
        with open(path, "a") as f:
            for u, r in last.items():
                extra = dict(r, turn_index=r["turn_index"] + 1, role="user", speaker=u, text="One more thing about the trip.",
                             source_ref=f"{u}:{r['turn_index'] + 1}",
                             timestamp=(datetime.fromisoformat(r["timestamp"]) + timedelta(minutes=1)).isoformat())
                f.write(json.dumps(extra) + "\n")
                changed.add(u)
    return len(changed)


def _stage_sample(args, defs, instance, tick, nightly, evaluate, say, out: dict) -> None:
    """Registry scale: every LLM-free stage on the nightly tick's runs (a sample of buckets), then the tick again."""
    # the LLM-free stages on the tick's runs (the changed users' buckets): models loaded first, as
    # in a long-lived worker (their load is reported on its own)
    t = time.perf_counter()
    _ = defs.resources["continuity"].model, defs.resources["embedder"].model  # the per-process cache (resources/models.py)
    out["model_load_s"] = round(time.perf_counter() - t, 2)
    walls: list = []
    runs = tick.run_requests[: args.max_runs] if args.max_runs else tick.run_requests
    wall, per_stage, n_turns = _execute(defs.resolve_job_def("scale_bench_job"), instance, runs, STAGES, walls)
    stage = sum(per_stage.values())
    later = walls[1:]
    out.update({
        "sample_runs": len(runs), "sample_users": sum(int(r.tags.get("qumem/nightly_users", 0)) for r in runs),
        "sample_turns": n_turns, "sample_wall_s": round(wall, 2), "sample_stage_s": round(stage, 2),
        "stage_s_by_asset": {k: round(v, 2) for k, v in per_stage.items()},
        "overhead_at_1000": round((wall - stage) / wall, 4) if wall else None,
        "first_run": {"wall_s": round(walls[0][0], 2), "stage_s": round(walls[0][1], 2)} if walls else None,
        "later_runs_overhead": round(sum(w - s for w, s in later) / sum(w for w, _ in later), 4) if later else None,
        "later_runs_overhead_s_per_run": round(sum(w - s for w, s in later) / len(later), 2) if later else None,
    })
    say(f"stages on {len(runs)} runs of 1000: wall {out['sample_wall_s']}s, stage {out['sample_stage_s']}s, "
        f"overhead {out['overhead_at_1000']} (later runs {out['later_runs_overhead']})")
    if len(runs) == len(tick.run_requests):
        again, again_s = evaluate(nightly)
        out["second_tick_s"] = round(again_s, 2)
        out["second_tick_runs_requested"] = len(again.run_requests)


def registry_scale(args, archive: Path, work: Path, device: str | None) -> dict:
    """The million-user configuration (bucket scheme): registration, planning, nightly tick with
    `--changed` of the users changed, discovery sensor, a planned run's user resolution and the asset
    page on every user; the LLM-free stages on the tick's runs only (a sample of buckets)."""
    from assets.partitions import (RUN_USERS_TAG, partition_key_of, planned_users_of, register_users,
                                   user_registry, users_of_keys)
    from assets.planning import TURNS_KEY, finished_runs
    from dagster._grpc.utils import default_schedule_grpc_timeout, default_sensor_grpc_timeout

    from qumem_pipeline.ingest.discovery import discover

    (work / "home").mkdir(parents=True)
    out: dict = {"scheme": SCHEME, "users": args.users, "turns_per_user": args.turns, "instance": args.instance}
    pipeline = PipelineConfig(data_root=str(work / "data"), archive_path=str(archive))
    stage_assets = [BENCH_ASSETS[s] for s in STAGES]
    turns_job = dg.define_asset_job("scale_turns_job", selection=[turns])
    stages_job = dg.define_asset_job("scale_bench_job", selection=stage_assets)
    build_per_run = args.build_users_per_run or -(-args.users // 64)
    build = build_nightly_schedule(job=turns_job, users_per_run=build_per_run, name="bench_build", final_asset="turns")
    nightly = build_nightly_schedule(job=turns_job, users_per_run=1000, name="bench_nightly", final_asset="turns")
    sensor = build_discovery_sensor(job=turns_job, users_per_run=1000, name="bench_sensor")
    defs = dg.Definitions(
        assets=stage_assets, jobs=[turns_job, stages_job, archive_sync_job], schedules=[build, nightly], sensors=[sensor],
        executor=dg.in_process_executor,
        resources={"pipeline": pipeline, "continuity": ContinuityClassifierResource(device=device or ""),
                   "embedder": EmbedderResource(device=device or "")})
    instance = product_instance(work / "home", args.instance)
    sync_job = defs.resolve_job_def(archive_sync_job.name)

    cpu: dict = {}  # this process's CPU seconds (every thread) of the last tick: a figure the box's other load moves less

    def evaluate(schedule):
        with dg.build_schedule_context(instance=instance, scheduled_execution_time=datetime.now(timezone.utc),
                                       resources={"pipeline": pipeline}, repository_def=defs.get_repository_def()) as ctx:
            t, c = time.perf_counter(), time.process_time()
            data = schedule.evaluate_tick(ctx)
            cpu["last"] = time.process_time() - c
            return data, time.perf_counter() - t

    def sense():
        with dg.build_sensor_context(instance=instance, resources={"pipeline": pipeline},
                                     repository_def=defs.get_repository_def()) as sctx, \
                dg.partition_loading_context(dynamic_partitions_store=instance):  # as the sensor daemon evaluates
            t, c = time.perf_counter(), time.process_time()
            data = sensor.evaluate_tick(sctx)
            cpu["last"] = time.process_time() - c
            return data, time.perf_counter() - t

    def sync_run(request=None):
        """The archive sync as the Dagster run the ticks request (assets/archive_sync.py); its wall time."""
        t = time.perf_counter()
        result = sync_job.execute_in_process(instance=instance, tags=dict(request.tags) if request else None,
                                             raise_on_error=True)
        wall = time.perf_counter() - t
        meta = {}
        for ev in result.all_events:
            if ev.event_type_value == "STEP_OUTPUT":
                meta = {k: v.value for k, v in ev.step_output_data.metadata.items()}
        return wall, meta

    def say(msg):
        print(f"[registry-scale {args.users}] {msg}", flush=True)

    try:
        wall, meta = sync_run()  # every user's turns: the whole archive read by one archive_sync run
        out["ingest_s"] = round(wall, 2)
        out["ingest_sync"] = {k: meta.get(k) for k in ("files_read", "rows_read", "rows_per_s", "users_rebuilt", "seconds")}
        say(f"archive_sync run (whole archive): {out['ingest_s']}s, {meta.get('rows_read')} rows, "
            f"{meta.get('users_rebuilt')} users")
        found = discover(pipeline.archive(), {}, forgotten=pipeline.forgotten(), layout=pipeline.layout(), sync=False)
        t = time.perf_counter()
        added = register_users(instance, sorted(found.fingerprints), pipeline, found.fingerprints)
        out["register_s"] = round(time.perf_counter() - t, 2)
        t = time.perf_counter()
        again = register_users(instance, sorted(found.fingerprints), pipeline, found.fingerprints)
        out["register_again_s"] = round(time.perf_counter() - t, 2)  # idempotent: reads, appends nothing
        out.update(registered=len(added), registered_again=len(again))
        say(f"registered {len(added)} users in {out['register_s']}s (again: "
            f"{len(again)} in {out['register_again_s']}s)")

        plan, plan_s = evaluate(build)  # every user: planned into runs of ~a bucket
        out["plan_s"] = round(plan_s, 2)
        out["build_runs"] = len(plan.run_requests)
        t = time.perf_counter()
        job = defs.resolve_job_def("scale_turns_job")
        for req in plan.run_requests:
            job.execute_in_process(instance=instance, tags=dict(req.tags), raise_on_error=True)
        out["build_s"] = round(time.perf_counter() - t, 2)  # `turns` for every user (their fingerprints published)
        say(f"planned {out['build_runs']} runs in {out['plan_s']:.2f}s; built in {out['build_s']}s")

        t = time.perf_counter()
        done = finished_runs(instance, TURNS_KEY, sorted({rec.dagster_run.run_id for rec in instance.get_run_records()}))
        out["finished_runs_query_s"] = round(time.perf_counter() - t, 3)
        out["finished_runs"] = len({r for r, _ in done})

        out["changed_users"] = _change_files(archive, args.changed)
        # the sensor's tick before the sync: it lists the archive (no file read), requests the sync run
        # and plans from the fingerprints table, which does not hold the change yet
        first_sense, first_sense_s = sense()
        sync_requests = [r for r in first_sense.run_requests if r.job_name == archive_sync_job.name]
        out["sensor_before_sync_s"] = round(first_sense_s, 2)
        out["sensor_before_sync_cpu_s"] = round(cpu["last"], 2)
        out["sensor_before_sync_rebuild_runs"] = len(first_sense.run_requests) - len(sync_requests)
        out["sensor_sync_requested"] = len(sync_requests)
        say(f"sensor before the sync: {out['sensor_before_sync_s']}s, sync requested: {len(sync_requests)}, "
            f"rebuild runs {out['sensor_before_sync_rebuild_runs']}")
        wall, meta = sync_run(sync_requests[0] if sync_requests else None)
        out["sync_run_s"] = round(wall, 2)  # the changed files' sync, as the run the sensor requested
        out["sync_run"] = {k: meta.get(k) for k in ("files_read", "rows_read", "rows_per_s", "users_rebuilt", "seconds")}
        say(f"archive_sync run ({out['changed_users']} users changed): {out['sync_run_s']}s, {meta.get('files_read')} files, "
            f"{meta.get('users_rebuilt')} users rebuilt")
        tick, tick_s = evaluate(nightly)
        out["tick_s"] = round(tick_s, 2)  # the nightly tick: plan only (no archive read)
        out["tick_cpu_s"] = round(cpu["last"], 2)
        out["tick_runs_requested"] = len(tick.run_requests)
        out["tick_users_requested"] = sum(int(r.tags.get("qumem/nightly_users", 0)) for r in tick.run_requests)
        say(f"nightly tick (plan only), {out['changed_users']} users changed: {out['tick_s']}s ({out['tick_cpu_s']} CPU s), "
            f"{out['tick_runs_requested']} runs for {out['tick_users_requested']} users")
        sensed, sensor_s = sense()
        out["sensor_s"] = round(sensor_s, 2)  # no cursor: the full compare against every user's recorded fingerprint
        out["sensor_cpu_s"] = round(cpu["last"], 2)
        out["sensor_runs_requested"] = len([r for r in sensed.run_requests if r.job_name != archive_sync_job.name])
        out["sensor_users_requested"] = sum(int(r.tags.get("qumem/discovered_users", 0)) for r in sensed.run_requests)
        say(f"discovery sensor (plan only): {out['sensor_s']}s ({out['sensor_cpu_s']} CPU s), {out['sensor_runs_requested']} runs for "
            f"{out['sensor_users_requested']} users")
        out["tick_timeout_s"] = {"schedule": default_schedule_grpc_timeout(), "sensor": default_sensor_grpc_timeout()}

        # a planned bucket run's user resolution (what users_for_run does in each run), and a UI
        # backfill's (every registered user of one bucket)
        resolve = []
        for req in tick.run_requests:
            keys = users_partitions.get_partition_keys_in_range(
                dg.PartitionKeyRange(req.tags["dagster/asset_partition_range_start"],
                                     req.tags["dagster/asset_partition_range_end"])) \
                if "dagster/asset_partition_range_start" in req.tags else [req.partition_key]
            t = time.perf_counter()
            users = planned_users_of(pipeline, req.tags[RUN_USERS_TAG], keys)
            resolve.append(time.perf_counter() - t)
            assert len(users) == int(req.tags["qumem/nightly_users"]), (len(users), req.tags)
        out["resolve_users_s"] = round(max(resolve), 3) if resolve else None
        out["resolve_users_mean_s"] = round(sum(resolve) / len(resolve), 3) if resolve else None
        t = time.perf_counter()
        bucket_users = users_of_keys(instance, [partition_key_of("user0000000")], pipeline=pipeline)
        out["resolve_bucket_users_s"] = round(time.perf_counter() - t, 3)
        out["bucket_users"] = len(bucket_users)
        say(f"user resolution: planned run max {out['resolve_users_s']}s, a whole bucket ({len(bucket_users)} users) "
            f"{out['resolve_bucket_users_s']}s")

        if args.no_stages:
            out["stages"] = "skipped (--no-stages)"
        else:
            _stage_sample(args, defs, instance, tick, nightly, evaluate, say, out)
        out["registry_users"] = len(user_registry(pipeline).users())
        out["dynamic_partitions"] = len(instance.get_dynamic_partitions("users"))
        out["runs_in_instance"] = len(instance.get_run_records())
        if not args.no_ui:
            from bench.ui_load import asset_page_load

            out["ui"] = asset_page_load(work / "home", archive=archive, data_root=work / "data")
            out["ui_load_s"] = out["ui"]["load_s"]
            say(f"asset page: {out['ui_load_s']}s")
    finally:
        drop_instance(instance, work / "home")
    return out


# ------------------------------------------------------------------------------------ the bound

def model_bound(archive: Path, device: str | None, batch_pairs: int = 64, batch_sent: int = 128) -> dict:
    """Raw forward throughput of both models on exactly this archive's pairs and memory sentences."""
    import torch

    from qumem_pipeline.runtime.batching import length_buckets, pad_batch
    from qumem_pipeline.episodes.continuity import ContinuityClassifier
    from qumem_pipeline.embedding.minilm import Embedder
    from qumem_pipeline.ingest.archive import ArchiveConfig, load_archive

    tdf = load_archive(ArchiveConfig(path=str(archive))).turns
    pairs, sentences = [], []
    for _, t in tdf.partition_by("user_id", as_dict=True).items():
        pairs += user_pairs(t)
        sentences += t.sort("turn_index").filter(pl.col("role") == "user")["text"].to_list()
    n_turns = tdf.height

    clf = ContinuityClassifier.load(None, device=device)
    batches = clf.prepare(pairs, batch_pairs)
    clf.raw_forward(batches[:2])
    t = time.perf_counter()
    clf.raw_forward(batches)
    clf_s = time.perf_counter() - t

    emb = Embedder.load(device=device)
    enc = emb.tokenizer(sentences, truncation=True, max_length=emb.max_seq_length, padding=False,
                        return_attention_mask=False, return_token_type_ids=False)["input_ids"]
    pad = emb.tokenizer.pad_token_id or 0
    # the same length-bucketed padding as Embedder.encode, prepared up front: only the forward is timed
    tensors = [tuple(t.to(emb.device) for t in pad_batch(enc, idx, pad))
               for idx in length_buckets([len(x) for x in enc], batch_sent)]
    with torch.inference_mode():
        emb.model(input_ids=tensors[0][0], attention_mask=tensors[0][1])
        if emb.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for ids, mask in tensors:
            emb.model(input_ids=ids, attention_mask=mask)
        if emb.device.type == "cuda":
            torch.cuda.synchronize()
        emb_s = time.perf_counter() - t
    return {
        "turns": n_turns, "pairs": len(pairs), "sentences": len(sentences),
        "raw_pairs_per_s": round(len(pairs) / clf_s, 1), "raw_sentences_per_s": round(len(sentences) / emb_s, 1),
        "model_s": round(clf_s + emb_s, 2), "bound_turns_per_s": round(n_turns / (clf_s + emb_s), 1),
        "device": str(clf.device), "threads": torch.get_num_threads(),
    }


def _other_scheme_runs(args, archive: Path) -> list[dict]:
    """--schemes: this script once per scheme, in its own process (the scheme is import-time), same archive."""
    import subprocess

    out = []
    for scheme in args.schemes.split(","):
        cmd = [sys.executable, __file__, "--scheme", scheme, "--archive", str(archive), "--configs", args.configs,
               "--users", str(args.users), "--turns", str(args.turns), "--stages", args.stages,
               "--one-per-run-users", str(args.one_per_run_users), "--no-bound", "--json",
               "--instance", args.instance, "--max-runs", str(args.max_runs)] + (["--ui"] if args.ui else [])
        if args.device:
            cmd += ["--device", args.device]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
        if proc.returncode != 0:
            raise RuntimeError(f"scheme {scheme} failed:\n{proc.stderr[-3000:]}")
        print(proc.stdout.rsplit("\n", 2)[0], flush=True)
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=1000)
    ap.add_argument("--turns", type=int, default=100, help="turns per user (half user, half assistant)")
    ap.add_argument("--one-per-run-users", type=int, default=20, help="runs executed in the 1-user-per-run config")
    ap.add_argument("--configs", default="1,10,100", help="users per run, comma-separated")
    ap.add_argument("--stages", default=",".join(STAGES), help="assets to run, in order (a prefix of the default)")
    ap.add_argument("--scheme", choices=["users", "user_buckets"], help="partition scheme (set before import)")
    ap.add_argument("--schemes", default="", help="run each of these schemes (own process) on the same archive")
    ap.add_argument("--archive", help="use this archive instead of generating one")
    ap.add_argument("--no-bound", action="store_true", help="skip the raw-model bound")
    ap.add_argument("--device", default=None)
    ap.add_argument("--instance", choices=["sqlite", "postgres"], default="sqlite",
                    help="Dagster instance: the repository's dagster.yaml (SQLite) or deploy/postgres/dagster.yaml "
                         "on a fresh database of the DAGSTER_PG_* server (dropped afterwards)")
    ap.add_argument("--max-runs", type=int, default=0,
                    help="execute only the first N runs of each plan (a slice of the rebuild; 0 = all)")
    ap.add_argument("--ui", action="store_true",
                    help="after the largest configuration, time its asset page in headless Chromium (ui_load_s)")
    ap.add_argument("--registry-scale", action="store_true",
                    help=f"the registry-scale configuration (default from --users {REGISTRY_SCALE_USERS} on, "
                         "without --configs): registration, planning, tick, sensor, resolution and UI on every user, "
                         "the stages on the tick's runs")
    ap.add_argument("--changed", type=float, default=0.01, help="registry scale: fraction of users changed before the tick")
    ap.add_argument("--build-users-per-run", type=int, default=0,
                    help="registry scale: users per `turns` run of the initial build (0 = users/64: about a bucket)")
    ap.add_argument("--no-ui", action="store_true", help="registry scale: skip the asset page")
    ap.add_argument("--no-stages", action="store_true",
                    help="registry scale: skip the LLM-free stage runs on the tick's runs (and their model load): "
                         "registration, sync runs, tick, sensor and resolution only")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import logging

    logging.getLogger("dagster").setLevel(logging.WARNING)
    stages = args.stages.split(",")
    if stages != STAGES[: len(stages)]:
        raise SystemExit(f"--stages must be a prefix of {STAGES}")
    configs = [int(x) for x in args.configs.split(",")]
    if args.registry_scale or (args.users >= REGISTRY_SCALE_USERS and "--configs" not in (argv or sys.argv)):
        if args.instance == "postgres" and not os.environ.get("DAGSTER_PG_HOST"):
            raise SystemExit('--instance postgres needs DAGSTER_PG_*: eval "$(bash scripts/install_system_deps.sh)"')
        t0 = time.perf_counter()
        turns_per_user = args.turns if "--turns" in (argv or sys.argv) else 2
        args.turns = turns_per_user
        with tempfile.TemporaryDirectory(prefix="qumem-scale-") as tmp:
            tmp = Path(tmp)
            archive = Path(args.archive) if args.archive else tmp / "archive"
            t = time.perf_counter()
            total = None if args.archive else generate_archive(archive, args.users, turns_per_user, per_file=1000)
            gen_s = time.perf_counter() - t
            out = registry_scale(args, archive, tmp / "work", args.device)
        out.update(archive_turns=total, generate_s=round(gen_s, 2), bench_wall_s=round(time.perf_counter() - t0, 1),
                   memories="synthetic (one per user utterance, citing it; no LLM)")
        if args.json:
            print(json.dumps(out))
        return 0
    with tempfile.TemporaryDirectory(prefix="qumem-scale-") as tmp:
        tmp = Path(tmp)
        archive = Path(args.archive) if args.archive else tmp / "archive"
        total = None if args.archive else generate_archive(archive, args.users, args.turns)
        if args.schemes:
            per_scheme = _other_scheme_runs(args, archive)
            out = {"users": args.users, "turns_per_user": args.turns, "archive": "shared by every configuration",
                   "schemes": {r["scheme"]: r for r in per_scheme}}
            for key in ("tick_s", "overhead_at_1000", "overhead_at_100", "ui_load_s"):
                out[key] = {r["scheme"]: r.get(key) for r in per_scheme}
            if args.json:
                print(json.dumps(out))
            return 0
        results = []
        if args.instance == "postgres" and not os.environ.get("DAGSTER_PG_HOST"):
            raise SystemExit('--instance postgres needs DAGSTER_PG_*: eval "$(bash scripts/install_system_deps.sh)"')
        for per_run in configs:
            r = run_config(archive, tmp / f"cfg-{per_run}", per_run, args.device, stages,
                           max_runs=args.one_per_run_users if per_run == 1 else (args.max_runs or None),
                           instance_kind=args.instance, ui=args.ui and per_run == max(configs))
            results.append(r)
            if "ui" in r:
                print(f"      asset page ({r['ui'].get('partition_count_text')}): {r['ui_load_s']}s, again "
                      f"{r['ui'].get('reload_s')}s", flush=True)
            print(f"[{SCHEME}] {per_run:>5} users/run: {r['users']} users, {r['runs']}/{r['runs_planned']} runs, "
                  f"{r['turns']} turns, wall {r['wall_s']}s, stage {r['stage_s']}s, overhead {_pct(r['overhead'])}, "
                  f"{r['turns_per_s']} turns/s", flush=True)
            if r.get("slice"):
                print(f"      slice: nightly over the unchanged archive after {r['runs']} runs: "
                      f"{r['second_nightly_runs_requested']} runs requested ({r['second_nightly_expected_runs']} "
                      f"not yet built), tick {r['tick_s']}s", flush=True)
            elif "tick_s" in r:
                print(f"      second nightly over the unchanged archive: {r['second_nightly_runs_requested']} runs "
                      f"requested, {r['second_nightly_stage_s']} stage seconds, tick {r['tick_s']}s "
                      f"({r['second_nightly_skip']}); sensor tick {r['sensor_tick_s']}s, "
                      f"{r['sensor_runs_requested']} runs, cursor {r['sensor_cursor_chars']} chars", flush=True)
        bound = None if args.no_bound or "memory_embeddings" not in stages else model_bound(archive, args.device)
    main_cfg = next((r for r in results if r["users_per_run"] == max(configs)), results[-1])
    out = {
        "scheme": SCHEME, "users": args.users, "turns_per_user": args.turns, "archive_turns": total,
        "stages": stages, "one_per_run_users": args.one_per_run_users,
        "configs": results,
        "turns_per_s": main_cfg["turns_per_s"],
        "overhead_at_100": next((r["overhead"] for r in results if r["users_per_run"] == 100), None),
        "overhead_at_1000": next((r["overhead"] for r in results if r["users_per_run"] == 1000), None),
        "tick_s": main_cfg.get("tick_s"), "sensor_tick_s": main_cfg.get("sensor_tick_s"),
        "second_nightly_runs_requested": [r.get("second_nightly_runs_requested") for r in results],
        "ui_load_s": main_cfg.get("ui_load_s"), "ui": main_cfg.get("ui"), "instance": args.instance,
        "slice": bool(main_cfg.get("slice")),
        "memories": "synthetic (one per user utterance, citing it; no LLM)",
    }
    if bound:
        out["bound"] = bound
    if bound and main_cfg["turns_per_s"] is not None:  # no ratio when no run executed
        out["bound_ratio"] = round(main_cfg["turns_per_s"] / bound["bound_turns_per_s"], 3)
        print(f"bound (raw forward, same data): classifier {bound['raw_pairs_per_s']} pairs/s, embedder "
              f"{bound['raw_sentences_per_s']} sentences/s -> {bound['bound_turns_per_s']} turns/s; "
              f"achieved at {main_cfg['users_per_run']} users/run {out['turns_per_s']} turns/s, "
              f"bound_ratio {out['bound_ratio']}")
    print(f"{'users/run':>9} {'users':>6} {'runs':>5} {'turns':>7} {'wall s':>8} {'stage s':>8} {'overhead':>9} {'turns/s':>8}")
    for r in results:
        print(f"{r['users_per_run']:>9} {r['users']:>6} {r['runs']:>5} {r['turns']:>7} {r['wall_s']:>8} "
              f"{r['stage_s']:>8} {_pct(r['overhead']):>9} {str(r['turns_per_s']):>8}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
