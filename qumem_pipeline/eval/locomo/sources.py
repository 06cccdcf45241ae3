"""Step 1b of the LoCoMo harness: the product's own unit sources - episodes and typed memories.

Enters: the loaded conversations and the run's options (continuity artifact, a memories table or
``--decompose`` with an LLM backend, the strategies asked for). Leaves: ``UnitSources`` - each
primary user's episodes (the continuity classifier's), a memories table, the LLM backend the
strategies may plan with, which strategies can run, and why anything was skipped.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import polars as pl

from qumem_pipeline.eval.locomo.data import read_memories
from qumem_pipeline.eval.locomo.units import Conversation


def build_episodes(convs: list[Conversation], artifact_dir: str | None = None, device=None,
                   all_users: bool = False) -> tuple[dict[str, pl.DataFrame], str]:
    """The product's episodes (continuity classifier over user utterances, session breaks, default
    token budget).

    Retrieval units need only each conversation's primary user; decomposition (``all_users``)
    needs every speaker's, as the pipeline decomposes every user's own history.
    """
    from qumem_pipeline.episodes.continuity import ContinuityClassifier
    from qumem_pipeline.episodes.continuity.decoding import rule_of
    from qumem_pipeline.episodes.segmentation import build_episodes_for_users

    clf = ContinuityClassifier.load(artifact_dir, device=device)
    turns_by_user = {}
    for c in convs:
        turns_by_user[c.user_id] = c.turns
        if all_users:
            turns_by_user.update({u: t for u, t in (c.turns_by_user or {}).items() if u != c.user_id})
    eps, _ = build_episodes_for_users(
        turns_by_user, clf.predict_same_proba, rule=rule_of(clf), similarity=getattr(clf, "pair_cosine", None),
        embed_histories=getattr(clf, "history_embeddings", None), classifier_version=clf.version
    )
    return eps, clf.version


def decompose_conversation(conv: Conversation, episodes_by_user: dict[str, pl.DataFrame], backend, *,
                           max_tokens: int = 384, layout=None, log=None, checkpoint_root=None) -> list[pl.DataFrame]:
    """Typed memories of every speaker of one conversation (one memories frame per decomposed user)."""
    return _decompose(
        [conv], episodes_by_user, backend, max_tokens=max_tokens, layout=layout, log=log, checkpoint_root=checkpoint_root)


def decompose_memories(convs: list[Conversation], episodes_by_user: dict[str, pl.DataFrame], backend,
                       out_root: str | os.PathLike | None = None, max_tokens: int = 384, log=None) -> pl.DataFrame:
    """Typed memories of every speaker of these conversations, by the pipeline's decomposition step;
    with ``out_root``, written per user, so ``--memories OUT_ROOT`` can score it again without the LLM."""
    from qumem_pipeline.storage.layout import DataLayout

    layout = DataLayout(out_root) if out_root is not None else None
    frames = _decompose(convs, episodes_by_user, backend, max_tokens=max_tokens, layout=layout, log=log,
                        checkpoint_root=out_root)
    return pl.concat(frames) if frames else pl.DataFrame()


def _decompose(convs, episodes_by_user, backend, *, max_tokens, layout, log, checkpoint_root) -> list[pl.DataFrame]:
    """All speakers' calls as one continuous stream, every finished call checkpointed as it finishes
    (under ``checkpoint_root``, else the cache): a failure loses no answered call, a rerun repeats none,
    and no speaker's slowest call holds back the next speaker's."""
    from datetime import datetime, timezone

    from qumem_pipeline.memories.checkpoints import CheckpointStore
    from qumem_pipeline.memories.decompose import decompose_episodes
    from qumem_pipeline.runtime.progress import ProgressLine

    log = log or (lambda msg: None)
    store = CheckpointStore(checkpoint_root if checkpoint_root is not None else
                            os.path.join(os.environ.get("QUMEM_CACHE_DIR", ".cache"), "locomo_decompose"))
    inputs, users = [], []
    for conv in convs:
        for u in conv.user_ids:
            eps = episodes_by_user.get(u)
            turns = (conv.turns_by_user or {}).get(u)
            if eps is None or turns is None or eps.height == 0:
                continue
            by_index = {r["turn_index"]: r for r in turns.iter_rows(named=True)}
            inputs += [{"user_id": u, "episode_id": e["episode_id"], "turns": [by_index[t] for t in e["turn_ids"]]}
                       for e in eps.iter_rows(named=True)]
            users.append(u)
    if not inputs:
        return []
    t0 = time.perf_counter()
    out = decompose_episodes(inputs, backend, created_at=datetime.now(timezone.utc), max_tokens=max_tokens,
                             checkpoint=store, progress=ProgressLine(log, "[locomo] decomposition calls", every_s=30.0))
    log(f"[locomo] decomposed {len(users)} speakers: {len(inputs)} episodes, {out.summary['llm_calls']} calls "
        f"({out.stats.reused_calls} from checkpoints), {out.memories.height} memories, {out.quarantine.height} "
        f"quarantined ({time.perf_counter() - t0:.0f}s)")
    frames = []
    for u in users:
        mem = out.memories.filter(pl.col("user_id") == u)
        if layout is not None:
            layout.write_user_table("memories", u, mem)
            layout.write_user_table("llm_ledger", u, out.ledger.filter(pl.col("user_id") == u))
        store.compact(u, out.call_keys_by_user.get(u, set()))
        frames.append(mem)
    return frames


def make_backend(llm_kind: str | None):
    """The run's LLM backend: ``llm_kind`` or $QUMEM_LLM_KIND (default the embedded local model)."""
    from qumem_pipeline.llm.factory import make_backend as factory

    kind = llm_kind or os.environ.get("QUMEM_LLM_KIND", "local")
    cfg: dict = {}
    if kind == "openai":
        cfg = {"base_url": os.environ["QUMEM_LLM_BASE_URL"], "model": os.environ.get("QUMEM_LLM_MODEL") or None}
    elif kind in ("vllm-managed", "vllm"):
        cfg = {"model": os.environ["QUMEM_LLM_MODEL"]}
    return factory(kind, **cfg)


