"""Fault report (issue 7): inject each fault, recover, and count the rows lost (must be 0).

    python bench/faults.py [--skip-kills] [--json]            # every scenario, erasure under load included
    python bench/faults.py --scenario erasure [--seeds 0,1,2] [--erasure-users 4 --erasure-runs 3 --erasure-forgets 2] --json
    python bench/faults.py --scenario kills [--random-kills 20 --kill-seed 0] [--kill-points ''] --json   # killed runs only

Scenarios:
- LLM endpoint faults against the fake OpenAI server process (tests/fake_openai_server.py):
  5xx burst, 429 + Retry-After, hung connection, mid-response disconnect, non-JSON body,
  malformed and schema-violating model output, a server that dies and comes back, and one gone
  for good followed by a rerun against the revived server. Rows = one per (episode, memory type)
  call outcome: a memory row, or a quarantine row with its reason. A call whose outcome is in
  neither is lost. `recovered` = every call's outcome equals the clean run's (its memories, same
  content and evidence), except the calls the scenario makes fail on purpose, which must be
  quarantined. `repeated_calls` is counted from the fake servers' request logs: valid answers to the
  same request (same messages) beyond the first, i.e. finished calls paid for twice.
- Killed runs: `qumem run` (3 users) killed at each fault point, then rerun. Rows = every row of
  every per-user Parquet table; `recovered` = killed with 137, rerun succeeded, every content hash
  equals the uninterrupted run's and no temp file is left (clean row: a second uninterrupted run
  equals the first); `rows_quarantined` = rows of the quarantine tables after the rerun;
  `repeated_calls` = valid answers (killed run + rerun) per request beyond the clean run's (clean row: null,
  it is the reference).
- Random kills: a decomposition (the LLM scenarios' episodes, checkpoints in a Delta table) killed in a
  child process (exit 137) at each of `--random-kills N` (default 20) seed-chosen finished LLM calls
  (`llm.call_recorded`, `--kill-seed`), wherever the checkpoint buffer stands, not only right after a
  flush, then rerun from its checkpoints (`kill:decompose#i`); `--pipeline-random-kills M` does the same
  to `qumem run` (`kill:random#i`, a whole pipeline run and rerun each). Their `repeated_calls` may be
  above 0, up to the documented window (memories/recording.py: the unflushed buffer, at most
  flush_every_n - 1, plus the answers in flight), reported as "random_kills" {repeated_calls per kill,
  total, max, bound_per_kill, within_bound}; the exit status requires every one within its bound.
- Bad input rows through ingest validation: every valid row arrives, every bad one is quarantined
  (`repeated_calls` is null: no LLM call is made).
- Erasure under load (`--scenario erasure`, or `all` with the others; issue 27), per seed: an archive of
  N users, each with a unique canary in their turns; at once, as separate processes on one data root and
  one Dagster home: `qumem run`, main-job and ingest-job runs over seed-chosen overlapping user subsets
  (seed-chosen users per Dagster run), and `qumem forget` of a seed-chosen subset at seed-chosen delays;
  after they all end, the nightly `qumem run` over the archive, which still holds the forgotten users
  and has a later file with new turns (and a second canary) for every user. Then, each counted:
  `resurrected_users` (forgotten users with a row in any Delta or warehouse table, or a canary anywhere
  the audit looks), `tombstones_lost` (forgets that exited 0 whose tombstone the registry does not
  hold), `residue_objects` (objects the audit `qumem forget --verify` runs, `assets.cli_commands.audit_erasure`,
  finds naming a forgotten id or canary: data root objects, warehouse tables and files, instance tables,
  files under DAGSTER_HOME), `rows_lost` (rows of the kept users, every Delta and warehouse table,
  missing against the clean sequential reference: the same archive, the same two passes, no forget)
  and `repeated_calls` (valid answers per request beyond the reference's, from the fake server's log).
  The archive is the same for every seed, so one reference serves them all; the seed picks who is
  forgotten, when, and which runs go beside. `audit_found_in_reference` (the audit finds the forgotten
  users in the reference) shows the audit can see what it reports absent.
`slowdown` = the scenario's wall time over the clean run of its kind measured in this same run.
The last line (with --json) is one JSON object: {"rows": [...], "total_rows_lost": n, ...} (with the
erasure scenario also "erasure": {the five figures summed over seeds, "seeds": [...], "reference": {...}}).
`--smoke`: the LLM and bad-row scenarios only (no killed runs, no erasure; about 30 s on 2 cores).
"""

import argparse
import json
import os
import subprocess
from collections import Counter
import shutil
import sys
import tempfile
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


from crash_harness import TOPICS, run_pipeline, snapshot, table_rows, temp_files, write_archive  # noqa: E402
from fake_openai_server import RunningFakeServer  # noqa: E402
from qumem_pipeline.memories.decompose import MEMORY_TYPES, decompose_episodes  # noqa: E402
from qumem_pipeline.memories.checkpoints import CheckpointStore  # noqa: E402
from qumem_pipeline.llm import LLMEndpointError, make_backend  # noqa: E402
from qumem_pipeline.runtime.processes import free_port  # noqa: E402

T0 = datetime(2024, 5, 1, 9, 0, tzinfo=timezone.utc)
N_USERS, N_EPISODES = 4, 6
ECHO = {"echo_memory": True}


def ep_text(u: int, i: int) -> str:
    return f"EP-u{u}-{i}: I went climbing at crag {i} with my brother"


def episodes() -> list[dict]:
    out = []
    for u in range(N_USERS):
        for i in range(N_EPISODES):
            k = 2 * i
            out.append({"user_id": f"u{u}", "episode_id": f"u{u}-e{i}", "turns": [
                {"turn_index": k, "role": "user", "speaker": f"u{u}", "text": ep_text(u, i),
                 "timestamp": T0 + timedelta(minutes=k)},
                {"turn_index": k + 1, "role": "assistant", "text": "Nice.", "timestamp": T0 + timedelta(minutes=k + 1)},
            ]})
    return out


def backend(url: str, **kw):
    cfg = dict(base_url=url, model="fake-model", max_retries=4, backoff_base_s=0.05, backoff_max_s=0.5,
               timeout_s=1.0, max_concurrency=8, max_retry_after_s=2.0)
    cfg.update(kw)
    return make_backend("openai", **cfg)


