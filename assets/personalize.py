"""`personalize_job`: bulk personalization as a job of its own, with run config

    ops: {personalize_op: {config: {queries: PATH_OR_URI, batch_id: ID}}}   # batch_id "": the batch's digest

A batch of queries (JSONL, Parquet or a Delta table, local or `s3://`) answered for its users from the
current memories with the deployment's strategy (`QUMEM_QUERY_STRATEGY`), stage-batched, streamed in
chunks, every LLM call checkpointed, written to the `personalization` tables keyed by (batch_id,
query_id) (`qumem_pipeline/query/personalize.py`), then loaded into the warehouse by batch. `qumem
personalize --queries PATH_OR_URI [--batch-id ID]` runs this job (`assets/cli_commands.py`).
"""

import os

import dagster as dg

from assets.versions import version_metadata
from qumem_pipeline.llm.base import LLMError
from qumem_pipeline.query.batch_input import DEFAULT_CHUNK_ROWS
from qumem_pipeline.query.personalize import CHECKPOINTS, STAGE, export_batch, personalize_batch
from resources import PipelineConfig
from resources.models import EmbedderResource, LLMResource

CHUNK_ROWS = int(os.environ.get("QUMEM_PERSONALIZE_CHUNK_ROWS", str(DEFAULT_CHUNK_ROWS)))


class PersonalizeConfig(dg.Config):
    queries: str  # a JSONL or Parquet file, a directory of Parquet files or a Delta table; local or s3://, gs://, az://
    batch_id: str = ""  # "" = the batch's content digest
    format: str = ""  # "" = detect (jsonl | parquet | delta)
    chunk_rows: int = CHUNK_ROWS  # rows validated, answered and committed together (bounds memory)


@dg.op(pool="gpu", out=dg.Out(dict), description="Answer a batch of queries from the current memories (stage-batched, "
       "streamed in chunks, every LLM call checkpointed) into the personalization tables.")
def personalize_op(context: dg.OpExecutionContext, config: PersonalizeConfig, pipeline: PipelineConfig,
                   llm: LLMResource, embedder: EmbedderResource) -> dg.Output:
    from assets.progress import ProgressLogger, llm_call_progress

    layout = pipeline.layout()
    progress = ProgressLogger(context.log, "personalization")
    try:
        with progress:
            report = personalize_batch(
                layout, config.queries, llm.backend, embedder.model, batch_id=config.batch_id or None,
                fmt=config.format or None, strategy=pipeline.query_strategy, k=pipeline.retrieval_k,
                respond=pipeline.respond, chunk_rows=config.chunk_rows, log=context.log.info,
                call_progress=llm_call_progress(progress))
    except LLMError as exc:
        raise dg.Failure(description=f"{exc} Finished LLM calls are checkpointed under {layout.table_dir(CHECKPOINTS)}; "
                         "rerun the same batch once the endpoint is back and only the missing calls are sent.") from exc
    except (ValueError, FileNotFoundError) as exc:  # a bad batch id, format or path: the operator's to fix
        raise dg.Failure(description=str(exc)) from exc
    r = report.as_dict()
    # counts and ids only: no user content in Dagster's event log
    meta = {k: v for k, v in r.items() if isinstance(v, (int, float, str)) and k != "code_version"}
    return dg.Output(r, metadata={**meta, "seconds": round(report.seconds, 3), **version_metadata(STAGE)})


@dg.op(pool="warehouse", out=dg.Out(dict), description="Load the batch's personalization rows into the DuckDB warehouse.")
def export_personalization_op(context: dg.OpExecutionContext, pipeline: PipelineConfig, report: dict) -> dg.Output:
    rows = export_batch(pipeline.layout(), pipeline.warehouse(), report["batch_id"])
    report = {**report, "warehouse_rows": rows}
    return dg.Output(report, metadata={f"warehouse_{t}": n for t, n in rows.items()})


@dg.job(description="Bulk personalization: a batch of queries (run config `queries`, `batch_id`) answered from the "
        "current memories into the personalization tables and the warehouse.")
def personalize_job():
    export_personalization_op(personalize_op())


def run_config(queries: str, batch_id: str | None = None, fmt: str | None = None,
               chunk_rows: int | None = None) -> dict:
    """The job's run config for one batch (`qumem personalize`, assets/cli_commands.py)."""
    cfg: dict = {"queries": queries}
    if batch_id:
        cfg["batch_id"] = batch_id
    if fmt:
        cfg["format"] = fmt
    if chunk_rows:
        cfg["chunk_rows"] = chunk_rows
    return {"ops": {"personalize_op": {"config": cfg}}}
