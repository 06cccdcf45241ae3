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
from typing import Any, Callable


@dataclass(frozen=True)
class ModelProfile:
    family: str
    compact_json: bool  # server's structured-outputs disable_any_whitespace
    # The embedded engine decodes against the schema's bounds cut to this ("items/3,chars/2": a third of every
    # maxItems, half of every long maxLength), None: the schema's own. Why: SmolLM2-135M fills every array to
    # maxItems and every string to maxLength with repeats ("which is a one-shot, which is a one-shot, ..."),
    # so the bounds, not the content, set its cost: on the example archive's 51 decomposition calls the cut
    # bounds took 7,440 completion tokens against 17,158 (same 51 calls parsed) and a third of the decode time.
    output_bounds: str | None = None
    # The embedded engine's matmul weights: "bf16" where oneDNN runs bfloat16 natively (AMX / AVX512-BF16;
    # elsewhere float32), None: float32. Why: a 0.5B model's prefill and decode are matmul-bound, and on
    # the 2-core AMX box bf16 ran a 896x9728 product 3x (64 rows) to 6x (512 rows) faster than float32.
    weights: str | None = None
    # Memories this model writes that no reader can use are dropped and counted (memories/readability.py's
    # template slot, fewer than 3 content words, a phrase said 3 times). Why: on the example archive 31 % of
    # SmolLM2-135M's memories were near-empty, 18 % repeated a phrase, 9 % held "[user_name]"; the 1.5B
    # evaluation model's short memories are real ones ("Family is everything": 58 of 2,431 near-empty), so
    # the gate is the small model's, not everyone's.
    memory_gate: bool = False


DEFAULT_PROFILE = ModelProfile(family="default", compact_json=True)

# (substring of the lower-cased model name, profile); first match wins, so specific before general.
PROFILES: tuple[tuple[str, ModelProfile], ...] = (
    # "plain": free text may hold no bracket, so no "[user_name]" slot can be written (see tighten_schema)
    ("smollm2", ModelProfile(family="smollm2", compact_json=True, output_bounds="items/3,chars/2,plain",
                             memory_gate=True)),
    # the embedded 0.5B runs bf16 weights; the 1.5B evaluation model (served by vLLM) keeps its own settings
    ("qwen2.5-coder-0.5b", ModelProfile(family="qwen2.5-coder", compact_json=False, weights="bf16")),
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
    weights = str(env.get("QUMEM_LLM_WEIGHTS", "")).strip().lower()
    if weights:
        if weights not in ("f32", "bf16"):
            raise ValueError(f"QUMEM_LLM_WEIGHTS={weights!r}: expected f32 or bf16")
        prof = replace(prof, weights=None if weights == "f32" else weights)
    bounds = str(env.get("QUMEM_LLM_OUTPUT_BOUNDS", "")).strip()
    if bounds:
        prof = replace(prof, output_bounds=None if bounds == "full" else (_parse_bounds(bounds) and bounds))
    return prof


# A string bound at or below this many characters is an id or a code (a citation alias "M12"): never cut.
MIN_CUT_LENGTH = 32


def _parse_bounds(bounds: str) -> tuple[int, int, bool]:
    """(N, M, plain) of "items/N,chars/M[,plain]"."""
    try:
        words = [p.strip() for p in bounds.split(",")]
        plain = "plain" in words
        parts = dict(p.split("/") for p in words if p != "plain")
        items, chars = int(parts.pop("items")), int(parts.pop("chars"))
        if parts or items < 1 or chars < 1:
            raise ValueError
    except (ValueError, KeyError):
        raise ValueError(f"output bounds {bounds!r}: expected 'full' or 'items/N,chars/M[,plain]' (N, M >= 1)") from None
    return items, chars, plain


# a free-text string with no bracket, quote, backslash or control character, its length bounds kept (a
# JSON-schema pattern replaces minLength/maxLength in xgrammar, so the regex carries them)
PLAIN_TEXT = '^[^\\[\\]{{}}<>"\\\\\\x00-\\x1f]{{{lo},{hi}}}$'


def plain_pattern(lo: int, hi: int) -> str:
    return PLAIN_TEXT.format(lo=lo, hi=hi)


def output_bounds_of(backend: Any) -> str | None:
    """The cut schema bounds the backend under any wrappers (ledger, record, checkpoints) decodes with."""
    for _ in range(8):
        if getattr(backend, "output_bounds", None):
            return backend.output_bounds
        backend = getattr(backend, "inner", None)
        if backend is None:
            break
    return None


def tighten_schema(schema: Any, bounds: str | None) -> Any:
    """`schema` with every maxItems divided by N (rounded up, never below minItems or 1) and every maxLength
    above MIN_CUT_LENGTH divided by M (not below MIN_CUT_LENGTH or minLength), for bounds "items/N,chars/M";
    with ",plain" those long strings also take no bracket (`plain_pattern`): a model cannot write a
    "[user_name]" slot it was never shown. What it allows is a subset of what `schema` allows, so an output
    still validates against `schema`."""
    if not bounds:
        return schema
    items, chars, plain = _parse_bounds(bounds)

    def tighten(out: dict) -> dict:
        if isinstance(out.get("maxItems"), int) and out["maxItems"] > 1:
            out["maxItems"] = max(int(out.get("minItems", 1)), 1, -(-out["maxItems"] // items))
        if isinstance(out.get("maxLength"), int) and out["maxLength"] > MIN_CUT_LENGTH:
            out["maxLength"] = max(int(out.get("minLength", 0)), MIN_CUT_LENGTH, -(-out["maxLength"] // chars))
            if plain and "pattern" not in out:  # the regex carries the bounds (xgrammar ignores them beside one)
                out["pattern"] = plain_pattern(int(out.pop("minLength", 0)), out.pop("maxLength"))
        return out

    return map_schema_nodes(schema, tighten)


def map_schema_nodes(schema: Any, fn: Callable[[dict], dict]) -> Any:
    """A copy of `schema` with `fn` applied to every object node, children first (`fn` gets a fresh dict)."""
    if isinstance(schema, list):
        return [map_schema_nodes(x, fn) for x in schema]
    if not isinstance(schema, dict):
        return schema
    return fn({k: map_schema_nodes(v, fn) for k, v in schema.items()})