@dataclass
class UnitSources:
    """The product-built inputs of a run and the strategies they let run."""

    episodes_by_user: dict[str, pl.DataFrame] | None = None
    classifier_version: str | None = None
    memories: pl.DataFrame | None = None
    decomposition: dict | None = None
    strategy_llm: object | None = None
    backend: "_OneBackend | None" = None  # the run's one backend, when it was built (decomposition or planning)
    run_strategies: list[str] = field(default_factory=list)


class _OneBackend:
    """One LLM backend for the run, built on first use (decomposition and qumem's A1/A2); with a
    ``ledger`` path every call is a ledger row and a rerun replays the finished ones (the QA run's ledger)."""

    def __init__(self, given, llm_kind, ledger=None, record=None, replay_identity=None, user_conv=None):
        self._given, self._kind, self._ledger, self._backend = given, llm_kind, ledger, None
        # the evaluation record (``eval.record``): replayed from first; with ``replay_identity`` nothing else
        self._record, self._replay_identity, self._user_conv = record, replay_identity, user_conv

    def built(self):
        """The backend if anything used it, else None (nothing is started to ask)."""
        return self._backend

    def __call__(self):
        if self._backend is None:
            from qumem_pipeline.eval.record import RecordBackend

            if self._replay_identity is not None:
                self._backend = RecordBackend(None, self._record, self._replay_identity, self._user_conv)
                return self._backend
            self._backend = self._given or make_backend(self._kind)
            if self._ledger:
                from qumem_pipeline.eval.locomo.qa_ledger import LedgerBackend

                self._backend = LedgerBackend(self._backend, self._ledger)
            if self._record is not None:
                self._backend = RecordBackend(self._backend, self._record, None, self._user_conv)
        return self._backend