def outcome_rows(out) -> int:
    """Call outcomes accounted for: each echo call yields one memory, each bad one a quarantine row."""
    return out.memories.height + out.quarantine.height


def call_outcomes(out) -> dict[tuple[str, str], object]:
    """(episode, memory type) -> its memories (content, evidence), or "quarantined"."""
    got: dict[tuple[str, str], object] = {}
    for r in out.memories.sort("memory_id").iter_rows(named=True):
        got.setdefault((r["episode_id"], r["type"]), []).append((r["content"], tuple(r["evidence_turn_ids"])))
    for r in out.quarantine.iter_rows(named=True):
        got[(r["episode_id"], r["type"])] = "quarantined"
    return got


def recovered_vs_clean(out, clean: dict, failing_episodes: set[str] = frozenset()) -> bool:
    """The run's outcome equals the clean run's, except that calls of `failing_episodes` are quarantined."""
    expected = {k: ("quarantined" if k[0] in failing_episodes else v) for k, v in clean.items()}
    return call_outcomes(out) == expected


def valid_answers(*servers) -> Counter:
    """Prompt key -> how many valid answers the servers delivered for it (from their own logs).

    A request counts when its scripted answer was a valid memory echo *and* the server finished writing it:
    a request logged just before the process died was received, not answered, and a client that never got
    the answer has nothing to checkpoint (counting it made a repeat out of a call nobody paid for)."""
    got: Counter = Counter()
    for s in servers:
        scripted: Counter = Counter()
        for r in s.requests():
            resp = r["response"]
            if (r["path"].endswith("/chat/completions") and resp.get("echo_memory") and resp.get("status", 200) == 200
                    and not set(resp) & {"hang", "truncate", "exit", "drop"}):
                scripted[r["key"]] += 1
        delivered = Counter(g["key"] for g in s.generations()
                            if g["event"] == "end" and g["how"] == "finished" and g.get("echo"))
        for k, n in scripted.items():
            got[k] += min(n, delivered[k])
    return got


def repeated_calls(*servers, reference: Counter | None = None) -> int:
    """Finished calls paid for again: valid answers per request beyond the reference's (default: one each;
    for whole-pipeline runs, the clean run's counts, since distinct calls may share a prompt)."""
    got = valid_answers(*servers)
    return sum(max(0, n - (reference[k] if reference is not None else 1)) for k, n in got.items())


def episode_of(text: str) -> str:
    u, i = text.split(":")[0].removeprefix("EP-u").split("-")
    return f"u{u}-e{i}"


def llm_scenario(name: str, injected: str, rules: list[dict], work: Path, expected: int, clean: dict | None = None,
                 failing: set[str] = frozenset(), **be_kw) -> tuple[dict, object]:
    script = {"rules": rules, "default": [ECHO]}
    t0 = time.perf_counter()
    with RunningFakeServer(script, work / name) as srv, backend(srv.base_url, **be_kw) as be:
        out = decompose_episodes(episodes(), be, created_at=T0)
        repeated = repeated_calls(srv)
    wall = time.perf_counter() - t0
    if clean is None:  # the clean run itself: every call answered, none quarantined
        ok = out.quarantine.height == 0 and set(call_outcomes(out)) == {
            (e["episode_id"], t) for e in episodes() for t in MEMORY_TYPES}
    else:
        ok = recovered_vs_clean(out, clean, failing)
    return {"scenario": f"llm:{name}", "injected": injected, "recovered": ok, "rows_expected": expected,
            "rows_out": outcome_rows(out), "rows_quarantined": out.quarantine.height,
            "rows_lost": expected - outcome_rows(out), "repeated_calls": repeated, "wall_s": wall}, out


def dies_and_returns(work: Path, expected: int, clean: dict) -> dict:
    port = free_port()
    srv = RunningFakeServer({"rules": [{"match": ep_text(1, 2), "responses": [{"exit": True}]}], "default": [ECHO]},
                            work / "die1", port=port)
    box = {}

    def revive():
        srv.proc.wait(timeout=120)
        time.sleep(0.5)
        box["srv"] = RunningFakeServer({"default": [ECHO]}, work / "die2", port=port)

    th = threading.Thread(target=revive)
    th.start()
    t0 = time.perf_counter()
    try:
        with backend(srv.base_url, max_retries=8, backoff_base_s=0.2, backoff_max_s=1.0) as be:
            out = decompose_episodes(episodes(), be, created_at=T0, checkpoint=CheckpointStore(work / "die-data"))
        th.join(timeout=120)
        repeated = repeated_calls(srv, box["srv"])
    finally:
        srv.stop()
        box.get("srv") and box["srv"].stop()
    return {"scenario": "llm:dies-and-returns", "injected": "server process exits mid-run, back after 0.5 s",
            "recovered": recovered_vs_clean(out, clean), "rows_expected": expected, "rows_out": outcome_rows(out),
            "rows_quarantined": out.quarantine.height, "rows_lost": expected - outcome_rows(out),
            "repeated_calls": repeated, "wall_s": time.perf_counter() - t0}


def gone_for_good(work: Path, expected: int, clean: dict) -> dict:
    port = free_port()
    store_root = work / "gone-data"
    t0 = time.perf_counter()
    failed_cleanly, message = False, ""
    with RunningFakeServer({"rules": [{"match": ep_text(2, 0), "responses": [{"exit": True}]}], "default": [ECHO]},
                           work / "gone1", port=port) as s1, backend(s1.base_url) as be:
        try:
            decompose_episodes(episodes(), be, created_at=T0, checkpoint=CheckpointStore(store_root))
        except LLMEndpointError as exc:
            failed_cleanly, message = True, str(exc)
        with RunningFakeServer({"default": [ECHO]}, work / "gone2", port=port) as s2, backend(s2.base_url) as be:
            out = decompose_episodes(episodes(), be, created_at=T0, checkpoint=CheckpointStore(store_root))
            repeated = repeated_calls(s1, s2)  # calls the rerun sent again although the first server had answered them
    return {"scenario": "llm:gone-for-good+rerun", "injected": "server exits and stays down; rerun after it is back",
            "recovered": failed_cleanly and recovered_vs_clean(out, clean), "rows_expected": expected,
            "rows_out": outcome_rows(out), "rows_quarantined": out.quarantine.height,
            "rows_lost": expected - outcome_rows(out), "repeated_calls": repeated, "wall_s": time.perf_counter() - t0,
            "error_message": message}


