"""Per-model serving settings (issue 18.4): compact JSON on for SmolLM2 / unknown, off for Qwen2.5."""

import json
import sys

import pytest

from qumem_pipeline.llm.factory import make_backend
from qumem_pipeline.llm.model_profiles import DEFAULT_PROFILE, profile_for
from qumem_pipeline.llm.vllm_managed import VLLMStartError


@pytest.mark.parametrize("model, family, compact", [
    ("/x/.cache/models/Qwen2.5-Coder-1.5B-Instruct", "qwen2.5-coder", False),
    ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5", False),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2", True),
    ("m", "default", True),
])
def test_profile_by_name(model, family, compact):
    prof = profile_for(model, env={})
    assert (prof.family, prof.compact_json) == (family, compact)


def test_profile_from_config_json_of_a_renamed_dir(tmp_path):
    d = tmp_path / "eval-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"_name_or_path": "Qwen/Qwen2.5-Coder-1.5B-Instruct"}))
    assert profile_for(str(d), env={}).family == "qwen2.5-coder"
    (d / "config.json").write_text("{not json")
    assert profile_for(str(d), env={}) == DEFAULT_PROFILE


def test_env_overrides_the_table_and_rejects_garbage():
    assert profile_for("Qwen2.5-Coder-1.5B-Instruct", env={"QUMEM_VLLM_COMPACT_JSON": "1"}).compact_json is True
    assert profile_for("SmolLM2-135M", env={"QUMEM_VLLM_COMPACT_JSON": "off"}).compact_json is False
    with pytest.raises(ValueError, match="QUMEM_VLLM_COMPACT_JSON"):
        profile_for("m", env={"QUMEM_VLLM_COMPACT_JSON": "maybe"})


def _cmd(tmp_path, monkeypatch, model, **env):
    """The server command vllm-managed would run (this venv has no vllm: the child exits, the error names it)."""
    for k in ("QUMEM_VLLM_COMPACT_JSON", "QUMEM_VLLM_EXTRA_ARGS", "QUMEM_VLLM_MAX_MODEL_LEN"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(VLLMStartError) as err:
        make_backend("vllm-managed", model=model, python=sys.executable, log_path=tmp_path / "v.log", startup_timeout_s=30)
    return str(err.value)


def test_vllm_managed_serves_qwen_without_compact_json(tmp_path, monkeypatch):
    msg = _cmd(tmp_path, monkeypatch, "/m/Qwen2.5-Coder-1.5B-Instruct")
    assert '"disable_any_whitespace": false' in msg and '"backend": "xgrammar"' in msg
    msg = _cmd(tmp_path, monkeypatch, "/m/SmolLM2-135M-Instruct")
    assert '"disable_any_whitespace": true' in msg


def test_vllm_managed_reads_extra_args_and_max_len_from_env(tmp_path, monkeypatch):
    msg = _cmd(tmp_path, monkeypatch, "/m/Qwen2.5-Coder-1.5B-Instruct",
               QUMEM_VLLM_EXTRA_ARGS="--enforce-eager --structured-outputs-config '{\"backend\": \"guidance\"}'",
               QUMEM_VLLM_MAX_MODEL_LEN="4096")
    assert "--enforce-eager" in msg and "--max-model-len 4096" in msg
    assert msg.count("--structured-outputs-config") == 1 and "guidance" in msg


def test_served_name_carries_a_forced_dtype(tmp_path, monkeypatch):
    """The same weights in float32 answer differently from bf16: the recorded model (the served name)
    says so, and a ledger never replays one dtype's answers for the other."""
    from qumem_pipeline.llm.vllm_managed import default_served_name, dtype_in

    assert dtype_in(["--enforce-eager", "--dtype", "float32"]) == "float32" and dtype_in(["--dtype=half"]) == "half"
    assert dtype_in(["--enforce-eager"]) is None
    assert default_served_name("/m/Qwen2.5-Coder-1.5B-Instruct", ["--enforce-eager"]) == "Qwen2.5-Coder-1.5B-Instruct"
    assert default_served_name("/m/Qwen2.5-Coder-1.5B-Instruct", ["--dtype", "float32"]) == "Qwen2.5-Coder-1.5B-Instruct@float32"
    assert default_served_name("/m/Q", ["--dtype", "auto"]) == "Q"
    msg = _cmd(tmp_path, monkeypatch, "/m/Qwen2.5-Coder-1.5B-Instruct", QUMEM_VLLM_EXTRA_ARGS="--enforce-eager --dtype float32")
    assert "--served-model-name Qwen2.5-Coder-1.5B-Instruct@float32" in msg and "--dtype float32" in msg


def test_output_bounds_cut_the_schema_to_a_subset():
    """SmolLM2's profile cuts every maxItems to a third and long maxLength to half, and its free text takes
    no bracket ("[user_name]" slots); ids stay whole, and whatever the cut schema allows the full one allows too."""
    import jsonschema

    from qumem_pipeline.llm.model_profiles import tighten_schema
    from qumem_pipeline.query.strategies.agents import A3_SCHEMA

    bounds = profile_for("SmolLM2-135M-Instruct-Q4_1", env={}).output_bounds
    assert bounds == "items/3,chars/2,plain" and profile_for("Qwen2.5-Coder-1.5B-Instruct", env={}).output_bounds is None
    cut = tighten_schema(A3_SCHEMA, bounds)
    facts = cut["properties"]["facts"]
    statement = facts["items"]["properties"]["statement"]
    assert facts["maxItems"] == 1 and statement["pattern"].endswith("{0,60}$") and "maxLength" not in statement
    assert facts["items"]["properties"]["memory_ids"]["items"]["maxLength"] == 4  # "M12": never cut
    assert tighten_schema(A3_SCHEMA, None) is A3_SCHEMA
    out = {"facts": [{"statement": "x" * 60, "memory_ids": ["M1"]}], "preference_trajectory": [], "insights": []}
    jsonschema.validate(out, cut)
    jsonschema.validate(out, A3_SCHEMA)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**out, "facts": out["facts"] * 2}, cut)
    for text in ("x" * 61, "The user [user_name] likes", 'say "hi"'):
        bad = {**out, "facts": [{"statement": text, "memory_ids": ["M1"]}]}
        jsonschema.validate(bad, A3_SCHEMA)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, cut)
    assert "pattern" not in tighten_schema(A3_SCHEMA, "items/3,chars/2")["properties"]["facts"]["items"]["properties"]["statement"]


def test_output_bounds_env_override():
    assert profile_for("SmolLM2-135M-Instruct-Q4_1", env={"QUMEM_LLM_OUTPUT_BOUNDS": "full"}).output_bounds is None
    assert profile_for("qwen2.5-7b", env={"QUMEM_LLM_OUTPUT_BOUNDS": "items/2,chars/2"}).output_bounds == "items/2,chars/2"
    assert profile_for("qwen2.5-7b", env={"QUMEM_LLM_OUTPUT_BOUNDS": "items/2,chars/2,plain"}).output_bounds.endswith("plain")
    with pytest.raises(ValueError, match="items/N,chars/M"):
        profile_for("qwen2.5-7b", env={"QUMEM_LLM_OUTPUT_BOUNDS": "half"})
