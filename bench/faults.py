"""Fault report (issue 7): inject each fault, recover, and count the rows lost (must be 0).

    python bench/faults.py [--skip-kills] [--json]

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
- Bad input rows through ingest validation: every valid row arrives, every bad one is quarantined
  (`repeated_calls` is null: no LLM call is made).
`slowdown` = the scenario's wall time over the clean run of its kind measured in this same run.
The last line (with --json) is one JSON object: {"rows": [...], "total_rows_lost": n, ...}.
`--smoke`: the LLM and bad-row scenarios only (no killed runs; about 30 s on 2 cores).
"""

import argparse
import json
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


from crash_harness import run_pipeline, snapshot, table_rows, temp_files, write_archive  # noqa: E402
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


def kill_scenarios(work: Path, points=KILL_POINTS) -> list[dict]:
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
        for point, hit in points:
            w = work / f"kill-{point}"
            write_archive(w / "archive")
            t0 = time.perf_counter()
            with RunningFakeServer({"default": [ECHO]}, w / "srv") as ksrv:  # its own log: this scenario's calls
                k = run_pipeline(w, ksrv.base_url, kill_at=f"{point}:{hit}")
                r = run_pipeline(w, ksrv.base_url)
                repeated = repeated_calls(ksrv, reference=clean_answers)
            wall = time.perf_counter() - t0
            got = table_rows(w / "data") if r.returncode == 0 else 0
            kill_rows.append({"scenario": f"kill:{point}", "injected": f"exit 137 at {point} (hit {hit})",
                              "recovered": k.returncode == 137 and r.returncode == 0 and snapshot(w / "data") == base
                              and not temp_files(w / "data"),
                              "rows_expected": base_rows, "rows_out": got,
                              "rows_quarantined": quarantined_rows(w / "data") if r.returncode == 0 else None,
                              "rows_lost": base_rows - got, "repeated_calls": repeated, "wall_s": wall})
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


def main() -> int:
    global N_USERS, N_EPISODES
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-kills", action="store_true", help="skip the killed-run scenarios (about 6 minutes on 2 cores)")
    ap.add_argument("--kill-points", default=",".join(p for p, _ in KILL_POINTS),
                    help="comma-separated fault points for the killed runs (default: all)")
    ap.add_argument("--users", type=int, default=N_USERS)
    ap.add_argument("--episodes", type=int, default=N_EPISODES, help="episodes per user (at least 6 unless --smoke)")
    ap.add_argument("--smoke", action="store_true", help="smallest configuration: the LLM and bad-row scenarios, no killed runs")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.skip_kills = True
    N_USERS, N_EPISODES = args.users, args.episodes
    if N_USERS < 4 or N_EPISODES < 6:
        ap.error("the scenarios inject faults into users 0-3 and episodes 0-5: need --users >= 4 and --episodes >= 6")
    points = [(p, h) for p, h in KILL_POINTS if p in args.kill_points.split(",")]
    work = Path(tempfile.mkdtemp(prefix="qumem-bench-faults-"))
    expected = N_USERS * N_EPISODES * 3
    try:
        clean, clean_out = llm_scenario("clean", "-", [], work, expected)
        reference = call_outcomes(clean_out)
        rows = [clean]
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
        if not args.skip_kills:
            rows.extend(kill_scenarios(work, points))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"{'scenario':<30}{'injected':<52}{'recovered':>10}{'rows':>7}{'quar.':>7}{'lost':>6}{'repeat':>8}{'wall s':>9}")
    for r in rows:
        print(f"{r['scenario']:<30}{r['injected'][:51]:<52}{str(r['recovered']):>10}{r['rows_expected']:>7}"
              f"{str(r['rows_quarantined']):>7}{r['rows_lost']:>6}{str(r['repeated_calls']):>8}{r['wall_s']:>9.2f}")
    total = sum(r["rows_lost"] for r in rows)
    print(f"total rows lost: {total}; all recovered: {all(r['recovered'] for r in rows)}")
    if args.json:
        for r in rows:
            r["wall_s"] = round(r["wall_s"], 3)
            if r.get("slowdown") is not None:
                r["slowdown"] = round(r["slowdown"], 2)
        print(json.dumps({"rows": rows, "total_rows_lost": total, "all_recovered": all(r["recovered"] for r in rows),
                          "total_repeated_calls": sum(r["repeated_calls"] or 0 for r in rows),
                          "config": {"users": N_USERS, "episodes_per_user": N_EPISODES,
                                     "kill_points": [] if args.skip_kills else [p for p, _ in points]}}))
    repeated = sum(r["repeated_calls"] or 0 for r in rows)
    return 0 if total == 0 and repeated == 0 and all(r["recovered"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