QUARANTINE_TABLES = ("quarantine", "memory_quarantine", "query_quarantine")
KILL_POINTS = (("episodes.classify", 1), ("decompose.batch", 1), ("index.write", 4), ("warehouse.table", 2))


def quarantined_rows(data_root: Path) -> int:
    return sum(table_rows(data_root / t) for t in QUARANTINE_TABLES if (data_root / t).exists())


RANDOM_KILL_POINT = "llm.call_recorded"  # every finished LLM call, its checkpoint group flushed or not


def kill_window(in_flight: int = 64) -> int:
    """The most finished calls a kill -9 may leave unrecorded, so a rerun pays again (memories/recording.py):
    the checkpoint buffer (flush_every_n - 1 calls; fewer when calls finish slower than flush_every_s) plus
    the answers that arrived but were not yet handed over (the backend's calls in flight: OpenAIBackend's
    default max_concurrency 64 for `qumem run`, this bench's backend() 8)."""
    from qumem_pipeline.memories.stage import CHECKPOINT_FLUSH_CALLS

    return CHECKPOINT_FLUSH_CALLS - 1 + in_flight


DECOMPOSE_CHILD = "--decompose-child"  # argv[1] of the child a decomposition kill runs


def decompose_child(url: str, store_root: str) -> int:
    """The killed process: the decomposition over `episodes()` with its checkpoints under `store_root`."""
    with backend(url, timeout_s=120.0) as be:
        decompose_episodes(episodes(), be, created_at=T0, checkpoint=CheckpointStore(store_root))
    return 0


def decompose_kill_scenarios(work: Path, n_kills: int, seed: int, expected: int) -> list[dict]:
    """A decomposition killed (exit 137, like kill -9) at `n_kills` seed-chosen finished calls, wherever the
    checkpoint buffer stands, then rerun from its checkpoints against the same server (one log per kill)."""
    import random

    t0 = time.perf_counter()
    with RunningFakeServer({"default": [ECHO]}, work / "dk-clean") as srv, backend(srv.base_url, timeout_s=120.0) as be:
        clean_out = decompose_episodes(episodes(), be, created_at=T0, checkpoint=CheckpointStore(work / "dk-clean-store"))
        n_calls = sum(valid_answers(srv).values())
    clean_wall = time.perf_counter() - t0
    reference = call_outcomes(clean_out)
    rng = random.Random(seed)
    hits = rng.sample(range(1, n_calls + 1), min(n_kills, n_calls))
    hits += [rng.randint(1, n_calls) for _ in range(n_kills - len(hits))]
    rows = []
    for i, hit in enumerate(hits):
        w = work / f"dk-{i + 1}"
        t0 = time.perf_counter()
        with RunningFakeServer({"default": [ECHO]}, w / "srv") as srv:
            env = {**os.environ, "QUMEM_FAULT_KILL_AT": f"{RANDOM_KILL_POINT}:{hit}"}
            k = subprocess.run([sys.executable, str(Path(__file__).resolve()), DECOMPOSE_CHILD, srv.base_url,
                                str(w / "store"), str(N_USERS), str(N_EPISODES)],
                               env=env, capture_output=True, text=True, timeout=900)
            with backend(srv.base_url, timeout_s=120.0) as be:
                out = decompose_episodes(episodes(), be, created_at=T0, checkpoint=CheckpointStore(w / "store"))
            repeated = repeated_calls(srv)
        wall = time.perf_counter() - t0
        rows.append({"scenario": f"kill:decompose#{i + 1}", "injected": f"exit 137 at {RANDOM_KILL_POINT} (hit {hit})",
                     "recovered": k.returncode == 137 and recovered_vs_clean(out, reference),
                     "rows_expected": expected, "rows_out": outcome_rows(out), "rows_quarantined": out.quarantine.height,
                     "rows_lost": expected - outcome_rows(out), "repeated_calls": repeated, "wall_s": wall,
                     "slowdown": wall / clean_wall, "window": kill_window(8)})
    return rows


def kill_scenarios(work: Path, points=KILL_POINTS, random_kills: int = 0, kill_seed: int = 0) -> list[dict]:
    if not points and not random_kills:  # `--kill-points ''`: the decomposition kills alone
        return []
    rows = []
    with RunningFakeServer({"default": [ECHO]}, work / "kill-srv") as srv:
        clean = work / "clean"
        write_archive(clean / "archive")
        t0 = time.perf_counter()
        r = run_pipeline(clean, srv.base_url)
        clean_wall = time.perf_counter() - t0
        if r.returncode != 0:
            raise RuntimeError(f"uninterrupted run failed:\n{r.stderr[-3000:]}")
        base, base_rows = snapshot(clean / "data"), table_rows(clean / "data")
        clean_answers = valid_answers(srv)  # the reference: what one uninterrupted run pays for
        rows.append({"scenario": "kill:none (clean run)", "injected": "-", "rows_expected": base_rows,
                     "rows_out": base_rows, "rows_quarantined": quarantined_rows(clean / "data"), "rows_lost": 0,
                     "repeated_calls": None, "llm_calls": sum(clean_answers.values()), "wall_s": clean_wall,
                     "slowdown": 1.0})
        kill_rows = []
        # random kills: at seed-chosen finished calls of the clean run's count, wherever the checkpoint
        # buffer stands (not only right after a flush, as decompose.batch does)
        import random

        n_calls = sum(clean_answers.values())
        rng = random.Random(kill_seed)
        hits = (rng.sample(range(1, n_calls + 1), random_kills) if random_kills <= n_calls
                else [rng.randint(1, n_calls) for _ in range(random_kills)])
        plan = [(point, hit, f"kill:{point}") for point, hit in points]
        plan += [(RANDOM_KILL_POINT, hit, f"kill:random#{i + 1}") for i, hit in enumerate(hits)]
        for point, hit, name in plan:
            w = work / f"{name.replace(':', '-').replace('#', '-')}"
            write_archive(w / "archive")
            t0 = time.perf_counter()
            with RunningFakeServer({"default": [ECHO]}, w / "srv") as ksrv:  # its own log: this scenario's calls
                k = run_pipeline(w, ksrv.base_url, kill_at=f"{point}:{hit}")
                r = run_pipeline(w, ksrv.base_url)
                repeated = repeated_calls(ksrv, reference=clean_answers)
            wall = time.perf_counter() - t0
            got = table_rows(w / "data") if r.returncode == 0 else 0
            kill_rows.append({"scenario": name, "injected": f"exit 137 at {point} (hit {hit})",
                              "recovered": k.returncode == 137 and r.returncode == 0 and snapshot(w / "data") == base
                              and not temp_files(w / "data"),
                              "rows_expected": base_rows, "rows_out": got,
                              "rows_quarantined": quarantined_rows(w / "data") if r.returncode == 0 else None,
                              "rows_lost": base_rows - got, "repeated_calls": repeated, "wall_s": wall,
                              **({"window": kill_window()} if point == RANDOM_KILL_POINT else {})})
        # the first clean run pays cold caches (imports, model files): time a second one, keep the faster;
        # the clean row is `recovered` when that second uninterrupted run equals the first (determinism)
        again = work / "clean2"
        write_archive(again / "archive")
        t0 = time.perf_counter()
        r2 = run_pipeline(again, srv.base_url)
        clean_wall = min(clean_wall, time.perf_counter() - t0)
        rows[0]["wall_s"] = clean_wall
        rows[0]["recovered"] = r2.returncode == 0 and snapshot(again / "data") == base
    for r in kill_rows:
        r["slowdown"] = r["wall_s"] / clean_wall  # killed run + rerun, over one uninterrupted run
    return rows + kill_rows


