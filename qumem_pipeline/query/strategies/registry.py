"""Strategy name -> strategy: the one place that knows every query strategy.

The query-states asset and the evaluation pick strategies here by name (``QUMEM_QUERY_STRATEGY``,
``--strategies``). To add a strategy: write a module under ``strategies/`` with a
``base.QueryStrategy`` subclass (importing only ``base``, shared steps and non-strategy modules,
never another strategy module), then add one line to ``_STRATEGIES`` below.
"""

from datetime import datetime
from typing import Any, Sequence

from qumem_pipeline.llm.base import LLMBackend
from qumem_pipeline.query.strategies.adamem.strategy import AdaMemStrategy
from qumem_pipeline.query.strategies.base import Progress, Query, QueryStrategy, StateOutput
from qumem_pipeline.query.strategies.hybrid import QumemHybridStrategy
from qumem_pipeline.query.strategies.qumem import QumemStrategy
from qumem_pipeline.query.strategies.topk import TopKStrategy

_STRATEGIES: dict[str, QueryStrategy] = {s.name: s for s in (QumemStrategy(), TopKStrategy(), AdaMemStrategy(), QumemHybridStrategy())}
STRATEGY_NAMES: tuple[str, ...] = tuple(_STRATEGIES)

# The deployment's strategy unless QUMEM_QUERY_STRATEGY says otherwise (docs/evaluation.md#the-default-strategy):
# with a served model, the best on the evaluation record (AdaMem's: level with qumem_hybrid in F1, fewer calls);
# with the embedded 135M model, QUMem's three agents, whose states cite their evidence where AdaMem's rarely do.
DEFAULT_STRATEGY = "adamem"
EMBEDDED_MODEL_STRATEGY = "qumem"


def default_strategy(llm_kind: str) -> str:
    """The default for a deployment whose LLM backend is `llm_kind` (`local`: the embedded model)."""
    return EMBEDDED_MODEL_STRATEGY if llm_kind == "local" else DEFAULT_STRATEGY


def get_strategy(name: str) -> QueryStrategy:
    try:
        return _STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; expected one of {STRATEGY_NAMES}") from None


def infer_user_states(
    queries: Sequence[Query],
    llm: LLMBackend,
    retriever: Any,
    *,
    strategy: str = "qumem",
    k: int = 5,
    respond: bool = False,
    created_at: datetime | None = None,
    progress: Progress | None = None,
) -> StateOutput:
    """User states for ``queries`` by the named strategy (each stage one batch over all queries)."""
    return get_strategy(strategy).infer(queries, llm, retriever, k=k, respond=respond, created_at=created_at,
                                        progress=progress)
