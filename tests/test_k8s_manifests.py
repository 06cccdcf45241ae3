"""The Kubernetes deployment, checked offline: the Job dagster-k8s builds for every step of the
main job (deploy.k8s.definitions.step_job_manifests: dagster-k8s's own container-context merge and
`construct_dagster_k8s_job`), and every manifest under deploy/k8s, validated against the
Kubernetes schema (kubernetes-validate's bundled schemas, strict: unknown fields fail)."""

import importlib
import os

import pytest
import yaml

from tests.conftest import REPO_ROOT

K8S_DIR = REPO_ROOT / "deploy" / "k8s"
K8S_VERSION = "1.33.0"
pytest.importorskip("dagster_k8s", reason="dagster-k8s missing: scripts/install.sh installs it")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (test extra) missing")


def _docs(path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _config_map() -> dict:
    (cm,) = [d for d in _docs(K8S_DIR / "pipeline.yaml") if d["kind"] == "ConfigMap"]
    return cm


@pytest.fixture
def k8s(monkeypatch):
    """deploy.k8s.definitions with the environment its pods get (the ConfigMap), scheme included."""
    for key in list(os.environ):
        if key.startswith("QUMEM_"):
            monkeypatch.delenv(key)
    for key, value in _config_map()["data"].items():
        monkeypatch.setenv(key, str(value))
    from tests.schemes import ASSET_MODULES

    for name in ASSET_MODULES:  # the ConfigMap's partition scheme, as a pod imports it
        importlib.reload(importlib.import_module(name))
    import deploy.k8s.definitions

    yield importlib.reload(deploy.k8s.definitions)
    monkeypatch.undo()
    for name in ASSET_MODULES:
        importlib.reload(importlib.import_module(name))


def _container(job: dict) -> dict:
    (c,) = job["spec"]["template"]["spec"]["containers"]
    return c


def test_every_step_pod_of_the_main_job(k8s):
    import dagster as dg

    cm = _config_map()
    jobs = k8s.step_job_manifests("main_job", image="registry.example/qumem-pipeline:1")
    graph = k8s.defs.resolve_asset_graph()
    assert sorted(jobs) == sorted(k.to_user_string() for k in graph.get_all_asset_keys())
    gpu_steps = {"episodes", "memory_embeddings", "memory_indexes", "persona_profiles", "query_states"}
    data_root = cm["data"]["QUMEM_DATA_ROOT"]
    assert data_root.startswith("s3://")
    # the production pipeline resource reads the data root the pods get: the object-store URI
    assert k8s.defs.resources["pipeline"].data_root.get_value() == data_root
    assert isinstance(graph.get(dg.AssetKey("turns")).partitions_def, dg.StaticPartitionsDefinition)  # user_buckets
    for op, job in jobs.items():
        c, pod = _container(job), job["spec"]["template"]["spec"]
        assert c["image"] == "registry.example/qumem-pipeline:1" and c["args"][:3] == ["dagster", "api", "execute_step"]
        env_from = {(next(iter(e)), next(iter(e.values()))["name"]) for e in c["envFrom"]}
        assert env_from == {("configMapRef", cm["metadata"]["name"]), ("secretRef", k8s.ENV_SECRET)}, op
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["DAGSTER_RUN_STEP_KEY"] == op and env["DAGSTER_HOME"]
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
        # the archive, read-only, where QUMEM_ARCHIVE says
        assert mounts["archive"]["mountPath"] == cm["data"]["QUMEM_ARCHIVE"] and mounts["archive"]["readOnly"]
        assert claims["archive"] == "qumem-archive"
        requests, limits = c["resources"]["requests"], c["resources"].get("limits", {})
        if op in gpu_steps:
            assert requests["nvidia.com/gpu"] == limits["nvidia.com/gpu"] == "1", op
            assert pod["nodeSelector"] == {"qumem.io/pool": "gpu"} and env["QUMEM_DEVICE"] == "cuda"
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        else:
            assert "nvidia.com/gpu" not in requests and "nvidia.com/gpu" not in limits, op
            assert "nodeSelector" not in pod or "qumem.io/pool" not in pod["nodeSelector"], op
            assert requests["cpu"] == "1"
        # the DuckDB warehouse: only the single writer mounts it, where QUMEM_WAREHOUSE points
        if op == "warehouse":
            assert claims["warehouse"] == "qumem-warehouse"
            assert cm["data"]["QUMEM_WAREHOUSE"].startswith(mounts["warehouse"]["mountPath"] + "/")
            assert graph.get(dg.AssetKey("warehouse")).pools == {"warehouse"}
            assert env["QUMEM_WAREHOUSE_HOST"] == "pvc/qumem-warehouse"
        else:
            assert "warehouse" not in mounts and "warehouse" not in claims, op
            assert "QUMEM_WAREHOUSE_HOST" not in env, op
    forget = k8s.step_job_manifests("forget_user_job")["forget_user_op"]  # the other warehouse writer
    assert "warehouse" in {m["name"] for m in _container(forget)["volumeMounts"]}
    # the forget's pod names the volume as the loads' pods did, so it deletes there itself
    assert {e["name"]: e.get("value") for e in _container(forget)["env"]}["QUMEM_WAREHOUSE_HOST"] == "pvc/qumem-warehouse"


def test_the_warehouse_writer_is_serialized_across_runs():
    """Pool limit 1 on the shared instance (what `dagster instance concurrency set warehouse 1` sets)."""
    cfg = yaml.safe_load((REPO_ROOT / "deploy" / "postgres" / "dagster.yaml").read_text())
    assert cfg["concurrency"]["pools"]["default_limit"] == 1


def test_rendered_step_jobs_are_valid_kubernetes(k8s):
    jobs = {**k8s.step_job_manifests("main_job"), **k8s.step_job_manifests("forget_user_job")}
    assert jobs, "no step job rendered: nothing validated"
    for op, job in jobs.items():
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", sorted(K8S_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_deploy_manifests_are_valid_kubernetes(path):
    docs = _docs(path)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_schema_validation_rejects_a_broken_manifest():
    """The validator is live: a typo'd field and a non-string ConfigMap value both fail."""
    bad = _config_map() | {"data": {"QUMEM_BUCKETS": 64}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    (pvc, *_) = [d for d in _docs(K8S_DIR / "pipeline.yaml") if d["kind"] == "PersistentVolumeClaim"]
    typo = {**pvc, "spec": {**pvc["spec"], "acessModes": ["ReadWriteOnce"]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, K8S_VERSION, strict=True)
