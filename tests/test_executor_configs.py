"""Scale-out by configuration: the multiprocess executor run for real, the Kubernetes executor and
the vLLM pool configuration loaded and checked against their manifest."""

import importlib
import json
import os

import dagster as dg
import pytest
import yaml

from tests.conftest import REPO_ROOT

RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"
VLLM_POOL = REPO_ROOT / "deploy" / "k8s" / "vllm-pool.yaml"
PIPELINE = REPO_ROOT / "deploy" / "k8s" / "pipeline.yaml"



def test_multiprocess_executor_runs_two_users_in_separate_processes(tmp_path, dagster_env, small_archive):
    data_root, set_archive = dagster_env
    set_archive(small_archive)
    import deploy.multiprocess

    job = importlib.reload(deploy.multiprocess).job("ingest_job")  # resources read this test's environment
    assert job.executor_def.name == "qumem_multiprocess"
    (tmp_path / "dagster_home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster_home")) as instance:
        instance.add_dynamic_partitions("users", ["alice", "bob", "chen"])
        with dg.execute_job(
            dg.build_reconstructable_job("deploy.multiprocess", "job", ("ingest_job",)), instance=instance,
            tags={RANGE_START: "alice", RANGE_END: "bob"},
        ) as result:
            assert result.success
            step_pids = {e.step_key: e.pid for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_START}
        assert instance.get_materialized_partitions(dg.AssetKey("turns")) == {"alice", "bob"}
        assert instance.get_materialized_partitions(dg.AssetKey("warehouse")) == {"alice", "bob"}
    assert set(step_pids) == {"turns", "warehouse"}
    assert os.getpid() not in step_pids.values() and len(set(step_pids.values())) == 2, step_pids
    from qumem_pipeline.storage.layout import DataLayout

    # the archive sync ingests each new file once for every user it holds; the run published alice and bob
    assert DataLayout(data_root).users_in("turns") == ["alice", "bob", "chen"]


def _pool_manifest() -> dict:
    """The vLLM pool and the pipeline's ConfigMap (the only object of each kind across both files)."""
    docs = [*yaml.safe_load_all(VLLM_POOL.read_text()), *yaml.safe_load_all(PIPELINE.read_text())]
    return {doc["kind"]: doc for doc in docs if doc["kind"] != "PersistentVolumeClaim"}


@pytest.fixture
def k8s_defs(monkeypatch, tmp_path):
    """deploy.k8s.definitions loaded with the environment its step pods get (the ConfigMap)."""
    pytest.importorskip("dagster_k8s", reason="dagster-k8s missing: scripts/install.sh installs it")
    for key in list(os.environ):
        if key.startswith("QUMEM_"):
            monkeypatch.delenv(key)
    for key, value in _pool_manifest()["ConfigMap"]["data"].items():
        monkeypatch.setenv(key, str(value))
    import deploy.k8s.definitions

    return importlib.reload(deploy.k8s.definitions)


def test_k8s_executor_configuration_loads_with_gpu_requests(k8s_defs):
    from dagster_k8s.job import UserDefinedDagsterK8sConfig
    from dagster_k8s.models import k8s_model_from_dict
    from kubernetes.client import V1Container, V1PodSpec

    defs = k8s_defs.defs
    for name in ("main_job", "ingest_job"):
        job = defs.resolve_job_def(name)
        assert job.executor_def.name == "qumem_k8s"
        dg.validate_run_config(job)  # the baked-in executor config against dagster-k8s's schema
    # GPU for the in-process model steps of the gpu pool; the LLM-only step calls the vLLM pool.
    per_step = {k: v for k, v in k8s_defs.EXECUTOR_CONFIG["per_step_k8s_config"].items() if v is k8s_defs.GPU_STEP}
    assert sorted(per_step) == ["episodes", "memory_embeddings", "memory_indexes", "persona_profiles", "personalize_op", "query_states"]
    graph = defs.resolve_asset_graph()
    assert graph.get(dg.AssetKey("memories")).pools == {"gpu"} and "memories" not in per_step
    for step_cfg in [*k8s_defs.EXECUTOR_CONFIG["per_step_k8s_config"].values(), k8s_defs.EXECUTOR_CONFIG["step_k8s_config"]]:
        UserDefinedDagsterK8sConfig.from_dict(step_cfg)
        container = k8s_model_from_dict(V1Container, {"name": "step", **step_cfg["container_config"]})
        k8s_model_from_dict(V1PodSpec, {"containers": [{"name": "step"}], **step_cfg.get("pod_spec_config", {})})
        gpus = ((container.resources.requests if container.resources else None) or {}).get("nvidia.com/gpu")
        assert gpus == ("1" if step_cfg in per_step.values() else None)
    assert k8s_defs.EXECUTOR_CONFIG["env_config_maps"] == [_pool_manifest()["ConfigMap"]["metadata"]["name"]]


def test_k8s_resources_point_the_openai_backend_at_the_vllm_pool(k8s_defs):
    manifest = _pool_manifest()
    deployment, service = manifest["Deployment"], manifest["Service"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = dict((a.lstrip("-").split("=", 1) + [""])[:2] for a in container["args"])

    llm = k8s_defs.defs.resources["llm"]
    assert llm.kind == "openai" and llm.model == args["served-model-name"]
    # the base URL names the Service and its port, which routes to the replicas' server port
    svc_port = service["spec"]["ports"][0]
    assert llm.base_url == f"http://{service['metadata']['name']}:{svc_port['port']}/v1"
    named_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named_ports[svc_port["targetPort"]] == int(args["port"])
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert deployment["spec"]["replicas"] >= 2 and container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # the same server flags the vllm-managed backend uses: compact JSON from xgrammar, cached-token counts
    assert json.loads(args["structured-outputs-config"]) == {"backend": "xgrammar", "disable_any_whitespace": True}
    assert "enable-prompt-tokens-details" in args
    assert k8s_defs.defs.resources["pipeline"].strict is False  # production keeps the quarantine contract


def test_pool_configuration_drives_the_openai_backend(k8s_defs, tmp_path, monkeypatch):
    """The production LLM resource, with a local server standing in for the Service, makes real calls."""
    from fake_openai_server import RunningFakeServer
    from qumem_pipeline.llm import ChatRequest
    from resources import resources_for

    served = _pool_manifest()["ConfigMap"]["data"]["QUMEM_LLM_MODEL"]
    script = {"model": served, "default": [{"json": {"answer": "ok"}}]}
    with RunningFakeServer(script, tmp_path / "srv") as srv:
        monkeypatch.setenv("QUMEM_LLM_BASE_URL", srv.base_url)
        llm = resources_for()["llm"]
        schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
        try:
            results = llm.backend.generate([
                ChatRequest(request_id=f"r{i}", messages=[{"role": "user", "content": f"q{i}"}],
                            json_schema=schema, max_tokens=16, schema_name="answer_obj")
                for i in range(4)
            ])
        finally:
            llm.teardown_after_execution(None)
        bodies = [r["body"] for r in srv.requests() if r["path"].endswith("/chat/completions")]
    assert [r.parsed for r in results] == [{"answer": "ok"}] * 4
    assert len(bodies) == 4 and {b["model"] for b in bodies} == {served}