def gather_sources(convs: list[Conversation], units: Sequence[str], strategies: Sequence[str], skipped: dict, *,
                   memories=None, decompose: bool = False, llm_backend=None, llm_kind: str | None = None,
                   continuity_artifact: str | None = None, device=None, memories_out=None,
                   llm_max_tokens: int = 384, ledger=None, log=None, record=None,
                   replay_identity=None) -> UnitSources:
    """Episodes, memories and the strategy LLM this run needs; reasons for what is missing go to ``skipped``."""
    log = log or (lambda msg: None)
    src = UnitSources()
    # the memories feed the memories row and the strategies (qumem ranks memories only)
    decompose = decompose and ("memories" in units or bool(strategies))
    backend = src.backend = _OneBackend(llm_backend, llm_kind, ledger, record, replay_identity,
                                        {u: c.sample_id for c in convs for u in c.user_ids})
    if "episodes" in units or decompose:
        try:
            te = time.perf_counter()
            src.episodes_by_user, src.classifier_version = build_episodes(
                convs, continuity_artifact, device, all_users=decompose)
            log(f"[locomo] episodes built in {time.perf_counter() - te:.1f}s ({src.classifier_version})")
        except (FileNotFoundError, OSError, ValueError, KeyError) as e:
            skipped["episodes"] = f"continuity classifier unavailable: {e}"
            log(f"[locomo] episodes skipped: {e}")
    if "memories" in units or decompose:
        _memories_row(src, convs, skipped, memories, decompose, backend, memories_out, llm_max_tokens, log)
    elif strategies and memories is not None:
        src.memories = memories if isinstance(memories, pl.DataFrame) else read_memories(memories)
    # an LLM is "available" when the run was given one: a backend, --llm-kind, or --decompose
    have_llm = llm_backend is not None or llm_kind is not None or decompose or replay_identity is not None
    src.run_strategies = _runnable_strategies(strategies, have_llm, src.memories is not None, skipped)
    from qumem_pipeline.eval.locomo.adamem_units import NEEDS_LLM

    src.strategy_llm = backend() if any(s in NEEDS_LLM for s in src.run_strategies) else None
    return src


def _memories_row(src: UnitSources, convs, skipped: dict, memories, decompose: bool, backend: _OneBackend,
                  memories_out, llm_max_tokens: int, log) -> None:
    """The memories table: decomposed here, read from ``memories``, or skipped with the reason."""
    if decompose and src.episodes_by_user is not None:
        b = backend()
        te = time.perf_counter()
        src.memories = decompose_memories(convs, src.episodes_by_user, b, memories_out, llm_max_tokens, log)
        src.decomposition = {"model": b.model_name, "backend": b.backend_name,
                             "seconds": round(time.perf_counter() - te, 1),
                             "memories_out": str(memories_out) if memories_out else None}
        if src.memories.height == 0:
            src.memories = None
            skipped["memories"] = "the decomposition produced no memories"
    elif decompose:
        skipped["memories"] = "decomposition needs the episodes, which were skipped"
    elif memories is None:
        skipped["memories"] = ("no memories table given (--memories PARQUET_DIR) and no --decompose; typed "
                               "memories need the decomposition step's LLM")
    else:
        try:
            src.memories = memories if isinstance(memories, pl.DataFrame) else read_memories(memories)
        except (FileNotFoundError, ValueError, OSError) as e:
            skipped["memories"] = f"memories table unreadable: {e}"


def _runnable_strategies(strategies: Sequence[str], have_llm: bool, have_memories: bool, skipped: dict) -> list[str]:
    from qumem_pipeline.eval.locomo.adamem_units import NEEDS_LLM, NEEDS_MEMORIES

    for name in strategies:
        if name in NEEDS_LLM and not have_llm:
            skipped[f"strategy_{name}"] = NEEDS_LLM[name]
        elif name in NEEDS_MEMORIES and not have_memories:
            skipped[f"strategy_{name}"] = NEEDS_MEMORIES[name]
    return [s for s in strategies if f"strategy_{s}" not in skipped]
