"""`personalize_job`: bulk personalization as a job of its own, with run config

    ops: {personalize_op: {config: {queries: PATH_OR_URI, batch_id: ID}}}   # batch_id "": the batch's digest

A batch of queries (JSONL, Parquet or a Delta table, local or `s3://`) answered for its users from the
current memories with the deployment's strategy (`QUMEM_QUERY_STRATEGY`), stage-batched, streamed in
chunks, every LLM call checkpointed, written to the `personalization` tables keyed by (batch_id,
query_id) (`qumem_pipeline/query/personalize.py`), then loaded into the warehouse by batch. `qumem
personalize --queries PATH_OR_URI [--batch-id ID]` runs this job (`cmd_personalize`).
"""

import json
import os
import sys
import time
from pathlib import Path

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


# -- `qumem personalize` ------------------------------------------------------------------------------
def run_config(queries: str, batch_id: str | None = None, fmt: str | None = None,
               chunk_rows: int | None = None) -> dict:
    cfg: dict = {"queries": queries}
    if batch_id:
        cfg["batch_id"] = batch_id
    if fmt:
        cfg["format"] = fmt
    if chunk_rows:
        cfg["chunk_rows"] = chunk_rows
    return {"ops": {"personalize_op": {"config": cfg}}}


def cmd_personalize(args) -> int:
    """`qumem personalize --queries PATH_OR_URI [--batch-id ID]`: run `personalize_job` in-process."""
    from assets.commands import _defs, _instance
    from assets.recovery import launch_tags

    queries = args.queries if "://" in args.queries else str(Path(args.queries).resolve())
    instance = _instance()
    t0 = time.perf_counter()
    result = _defs().resolve_job_def("personalize_job").execute_in_process(
        instance=instance, run_config=run_config(queries, args.batch_id, args.query_format, args.chunk_rows),
        tags=launch_tags(), raise_on_error=False)
    wall = time.perf_counter() - t0
    if not result.success:
        errs = [e.step_failure_data.error for e in result.all_events if e.is_step_failure]
        first = errs[0] if errs else None
        while first is not None and getattr(first, "cause", None) is not None and not (first.message or "").strip():
            first = first.cause
        line = ((first.message if first else "") or "").strip().splitlines()
        print(f"qumem: personalize_job FAILED: {line[0] if line else 'see the Dagster run ' + result.run_id}",
              file=sys.stderr)
        return 1
    report = result.output_for_node("export_personalization_op")
    print(f"batch {report['batch_id']} ({report['format']}, {report['rows']} rows, {report['chunks']} chunks, "
          f"strategy {report['strategy']})")
    for label, key in (("answered", "answered"), ("already done (earlier run)", "already_done"),
                       ("quarantined: bad input rows", "quarantined_input"),
                       ("quarantined: users without memories", "quarantined_user"),
                       ("quarantined: unusable LLM output", "quarantined_llm"), ("LLM calls", "llm_calls"),
                       ("LLM calls sent", "llm_calls_sent"), ("LLM calls replayed", "llm_calls_replayed")):
        print(f"  {label:<36}{report[key]}")
    print(f"  tables: personalization, personalization_quarantine, personalization_llm_ledger; warehouse rows "
          f"{report['warehouse_rows']}; run {result.run_id}; {wall:.1f}s")
    if args.json:
        print(json.dumps({**report, "run_id": result.run_id, "wall_s": round(wall, 3)}, default=str))
    return 0
