"""The LLM calls of the persona_profiles and query_states assets through the checkpoint + ledger
(`qumem_pipeline.memories.call_ledger`), as the memories asset's calls go through its checkpoints."""

from datetime import datetime

import dagster as dg

from assets.versions import code_version
from qumem_pipeline.llm.base import LLMError
from qumem_pipeline.memories.call_ledger import CheckpointedLLM
from qumem_pipeline.memories.stage import checkpointed_llm as _checkpointed_llm


def checkpointed_llm(layout, tables: tuple[str, str], backend, stage: str, prompt_version: str,
                     created_at: datetime) -> CheckpointedLLM:
    """The run's backend with every call checkpointed per user in `tables[0]` and ledgered (`call_ledger`)."""
    return _checkpointed_llm(layout, tables, backend, code_version=code_version(stage), prompt_version=prompt_version,
                             created_at=created_at)


def llm_failure(exc: LLMError, llm: CheckpointedLLM) -> dg.Failure:
    return dg.Failure(
        description=f"{exc} Finished LLM calls are checkpointed under {llm.store.layout.table_dir(llm.store.table)} "
        f"({llm.sent} answered in this run, {llm.replayed} replayed); rerun the same users once the endpoint is "
        "back and only the missing calls are sent."
    )


def ledger_metadata(llm: CheckpointedLLM) -> dict:
    s = llm.summary()
    return {"llm_calls": s["llm_calls"], "llm_calls_sent": s["llm_calls_sent"],
            "llm_calls_reused_from_checkpoint": s["llm_calls_replayed"],
            "tokens_by_stage": dg.MetadataValue.json(s["tokens_by_stage"])}

