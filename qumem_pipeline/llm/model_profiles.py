"""Serving settings that depend on the model, looked up by model name, not set globally.

Why: compact JSON (vLLM's `disable_any_whitespace`) is what keeps SmolLM2-135M from filling free
JSON whitespace with newlines until max_tokens, but with it Qwen2.5-Coder-1.5B-Instruct returned
`{"memories":[]}` for 24 of 24 LoCoMo decomposition calls (issue 18). So each model family gets its
own profile; unknown models keep the old default (compact on), and `QUMEM_VLLM_COMPACT_JSON=0|1`
overrides whatever the table says.
"""

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class ModelProfile:
    family: str
    compact_json: bool  # server's structured-outputs disable_any_whitespace


DEFAULT_PROFILE = ModelProfile(family="default", compact_json=True)

# (substring of the lower-cased model name, profile); first match wins, so specific before general.
PROFILES: tuple[tuple[str, ModelProfile], ...] = (
    ("smollm2", ModelProfile(family="smollm2", compact_json=True)),
    ("qwen2.5-coder", ModelProfile(family="qwen2.5-coder", compact_json=False)),
    ("qwen2.5", ModelProfile(family="qwen2.5", compact_json=False)),
)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _names(model: str) -> list[str]:
    """The model's name as given, its directory's basename, and (for a local dir) what its
    config.json calls it, so a renamed directory still finds its family."""
    names = [str(model), Path(str(model)).name]
    cfg = Path(str(model)) / "config.json"
    if cfg.is_file():
        try:
            data = json.loads(cfg.read_text())
        except (OSError, ValueError):
            data = {}
        names += [str(data.get("_name_or_path", "")), str(data.get("name_or_path", ""))]
    return [n.lower() for n in names if n]


def profile_for(model: str, env: dict[str, str] | None = None) -> ModelProfile:
    """The profile for `model` (a served name, a HF id or a local dir), with env overrides applied."""
    env = os.environ if env is None else env
    prof = DEFAULT_PROFILE
    names = _names(model)
    for key, candidate in PROFILES:
        if any(key in n for n in names):
            prof = candidate
            break
    raw = str(env.get("QUMEM_VLLM_COMPACT_JSON", "")).strip().lower()
    if raw in _TRUE:
        prof = replace(prof, compact_json=True)
    elif raw in _FALSE:
        prof = replace(prof, compact_json=False)
    elif raw:
        raise ValueError(f"QUMEM_VLLM_COMPACT_JSON={raw!r}: expected 1/0, true/false, yes/no, on/off")
    return prof
