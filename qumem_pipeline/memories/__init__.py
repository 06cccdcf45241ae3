"""Stage 3 (QUMem §3.3, typed memory decomposition): episodes in, fact / preference / insight
memories out, each with evidence turn ids and temporal position.

Enters: `episodes` + `turns`. Leaves: `memories`, `memory_quarantine`, `llm_ledger` and the
finished-call checkpoints (`checkpoints`) that make a rerun pay for no call twice.

`call_ledger` lends the same checkpoints and ledger rows to the later LLM stages (persona merges,
the query agents): a backend wrapper their assets put around the run's LLM.
"""