def bad_rows_scenario(work: Path) -> dict:
    from qumem_pipeline.ingest.archive import ArchiveConfig, load_archive

    good, bad = [], []
    for i in range(200):
        good.append({"user_id": f"u{i % 5}", "conversation_id": "c", "session_id": "c", "role": "user", "text": f"hello {i}",
                     "timestamp": f"2024-01-01T00:{i // 60:02d}:{i % 60:02d}Z", "source_ref": f"g{i}"})
    bad += [{"user_id": "u1", "conversation_id": "c", "role": "robot", "text": "x", "source_ref": "b0"},
            {"user_id": "u1", "conversation_id": "c", "role": "user", "text": "", "source_ref": "b1"},
            {"user_id": "u1", "conversation_id": "c", "role": "user", "text": "y", "timestamp": "not a date", "source_ref": "b2"},
            {"user_id": "../etc", "conversation_id": "c", "role": "user", "text": "z", "source_ref": "b3"},
            {"user_id": "u2", "conversation_id": "c", "role": "user", "text": "w", "timestamp": "2999-01-01T00:00:00Z",
             "source_ref": "b4"}]
    path = work / "bad.jsonl"
    lines = [json.dumps(r) for r in good + bad] + ['{"user_id": "u3", "text": "trunc']
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    t0 = time.perf_counter()
    res = load_archive(ArchiveConfig(path=str(path)))
    n_bad = len(bad) + 1
    got = res.turns.height + res.quarantine.height
    return {"scenario": "input:bad-rows", "injected": f"{n_bad} bad rows among {len(good)} (role, empty text, timestamp, "
            "path user id, future, truncated JSON)", "recovered": res.turns.height == len(good)
            and res.quarantine.height == n_bad and res.quarantine["reason"].is_not_null().all(),
            "rows_expected": len(good) + n_bad, "rows_out": res.turns.height, "rows_quarantined": res.quarantine.height,
            "rows_lost": len(good) + n_bad - got, "repeated_calls": None, "wall_s": time.perf_counter() - t0}


# ------------------------------------------------------------------------------------ erasure under load
# Several `qumem` processes at once on one data root and one Dagster home: pipeline runs (the CLI's own
# `qumem run`, and main/ingest job runs over seed-chosen user subsets, as a backfill would) and
# `qumem forget` of a seed-chosen subset at seed-chosen delays; then the nightly pass over the archive,
# which still holds the forgotten users and has new turns for everyone. Compared with a clean sequential
# reference (the same archive, the same two passes, no forget).
ERASE_TOPICS = TOPICS[:2], TOPICS[2:]  # phase 1 conversations, the later file's (new turns for every user)
SUBSET_RUN = """
import sys
from assets.cli_commands import _defs, _instance, register_users, run_job
job, per_run, subset = sys.argv[1], int(sys.argv[2]), set(sys.argv[3].split(","))
instance, defs = _instance(), _defs()
users = [u for u in register_users(instance, defs) if u in subset]
print(f"[{job}] {len(users)} of the subset's {len(subset)} users registered (the others forgotten)", flush=True)
if users:
    run_job(instance, defs, job, users, per_run)
"""
MEASURE = """
import json, sys
from assets.cli_commands import _defs, _instance, audit_erasure
from qumem_pipeline.storage.forget import warehouse_locations
from qumem_pipeline.storage.table_store import TableStore
from qumem_pipeline.storage.warehouse import Warehouse
spec = json.loads(open(sys.argv[1]).read())
instance, defs = _instance(), _defs()
pipeline = defs.resources["pipeline"]
store = TableStore(pipeline.data_root)
users = spec["users"]
tables = {t: set(store.users_in(t)) for t in store.tables()}
paths = sorted({p for _, p in warehouse_locations(store)} | {str(pipeline.warehouse().path.absolute())})
wh = {}
for p in paths:
    w = Warehouse(p)
    wh[p] = {t: set(w.users(t)) for t in w.counts()} if w.path.exists() else {}
out = {"tombstoned": sorted(store.tombstones().forgotten_among(users)), "warehouses": paths, "users": {}}
for u in users:
    out["users"][u] = {"tables": sorted(t for t, us in tables.items() if u in us),
                       "warehouse_tables": sorted(f"{p}:{t}" for p, ts in wh.items() for t, us in ts.items() if u in us),
                       "audit": audit_erasure(instance, defs, u, spec["canaries"][u])}
print(json.dumps(out))
"""


