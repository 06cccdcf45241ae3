"""Kubernetes scale-out: each step of a run is a Kubernetes Job (dagster-k8s `k8s_job_executor`).

Loaded by the user-code deployment (`dagster api grpc -m deploy.k8s.definitions`) whose pods get
their environment from the `qumem-pipeline-env` ConfigMap (deploy/k8s/vllm-pool.yaml): QUMEM_ENV=production
and QUMEM_LLM_BASE_URL pointing at the Service in front of the vLLM replicas, so LLM steps call
the pool over the `openai` backend and need no GPU of their own. Steps in the `gpu` pool that run
models in-process (continuity classifier, embedder, FAISS) request one GPU each; every other step,
LLM-only `memories` included, gets a small CPU request. Pool limits (dagster.yaml / deploy/postgres/dagster.yaml) still cap how
many GPU steps run at once across runs: raise `pools.default_limit` to the number of GPU nodes.
"""

import os

from dagster_k8s import k8s_job_executor

from assets.definitions import ALL_ASSETS, build_definitions

NAMESPACE = os.environ.get("QUMEM_K8S_NAMESPACE", "qumem")
ENV_CONFIG_MAP = "qumem-pipeline-env"  # defined in deploy/k8s/vllm-pool.yaml
ENV_SECRET = "qumem-pipeline-secrets"  # DAGSTER_PG_PASSWORD and other secrets, made by the operator

CPU_STEP = {
    "container_config": {
        "resources": {"requests": {"cpu": "1", "memory": "4Gi"}, "limits": {"memory": "8Gi"}},
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


MODEL_RESOURCES = {"llm", "embedder", "continuity"}


def gpu_step_names() -> list[str]:
    """Ops in the `gpu` pool, except those whose only model is the LLM (served by the vLLM pool).

    Read from the assets, so a new GPU asset gets a GPU without editing this file.
    """
    return sorted(
        a.op.name for a in ALL_ASSETS
        if a.op.pool == "gpu" and set(a.required_resource_keys) & MODEL_RESOURCES != {"llm"}
    )


EXECUTOR_CONFIG = {
    "job_namespace": NAMESPACE,
    "image_pull_policy": "IfNotPresent",
    "max_concurrent": int(os.environ.get("QUMEM_K8S_MAX_CONCURRENT", "8")),
    "env_config_maps": [ENV_CONFIG_MAP],
    "env_secrets": [ENV_SECRET],
    "step_k8s_config": CPU_STEP,
    "per_step_k8s_config": {name: GPU_STEP for name in gpu_step_names()},
}

executor = k8s_job_executor.configured(EXECUTOR_CONFIG, name="qumem_k8s")
defs = build_definitions(env=os.environ.get("QUMEM_ENV", "production"), executor=executor)
