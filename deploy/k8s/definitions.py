"""Kubernetes scale-out: each step of a run is a Kubernetes Job (dagster-k8s `k8s_job_executor`).

Loaded by the user-code deployment (`dagster api grpc -m deploy.k8s.definitions`); README
("Kubernetes") has the whole procedure. What every step pod gets:

* environment from the `qumem-pipeline-env` ConfigMap (deploy/k8s/pipeline.yaml: QUMEM_ENV=production,
  the object-store data root `QUMEM_DATA_ROOT=s3://…`, the partition scheme, the vLLM pool URL) and
  the `qumem-pipeline-secrets` Secret (AWS_* credentials for the data root, DAGSTER_PG_PASSWORD);
* the archive volume, read-only (the `turns` step and discovery read it);
* steps of the `warehouse` pool (the DuckDB writer, `forget`) also mount the warehouse volume;
  the instance's pool limit 1 (`dagster instance concurrency set warehouse 1`) keeps them one at
  a time across all runs, and the volume is ReadWriteOnce;
* steps of the `gpu` pool that run a model in-process (classifier, embedder, FAISS) request one
  GPU on `qumem.io/pool=gpu` nodes; every other step, LLM-only `memories` included (it calls the
  vLLM pool), gets a CPU request. The `gpu` pool limit caps GPU steps across runs: set it to the
  number of GPUs (`dagster instance concurrency set gpu N`).

`step_job_manifests()` renders, offline, the Kubernetes Job dagster-k8s would create for every
step of a job (the same functions the executor calls), so the pod specs can be checked without a
cluster: `python -m deploy.k8s.definitions [JOB] > steps.yaml`.
"""

import os
import sys
from types import SimpleNamespace

from dagster_k8s import k8s_job_executor

from assets.definitions import build_definitions

NAMESPACE = os.environ.get("QUMEM_K8S_NAMESPACE", "qumem")
ENV_CONFIG_MAP = "qumem-pipeline-env"  # defined in deploy/k8s/pipeline.yaml
ENV_SECRET = "qumem-pipeline-secrets"  # AWS_* and DAGSTER_PG_PASSWORD, made by the operator
ARCHIVE_CLAIM, WAREHOUSE_CLAIM = "qumem-archive", "qumem-warehouse"  # deploy/k8s/pipeline.yaml
ARCHIVE_MOUNT, WAREHOUSE_MOUNT = "/archive", "/warehouse"