def erasure_env(w: Path, base_url: str) -> dict:
    """One deployment: the data root, Dagster home and archive of `w`; the LLM is the fake server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUMEM_")}
    env.update({"PYTHONPATH": str(ROOT), "DAGSTER_HOME": str(w / "home"), "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "QUMEM_LLM_KIND": "openai", "QUMEM_LLM_BASE_URL": base_url,
                "QUMEM_LLM_MODEL": "fake-model", "QUMEM_QUERIES": str(w / "queries.jsonl"), "QUMEM_DEVICE": "cpu",
                "QUMEM_ARCHIVE": str(w / "archive"), "QUMEM_DATA_ROOT": str(w / "data")})
    if os.environ.get("QUMEM_CACHE_DIR"):
        env["QUMEM_CACHE_DIR"] = os.environ["QUMEM_CACHE_DIR"]
    return env


def erasure_archive(w: Path, users: list[str], canaries: dict[str, list[str]], phase: int) -> None:
    """Phase 0: two conversations per user, each user's first turns carrying the user's first canary;
    phase 1 adds a later file: one new conversation per user (every user, the forgotten too) with the second."""
    rows = []
    for ui, u in enumerate(users):
        for ci, texts in enumerate(ERASE_TOPICS[phase]):
            month = 1 + ci + 2 * phase
            for i, t in enumerate(texts):
                text = f"{t} (note {canaries[u][phase]})" if i == 0 else t
                rows.append({"user_id": u, "conversation_id": f"{u}-p{phase}c{ci}", "session_id": f"{u}-p{phase}c{ci}",
                             "role": "user" if i % 2 == 0 else "assistant", "speaker": u if i % 2 == 0 else "assistant",
                             "text": text, "timestamp": f"2024-{month:02d}-{10 + ui % 18:02d}T10:0{i}:00Z",
                             "source_ref": f"{u}-p{phase}c{ci}-{i}"})
    (w / "archive").mkdir(parents=True, exist_ok=True)
    (w / "archive" / f"part{phase}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (w / "queries.jsonl").write_text("", encoding="utf-8")


def qumem(*args: str) -> list[str]:
    return [sys.executable, "-m", "qumem_pipeline.cli", *args]


def run_cmd(cmd: list[str], env: dict, w: Path, timeout: float = 900) -> dict:
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=w, env=env, capture_output=True, text=True, timeout=timeout)
        rc, stdout, tail = r.returncode, r.stdout, (r.stdout + r.stderr)[-3000:]
    except subprocess.TimeoutExpired as exc:
        rc, stdout, tail = "timeout", "", str(exc)[-3000:]
    return {"rc": rc, "wall_s": time.perf_counter() - t0, "stdout": stdout, "tail": tail}


def must(res: dict, what: str) -> dict:
    if res["rc"] != 0:
        raise RuntimeError(f"{what} failed (rc {res['rc']}):\n{res['tail']}")
    return res


def measure(w: Path, env: dict, canaries: dict[str, list[str]]) -> dict:
    spec = w / "measure.json"
    spec.write_text(json.dumps({"users": sorted(canaries), "canaries": canaries}), encoding="utf-8")
    res = must(run_cmd([sys.executable, "-c", MEASURE, str(spec)], env, w), f"measure {w}")
    return json.loads(res["stdout"].strip().splitlines()[-1])


def audit_objects(report: dict) -> tuple[set[str], bool]:
    """The objects an audit report names (data root objects, warehouse tables or files, instance tables,
    files under DAGSTER_HOME), and whether any of them holds a canary."""
    objs, canary = set(), False
    for h in report["data_root"]["hits"]:
        objs.add(f"data:{h['object']}")
        canary |= any(f.startswith("canary:") for f in h["found"])
    for wh in report["warehouses"]:
        for h in wh["hits"]:
            objs.add(f"warehouse:{wh['path']}:{h['table'] or h['column']}")
            canary |= h["found"].startswith("canary:")
    for h in report["instance_tables"]:
        objs.add(f"instance:{h['storage']}:{h['table']}")
        canary |= h["needle"] != report["user_id"]
    for f in report["instance_files"]:
        objs.add(f"home:{f}")  # a file names the id or a canary (which one, the scan does not say)
    return objs, canary


def kept_rows(w: Path, kept: set[str]) -> tuple[Counter, Counter]:
    """Every row of the users in `kept`: each Delta table's (store and volatile columns dropped), each
    warehouse table's; keyed by table, compared as multisets. Paths under `w` read as <work>.
    `code_version` is left out too: it hashes the source, which may change between the reference and
    the scenario when the tree is being edited (the rows are the same data under another version tag).
    Returns (rows, identities): an identity is the row without its float and binary columns (scores,
    embeddings, FAISS bytes), which batch composition moves in the last bits (a run of one user
    classifies and embeds in other batches than a run of four); a row is lost when its identity is missing."""
    from crash_harness import VOLATILE_COLUMNS
    import duckdb
    import polars as pl
    from qumem_pipeline.storage.layout import DataLayout
    from qumem_pipeline.storage.table_store import STORE_COLUMNS

    rows: Counter = Counter()
    ids: Counter = Counter()
    layout = DataLayout(w / "data")
    unstable = VOLATILE_COLUMNS | {"code_version"}

    def add(table: str, records, numeric: set[str]) -> None:
        for r in records:
            rows[(table, json.dumps(r, sort_keys=True, default=str).replace(str(w), "<work>"))] += 1
            ident = {c: v for c, v in r.items() if c not in numeric}
            ids[(table, json.dumps(ident, sort_keys=True, default=str).replace(str(w), "<work>"))] += 1

    def float_or_binary(dt) -> bool:
        inner = getattr(dt, "inner", None)
        return dt.is_float() or dt == pl.Binary or (inner is not None and (inner.is_float() or inner == pl.Binary))

    for t in layout.tables():
        df = layout.store.read(t)
        if df is None or "user_key" not in df.columns:
            continue
        df = df.filter(df["user_key"].is_in(sorted(kept)))
        df = df.drop([c for c in df.columns if c in unstable or c in STORE_COLUMNS])
        add(f"table:{t}", df.to_dicts(), {c for c, dt in df.schema.items() if float_or_binary(dt)})
    wh = w / "data" / "warehouse.duckdb"
    if wh.exists():
        with duckdb.connect(str(wh), read_only=True) as con:
            for (t,) in con.execute("SELECT table_name FROM information_schema.tables WHERE table_schema='main'").fetchall():
                cur = con.execute(f'SELECT * FROM "{t}"')
                cols = [d[0] for d in cur.description]
                if "user_id" not in cols:
                    continue
                numeric = {d[0] for d in cur.description if any(k in str(d[1]).upper() for k in ("FLOAT", "DOUBLE", "BLOB"))}
                add(f"warehouse:{t}", ({c: v for c, v in zip(cols, r) if c not in unstable}
                                       for r in cur.fetchall() if r[cols.index("user_id")] in kept), numeric)
    return rows, ids


def erasure_reference(work: Path, n_users: int) -> dict:
    """The archive every seed uses (users with a unique canary per phase, from a fixed generator), and its
    clean sequential reference: the same two passes, one process at a time, no forget."""
    import random

    rng = random.Random("qumem-erasure-archive")
    users = [f"erasure-user{i}" for i in range(n_users)]
    canaries = {u: [f"canary{rng.getrandbits(48):012x}" for _ in range(2)] for u in users}
    ref = work / "erasure-ref"
    t0 = time.perf_counter()
    with RunningFakeServer({"default": [ECHO]}, ref / "srv") as srv:
        env = erasure_env(ref, srv.base_url)
        for phase in (0, 1):
            erasure_archive(ref, users, canaries, phase)
            must(run_cmd(qumem("run"), env, ref), f"reference pass {phase}")
        answers = valid_answers(srv)
    wall = time.perf_counter() - t0
    # the audit's sensitivity: in the reference (nobody forgotten) it must find every user and canary
    found = measure(ref, env, canaries)
    return {"dir": ref, "users": users, "canaries": canaries, "answers": answers, "wall_s": wall,
            "audit_found": sorted(u for u in users if found["users"][u]["audit"]["found"]),
            "tables_per_user": {u: len(found["users"][u]["tables"]) for u in users}}


def erasure_seed(work: Path, seed: int, ref: dict, n_runs: int, n_forgets: int, max_delay: float) -> dict:
    """One interleaving chosen by `seed`: which users are forgotten and when, which runs go beside them."""
    import random

    rng = random.Random(seed)
    users, canaries, n_users = ref["users"], ref["canaries"], len(ref["users"])
    forgotten = sorted(rng.sample(users, n_forgets))
    kept = set(users) - set(forgotten)
    runs = []
    for i in range(n_runs):
        kind = ("run", "main_job", "ingest_job")[i % 3]
        subset = users if kind == "run" else sorted(rng.sample(users, max(2, (2 * n_users + 2) // 3)))
        runs.append({"kind": kind, "users": subset, "per_run": rng.choice(sorted({1, 2, n_users})),
                     "delay_s": round(rng.uniform(0, 2.0), 2)})
    forgets = [{"user": u, "delay_s": round(rng.uniform(0, max_delay), 2)} for u in forgotten]
    out = {"seed": seed, "users": n_users, "forgotten": forgotten, "runs": runs, "forgets": forgets}

    w = work / f"erasure-{seed}"
    t0 = time.perf_counter()
    with RunningFakeServer({"default": [ECHO]}, w / "srv") as srv:
        env = erasure_env(w, srv.base_url)
        erasure_archive(w, users, canaries, 0)
        results: dict[str, dict] = {}

        def launch(name: str, delay: float, cmd: list[str]) -> threading.Thread:
            def go():
                time.sleep(delay)
                results[name] = run_cmd(cmd, env, w, timeout=420)  # a forget waits for covering runs, not for ever
            th = threading.Thread(target=go)
            th.start()
            return th

        threads = []
        for i, r in enumerate(runs):
            cmd = (qumem("run", "--users-per-run", str(r["per_run"])) if r["kind"] == "run" else
                   [sys.executable, "-c", SUBSET_RUN, r["kind"], str(r["per_run"]), ",".join(r["users"])])
            threads.append(launch(f"run{i}", r["delay_s"], cmd))
        for f in forgets:
            threads.append(launch(f"forget:{f['user']}", f["delay_s"], qumem("forget", f["user"])))
        for th in threads:
            th.join()
        concurrent_wall = time.perf_counter() - t0
        # the nightly pass: the archive still holds the forgotten users, and a later file has new turns for all
        erasure_archive(w, users, canaries, 1)
        results["nightly"] = run_cmd(qumem("run"), env, w)
        answers = valid_answers(srv)
    wall = time.perf_counter() - t0
    end = measure(w, env, {u: canaries[u] for u in forgotten})

    forget_ok = [f["user"] for f in forgets if results[f"forget:{f['user']}"]["rc"] == 0]
    residue: set[str] = set()
    resurrected = []
    for u in forgotten:
        m = end["users"][u]
        objs, canary = audit_objects(m["audit"])
        residue |= objs
        if m["tables"] or m["warehouse_tables"] or canary:
            resurrected.append(u)
    (ref_rows, ref_ids), (got_rows, got_ids) = kept_rows(ref["dir"], kept), kept_rows(w, kept)
    lost, extra = ref_ids - got_ids, got_ids - ref_ids
    drifted = sum((ref_rows - got_rows).values()) - sum(lost.values())  # same identity, other float/binary values
    failed = {k: v for k, v in results.items() if v["rc"] != 0}
    out.update({
        "resurrected_users": len(resurrected),
        "tombstones_lost": len(set(forget_ok) - set(end["tombstoned"])),
        "residue_objects": len(residue),
        "rows_lost": sum(lost.values()),
        "repeated_calls": sum(max(0, n - ref["answers"][k]) for k, n in answers.items()),
        # what the figures are measured against (counted in this run, not set)
        "forgets_succeeded": len(forget_ok),
        "processes_failed": sorted(failed),
        "rows_expected": sum(ref_rows.values()),
        "rows_extra": sum(extra.values()),
        "rows_float_drift": drifted,
        "changed_by_table": dict(Counter(t for t, _ in (ref_rows - got_rows).elements())),
        "llm_calls": sum(answers.values()), "llm_calls_reference": sum(ref["answers"].values()),
        "audit_found_in_reference": sum(1 for u in forgotten if u in ref["audit_found"]),
        "reference_tables_with_forgotten": sum(ref["tables_per_user"][u] for u in forgotten),
        "objects_scanned": sum(end["users"][u]["audit"]["data_root"]["objects_scanned"] for u in forgotten),
        "resurrected": resurrected, "residue": sorted(residue)[:20],
        "lost_by_table": dict(Counter(t for t, _ in lost.elements())),
        "extra_by_table": dict(Counter(t for t, _ in extra.elements())),
        "wall_s": wall, "concurrent_wall_s": concurrent_wall, "reference_wall_s": ref["wall_s"],
        "process_wall_s": {k: round(v["wall_s"], 1) for k, v in results.items()},
        "failures": {k: v["tail"][-1500:] for k, v in failed.items()},
    })
    return out


def erasure_scenarios(work: Path, seeds: list[int], n_users: int, **kw) -> tuple[list[dict], dict]:
    ref = erasure_reference(work, n_users)
    per_seed = [erasure_seed(work, s, ref, **kw) for s in seeds]
    keys = ("resurrected_users", "tombstones_lost", "residue_objects", "rows_lost", "repeated_calls")
    rows = []
    for r in per_seed:
        ok = all(r[k] == 0 for k in keys) and not r["processes_failed"]
        rows.append({"scenario": f"erasure:seed{r['seed']}",
                     "injected": f"{len(r['runs'])} runs + {len(r['forgotten'])} forgets of {r['users']} users at once",
                     "recovered": ok, "rows_expected": r["rows_expected"], "rows_out": r["rows_expected"] - r["rows_lost"],
                     "rows_quarantined": None, "rows_lost": r["rows_lost"], "repeated_calls": r["repeated_calls"],
                     "wall_s": r["wall_s"], "slowdown": r["wall_s"] / r["reference_wall_s"]})
    summary = {k: sum(r[k] for r in per_seed) for k in keys}
    summary.update({"seeds": per_seed, "forgets": sum(len(r["forgotten"]) for r in per_seed),
                    "reference": {"users": len(ref["users"]), "wall_s": round(ref["wall_s"], 1),
                                  "llm_calls": sum(ref["answers"].values()), "audit_found_users": len(ref["audit_found"]),
                                  "rows": sum(kept_rows(ref["dir"], set(ref["users"]))[0].values())},
                    "forgets_succeeded": sum(r["forgets_succeeded"] for r in per_seed),
                    "processes_failed": sum(len(r["processes_failed"]) for r in per_seed)})
    return rows, summary


def print_erasure(summary: dict) -> None:
    keys = ("resurrected_users", "tombstones_lost", "residue_objects", "rows_lost", "repeated_calls")
    heads = ("resurrected", "tomb lost", "residue", "rows lost", "repeated")
    print(f"\n{'erasure seed':<14}{'forgot':>7}{'ok':>4}{'failed':>7}" + "".join(f"{h:>12}" for h in heads)
          + f"{'rows ref':>9}{'extra':>7}{'calls':>7}{'ref':>6}{'wall s':>8}")
    for r in summary["seeds"]:
        print(f"{r['seed']:<14}{len(r['forgotten']):>7}{r['forgets_succeeded']:>4}{len(r['processes_failed']):>7}"
              + "".join(f"{r[k]:>12}" for k in keys)
              + f"{r['rows_expected']:>9}{r['rows_extra']:>7}{r['llm_calls']:>7}{r['llm_calls_reference']:>6}{r['wall_s']:>8.1f}")
    print("total".ljust(14) + f"{summary['forgets']:>7}{summary['forgets_succeeded']:>4}{summary['processes_failed']:>7}"
          + "".join(f"{summary[k]:>12}" for k in keys))


def base_scenarios(work: Path, expected: int, kills: bool, points, random_kills: int = 0, kill_seed: int = 0,
                   pipeline_random_kills: int = 0) -> list[dict]:
    """The LLM endpoint, bad-row and (unless `kills` is false) killed-run scenarios."""
    rows = []
    clean, clean_out = llm_scenario("clean", "-", [], work, expected)
    reference = call_outcomes(clean_out)
    rows.append(clean)
    one = ep_text(0, 3)
    specs = [
        ("5xx-burst", "500, 502, 503 x3 on one episode", [{"match": one, "responses": [{"status": 500}, {"status": 502}, {"status": 503}] * 3 + [ECHO]}], {}),
        ("429-retry-after", "429 Retry-After: 1 (x3)", [{"match": one, "responses": [{"status": 429, "retry_after": 1}] * 3 + [ECHO]}], {}),
        ("hung-connection", "server sleeps 3 s > 1 s client timeout (x3)", [{"match": one, "responses": [{"hang": 3}] * 3 + [ECHO]}], {}),
        ("mid-response-disconnect", "half a body, then close (x3)", [{"match": one, "responses": [{"truncate": True}] * 3 + [ECHO]}], {}),
        ("non-json-body", "HTTP 200 HTML page (x3)", [{"match": one, "responses": [{"garbage": "<html>bad gateway</html>"}] * 3 + [ECHO]}], {}),
        ("malformed-output", "unterminated JSON for 2 episodes (quarantined)", [
            {"match": ep_text(1, 1), "responses": [{"content": '{"memories": [{"content": "cut'}]},
            {"match": ep_text(3, 4), "responses": [{"content": "not json"}]}], {}),
        ("schema-violating-output", "wrong types for 1 episode (quarantined)", [
            {"match": ep_text(2, 5), "responses": [{"json": {"memories": [{"content": 1, "evidence_turn_ids": "x"}]}}]}], {}),
    ]
    for name, injected, rules, kw in specs:
        # rules that answer bad output every time make their episode's calls quarantined; the others recover
        failing = {episode_of(r["match"]) for r in rules if not any(x.get("echo_memory") for x in r["responses"])}
        rows.append(llm_scenario(name, injected, rules, work, expected, clean=reference, failing=failing, **kw)[0])
    rows.append(dies_and_returns(work, expected, reference))
    rows.append(gone_for_good(work, expected, reference))
    for r in rows:
        r.setdefault("slowdown", r["wall_s"] / clean["wall_s"])
    rows.append(bad_rows_scenario(work))
    rows[-1]["slowdown"] = None
    if kills:
        rows.extend(decompose_kill_scenarios(work, random_kills, kill_seed, expected))
        rows.extend(kill_scenarios(work, points, pipeline_random_kills, kill_seed))
    return rows


def main() -> int:
    global N_USERS, N_EPISODES
    if len(sys.argv) > 1 and sys.argv[1] == DECOMPOSE_CHILD:  # a decomposition kill's child process
        N_USERS, N_EPISODES = int(sys.argv[4]), int(sys.argv[5])
        return decompose_child(sys.argv[2], sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-kills", action="store_true", help="skip the killed-run scenarios (about 6 minutes on 2 cores)")
    ap.add_argument("--kill-points", default=",".join(p for p, _ in KILL_POINTS),
                    help="comma-separated fault points for the killed runs (default: all)")
    ap.add_argument("--random-kills", type=int, default=20,
                    help=f"a decomposition killed at this many seed-chosen finished LLM calls ({RANDOM_KILL_POINT})")
    ap.add_argument("--pipeline-random-kills", type=int, default=0,
                    help="`qumem run` killed at this many seed-chosen finished LLM calls, beside the fixed points "
                         "(each a killed run and a rerun of the whole pipeline)")
    ap.add_argument("--kill-seed", type=int, default=0, help="seed of the random kill points")
    ap.add_argument("--users", type=int, default=N_USERS)
    ap.add_argument("--episodes", type=int, default=N_EPISODES, help="episodes per user (at least 6 unless --smoke)")
    ap.add_argument("--smoke", action="store_true", help="smallest configuration: the LLM and bad-row scenarios, no killed runs")
    ap.add_argument("--scenario", choices=("default", "erasure", "all", "kills"), default=None,
                    help="default: LLM, bad-row and killed-run scenarios; erasure: only erasure under load; "
                         "all (the default without --smoke): both; kills: only the killed runs (fixed and random points)")
    ap.add_argument("--seeds", default="0,1,2", help="erasure: comma-separated seeds, one scenario each")
    ap.add_argument("--erasure-users", type=int, default=4, help="erasure: users in the archive")
    ap.add_argument("--erasure-runs", type=int, default=3, help="erasure: concurrent pipeline runs (run / main_job / ingest_job)")
    ap.add_argument("--erasure-forgets", type=int, default=2, help="erasure: users forgotten beside the runs")
    ap.add_argument("--erasure-delay", type=float, default=20.0, help="erasure: forgets start at a seed-chosen delay in [0, this] s")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.skip_kills = True
    if args.scenario is None:  # a plain run shows every scenario; --smoke stays the quick one
        args.scenario = "default" if args.smoke else "all"
    base = args.scenario in ("default", "all")
    erasure = args.scenario in ("erasure", "all")
    N_USERS, N_EPISODES = args.users, args.episodes
    if base and (N_USERS < 4 or N_EPISODES < 6):
        ap.error("the scenarios inject faults into users 0-3 and episodes 0-5: need --users >= 4 and --episodes >= 6")
    if erasure and not 1 <= args.erasure_forgets < args.erasure_users:
        ap.error("--erasure-forgets must be at least 1 and leave at least one user kept")
    points = [(p, h) for p, h in KILL_POINTS if p in args.kill_points.split(",")]
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    work = Path(tempfile.mkdtemp(prefix="qumem-bench-faults-"))
    expected = N_USERS * N_EPISODES * 3
    rows, erasure_summary = [], None
    try:
        if base:
            rows.extend(base_scenarios(work, expected, not args.skip_kills, points, args.random_kills, args.kill_seed,
                                       args.pipeline_random_kills))
        elif args.scenario == "kills":
            rows.extend(decompose_kill_scenarios(work, args.random_kills, args.kill_seed, expected))
            rows.extend(kill_scenarios(work, points, args.pipeline_random_kills, args.kill_seed))
        if erasure:
            erows, erasure_summary = erasure_scenarios(work, seeds, n_users=args.erasure_users,
                                                       n_runs=args.erasure_runs, n_forgets=args.erasure_forgets,
                                                       max_delay=args.erasure_delay)
            rows.extend(erows)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"{'scenario':<30}{'injected':<52}{'recovered':>10}{'rows':>7}{'quar.':>7}{'lost':>6}{'repeat':>8}{'wall s':>9}")
    for r in rows:
        print(f"{r['scenario']:<30}{r['injected'][:51]:<52}{str(r['recovered']):>10}{r['rows_expected']:>7}"
              f"{str(r['rows_quarantined']):>7}{r['rows_lost']:>6}{str(r['repeated_calls']):>8}{r['wall_s']:>9.2f}")
    total = sum(r["rows_lost"] for r in rows)
    print(f"total rows lost: {total}; all recovered: {all(r['recovered'] for r in rows)}")
    # random kills repay at most the documented window each (memories/recording.py); every other row 0
    random_rows = [r for r in rows if "window" in r]  # kill:decompose#i and kill:random#i
    random_summary = None
    if random_rows:
        reps = [r["repeated_calls"] for r in random_rows]
        random_summary = {"point": RANDOM_KILL_POINT, "kills": len(random_rows), "seed": args.kill_seed,
                          "scenarios": [r["scenario"] for r in random_rows],
                          "hits": [int(r["injected"].rsplit("hit ", 1)[1].rstrip(")")) for r in random_rows],
                          "repeated_calls": reps, "repeated_calls_total": sum(reps), "repeated_calls_max": max(reps),
                          "bound_per_kill": sorted({r["window"] for r in random_rows}),
                          "within_bound": all(r["repeated_calls"] <= r["window"] for r in random_rows)}
        print(f"random kills: {len(reps)} at {RANDOM_KILL_POINT}; repeated calls total {sum(reps)}, max {max(reps)} "
              f"(bound per kill {random_summary['bound_per_kill']})")
    if erasure_summary is not None:
        print_erasure(erasure_summary)
    if args.json:
        for r in rows:
            r["wall_s"] = round(r["wall_s"], 3)
            if r.get("slowdown") is not None:
                r["slowdown"] = round(r["slowdown"], 2)
        out = {"rows": rows, "total_rows_lost": total, "all_recovered": all(r["recovered"] for r in rows),
               "total_repeated_calls": sum(r["repeated_calls"] or 0 for r in rows if r not in random_rows),
               "random_kills": random_summary,
               "config": {"scenario": args.scenario, "users": N_USERS, "episodes_per_user": N_EPISODES,
                          "kill_points": [] if args.skip_kills or not (base or args.scenario == "kills")
                          else [p for p, _ in points]}}
        if erasure_summary is not None:
            for r in erasure_summary["seeds"]:
                for k in ("wall_s", "concurrent_wall_s", "reference_wall_s"):
                    r[k] = round(r[k], 1)
            out["erasure"] = erasure_summary
            out["config"]["erasure"] = {"seeds": seeds, "users": args.erasure_users, "runs": args.erasure_runs,
                                        "forgets": args.erasure_forgets, "max_delay_s": args.erasure_delay}
        print(json.dumps(out))
    repeated = sum(r["repeated_calls"] or 0 for r in rows if r not in random_rows)
    bounded = random_summary is None or random_summary["within_bound"]
    return 0 if total == 0 and repeated == 0 and bounded and all(r["recovered"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
