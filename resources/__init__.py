"""Dagster resources, chosen per environment in one place so asset code never branches on where it runs.

local      - embedded models, Parquet under ./data, DuckDB file beside it (the default).
production - the same contract pointed at production paths and a vLLM endpoint; every
             value comes from the environment so nothing secret lives in code.

Both keep the quarantine contract: a bad row goes to the `quarantine` table and the run goes on,
unless the run's quarantined share exceeds `max_quarantine_fraction` (QUMEM_MAX_QUARANTINE_FRACTION;
the blocking `quarantine_under_ceiling` check stops the run). Strict mode (any bad row fails the
run) is a per-run choice: `qumem run --strict`, QUMEM_STRICT=1, or the run config
`resources: {pipeline: {config: {strict: true, data_root: {env: QUMEM_DATA_ROOT}, archive_path: {env: QUMEM_ARCHIVE}}}}`
(a resource's run config replaces its configured values, so the two required fields name their sources).
"""

import os
from pathlib import Path

import dagster as dg

from qumem_pipeline.storage.forget import ForgetRegistry
from qumem_pipeline.ingest.archive import ArchiveConfig
from qumem_pipeline.storage.layout import DataLayout
from qumem_pipeline.ingest.validate import DEFAULT_MAX_TEXT_CHARS
from qumem_pipeline.query.strategies.registry import DEFAULT_STRATEGY, default_strategy
from qumem_pipeline.storage.warehouse import Warehouse, default_warehouse_path

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_ARCHIVE = REPO_ROOT / "examples" / "archive"
EXAMPLE_QUERIES = REPO_ROOT / "examples" / "queries.jsonl"


class PipelineConfig(dg.ConfigurableResource):
    """Where the archive is read from and where every per-user table and the warehouse live."""

    data_root: str
    archive_path: str
    archive_format: str = ""  # "" = detect (jsonl, parquet, locomo, chatgpt)
    warehouse_path: str = ""  # "" = <data_root>/warehouse.duckdb
    strict: bool = False
    max_text_chars: int = DEFAULT_MAX_TEXT_CHARS
    max_quarantine_fraction: float = 0.2  # blocking check: more bad rows than this stops the run
    queries_path: str = ""  # personalization queries (JSONL/Parquet); "" = none this run
    query_strategy: str = DEFAULT_STRATEGY  # adamem | qumem (three agents) | qumem_hybrid | topk (baseline)
    retrieval_k: int = 5
    respond: bool = False  # also generate a personalized answer Ψ(q, Z_q)

    def layout(self) -> DataLayout:
        return DataLayout(self.data_root)

    def warehouse(self) -> Warehouse:
        return Warehouse(self.warehouse_path or default_warehouse_path(self.data_root))

    def archive(self) -> ArchiveConfig:
        return ArchiveConfig(
            path=self.archive_path,
            format=self.archive_format or None,
            max_text_chars=self.max_text_chars,
            strict=self.strict,
        )

    def forgotten(self) -> ForgetRegistry:
        return ForgetRegistry(self.data_root)


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def _strict() -> bool:
    return _env("QUMEM_STRICT", "0") == "1"


def _max_quarantine_fraction() -> float:
    raw = _env("QUMEM_MAX_QUARANTINE_FRACTION", "0.2")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"QUMEM_MAX_QUARANTINE_FRACTION={raw!r}: expected a fraction between 0 and 1")
    return value


def _models(llm_kind: str) -> dict:
    from resources.models import ContinuityClassifierResource, EmbedderResource, LLMResource

    return {
        "embedder": EmbedderResource(device=_env("QUMEM_DEVICE", "")),
        "llm": LLMResource(
            kind=_env("QUMEM_LLM_KIND", llm_kind),
            model=_env("QUMEM_LLM_MODEL", ""),
            base_url=_env("QUMEM_LLM_BASE_URL", ""),
            max_concurrency=int(_env("QUMEM_LLM_CONCURRENCY", "64")),
            vllm_python=_env("QUMEM_VLLM_PYTHON", ""),
        ),
        "continuity": ContinuityClassifierResource(
            artifact_dir=_env("QUMEM_CLASSIFIER_DIR", ""),
            device=_env("QUMEM_DEVICE", ""),
            token_budget=int(_env("QUMEM_EPISODE_TOKEN_BUDGET", "1536")),
        ),
    }


def local_resources() -> dict:
    data_root = _env("QUMEM_DATA_ROOT", str(Path.cwd() / "data"))
    models = _models("local")
    return {
        **models,
        "pipeline": PipelineConfig(
            data_root=data_root,
            archive_path=_env("QUMEM_ARCHIVE", str(EXAMPLE_ARCHIVE)),
            archive_format=_env("QUMEM_ARCHIVE_FORMAT", ""),
            warehouse_path=_env("QUMEM_WAREHOUSE", ""),
            strict=_strict(),
            max_quarantine_fraction=_max_quarantine_fraction(),
            queries_path=_env("QUMEM_QUERIES", str(EXAMPLE_QUERIES)),
            query_strategy=_env("QUMEM_QUERY_STRATEGY", default_strategy(models["llm"].kind)),
            respond=_env("QUMEM_RESPOND", "0") == "1",
        ),
    }


def production_resources() -> dict:
    models = _models("openai")  # QUMEM_LLM_BASE_URL: a vLLM server (or a pool behind one URL)
    return {
        **models,
        "pipeline": PipelineConfig(
            data_root=dg.EnvVar("QUMEM_DATA_ROOT"),
            archive_path=dg.EnvVar("QUMEM_ARCHIVE"),
            archive_format=_env("QUMEM_ARCHIVE_FORMAT", ""),
            warehouse_path=_env("QUMEM_WAREHOUSE", ""),
            strict=_strict(),  # quarantine, as locally; strict only when a run asks for it
            max_quarantine_fraction=_max_quarantine_fraction(),
            queries_path=_env("QUMEM_QUERIES", ""),
            query_strategy=_env("QUMEM_QUERY_STRATEGY", default_strategy(models["llm"].kind)),
        ),
    }


RESOURCES_BY_ENV = {"local": local_resources, "production": production_resources}


def resources_for(env: str | None = None) -> dict:
    env = env or os.environ.get("QUMEM_ENV", "local")
    if env not in RESOURCES_BY_ENV:
        raise ValueError(f"QUMEM_ENV={env!r}: expected one of {sorted(RESOURCES_BY_ENV)}")
    return RESOURCES_BY_ENV[env]()