CPU_STEP = {
    "container_config": {
        "resources": {"requests": {"cpu": "1", "memory": "4Gi"}, "limits": {"memory": "8Gi"}},
        "volume_mounts": [{"name": "archive", "mount_path": ARCHIVE_MOUNT, "read_only": True}],
    },
    "pod_spec_config": {
        "volumes": [{"name": "archive", "persistent_volume_claim": {"claim_name": ARCHIVE_CLAIM, "read_only": True}}],
    },
}
GPU_STEP = {
    "container_config": {
        "resources": {
            "requests": {"cpu": "4", "memory": "32Gi", "nvidia.com/gpu": "1"},
            "limits": {"memory": "48Gi", "nvidia.com/gpu": "1"},
        },
        "env": [{"name": "QUMEM_DEVICE", "value": "cuda"}],
    },
    "pod_spec_config": {
        "node_selector": {"qumem.io/pool": "gpu"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    },
}
WAREHOUSE_STEP = {
    "container_config": {
        "volume_mounts": [{"name": "warehouse", "mount_path": WAREHOUSE_MOUNT}],
        # one name for the volume in every pod that mounts it: a forget in its own pod must find the
        # warehouse every load recorded "here" (storage/warehouse_locations.py), not on another host
        "env": [{"name": "QUMEM_WAREHOUSE_HOST", "value": f"pvc/{WAREHOUSE_CLAIM}"}],
    },
    "pod_spec_config": {
        "volumes": [{"name": "warehouse", "persistent_volume_claim": {"claim_name": WAREHOUSE_CLAIM}}],
    },
}

MODEL_RESOURCES = {"llm", "embedder", "continuity"}


def _ops(defs) -> list:
    """Every op of every job (asset ops and plain ops such as forget), once."""
    seen = {}
    for job in defs.get_repository_def().get_all_jobs():
        for node in job.graph.iterate_op_defs():
            seen.setdefault(node.name, node)
    return list(seen.values())


def gpu_step_names(defs) -> list[str]:
    """Ops in the `gpu` pool, except those whose only model is the LLM (served by the vLLM pool).

    Read from the definitions, so a new GPU asset gets a GPU without editing this file.
    """
    return sorted(op.name for op in _ops(defs)
                  if op.pool == "gpu" and set(op.required_resource_keys) & MODEL_RESOURCES != {"llm"})


def warehouse_step_names(defs) -> list[str]:
    return sorted(op.name for op in _ops(defs) if op.pool == "warehouse")


def executor_config(defs) -> dict:
    per_step = {name: GPU_STEP for name in gpu_step_names(defs)}
    per_step.update({name: WAREHOUSE_STEP for name in warehouse_step_names(defs)})
    return {
        "job_namespace": NAMESPACE,
        "image_pull_policy": "IfNotPresent",
        "max_concurrent": int(os.environ.get("QUMEM_K8S_MAX_CONCURRENT", "8")),
        "env_config_maps": [ENV_CONFIG_MAP],
        "env_secrets": [ENV_SECRET],
        "step_k8s_config": CPU_STEP,
        "per_step_k8s_config": per_step,
    }


_ENV = os.environ.get("QUMEM_ENV", "production")
EXECUTOR_CONFIG = executor_config(build_definitions(env=_ENV))
executor = k8s_job_executor.configured(EXECUTOR_CONFIG, name="qumem_k8s")
defs = build_definitions(env=_ENV, executor=executor)


# What the step jobs take from the instance's K8sRunLauncher: the Dagster Helm chart's defaults.
HELM_RUN_LAUNCHER = SimpleNamespace(job_image=None, dagster_home="/opt/dagster/dagster_home",
                                    instance_config_map="dagster-instance",
                                    postgres_password_secret="dagster-postgresql-secret")


def step_job_manifests(job_name: str = "main_job", image: str = "qumem-pipeline:latest",
                       config: dict | None = None, run_id: str = "0" * 36) -> dict[str, dict]:
    """op name -> the Kubernetes Job (as a manifest dict) that dagster-k8s creates for that step.

    The same merge the executor does (`k8s_job_executor` + `K8sStepHandler._get_container_context`:
    executor-wide container context, then the op's `per_step_k8s_config`) and the same
    `construct_dagster_k8s_job`, without a cluster or a run launcher."""
    from dagster_k8s.container_context import K8sContainerContext
    from dagster_k8s.job import UserDefinedDagsterK8sConfig, construct_dagster_k8s_job, get_k8s_job_name
    from kubernetes.client import ApiClient

    cfg = config or EXECUTOR_CONFIG
    base = K8sContainerContext(
        image_pull_policy=cfg.get("image_pull_policy"), env_config_maps=cfg.get("env_config_maps"),
        env_secrets=cfg.get("env_secrets"), env_vars=cfg.get("env_vars"), namespace=cfg.get("job_namespace"),
        run_k8s_config=UserDefinedDagsterK8sConfig.from_dict(cfg.get("step_k8s_config", {})),
    )
    job = defs.resolve_job_def(job_name)
    out = {}
    for op_def in job.graph.iterate_op_defs():
        ctx = base.merge(K8sContainerContext(
            run_k8s_config=UserDefinedDagsterK8sConfig.from_dict(cfg.get("per_step_k8s_config", {}).get(op_def.name, {}))))
        job_config = ctx.get_k8s_job_config(image, HELM_RUN_LAUNCHER)
        name = f"dagster-step-{get_k8s_job_name(run_id, op_def.name)}"
        k8s_job = construct_dagster_k8s_job(
            job_config=job_config, args=["dagster", "api", "execute_step"], job_name=name, pod_name=name,
            component="step_worker", user_defined_k8s_config=ctx.run_k8s_config,
            labels={"dagster/job": job_name, "dagster/op": op_def.name, "dagster/run-id": run_id},
            env_vars=[{"name": "DAGSTER_RUN_JOB_NAME", "value": job_name}, {"name": "DAGSTER_RUN_STEP_KEY", "value": op_def.name}],
        )
        out[op_def.name] = {"apiVersion": "batch/v1", "kind": "Job", **ApiClient().sanitize_for_serialization(k8s_job)}
    return out


if __name__ == "__main__":
    import yaml

    manifests = step_job_manifests(sys.argv[1] if len(sys.argv) > 1 else "main_job")
    print(yaml.safe_dump_all(list(manifests.values()), sort_keys=False))
