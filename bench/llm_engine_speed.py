#!/usr/bin/env python
"""How fast this CPU runs the evaluation model: prefill and decode, vLLM's CPU engine against llama.cpp.

    QUMEM_VLLM_PYTHON=$PWD/.venv-vllm/bin/python python bench/llm_engine_speed.py \
        --model .cache/models/Qwen2.5-Coder-1.5B-Instruct --dtype float32 \
        --gguf .cache/downloads/eval-model/qwen2.5-coder-1.5b-instruct.gguf \
        --llamacpp-python /path/to/venv-with-llama-cpp-python/bin/python --json

Why: every LLM-dependent figure of the project (LoCoMo QA, decomposition) is bound by how many
prompt tokens per second the box can read, and that depends on the CPU (vLLM's bf16 path needs
AVX-512; on AVX2 it falls back to torch). This bench says what a box gives before hours are spent
on a run, and whether the other engine (llama.cpp on the quantized GGUF the model ships as) is
faster there.

Workload: the decomposition prompts of the example archive's sessions (the stage's own requests,
`decompose_requests`), chat-templated once here with the model's tokenizer, so both engines read the
*same token ids*.
- prefill: every prompt with one output token; prompt tokens / wall.
  vLLM gets them all at once (its batch), llama.cpp one after another (its Python API has one sequence).
- decode: `--decode-tokens` tokens from a short prompt, EOS ignored, one sequence at a time and, on
  vLLM, `--decode-batch` sequences at once; generated tokens / wall.
Engine start-up is not timed; each engine runs alone (never beside the other), in its own python.
ratio_* = llama.cpp / vLLM, both measured in this run. llama.cpp is skipped (with the reason) when
`--llamacpp-python` is not given; it is not a project dependency (`pip install "llama-cpp-python[server]"`
builds it from source, which takes minutes on a small box).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

VLLM_SCRIPT = r'''
import json, sys, time


def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model"], seed=0, dtype=spec["dtype"], max_model_len=spec["max_model_len"],
              enforce_eager=True, enable_prefix_caching=False)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([TokensPrompt(prompt_token_ids=spec["warmup"])], one, use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    t0 = time.perf_counter()
    llm.generate(prompts, one, use_tqdm=False)
    prefill_s = time.perf_counter() - t0
    dec = SamplingParams(max_tokens=spec["decode_tokens"], temperature=0.0, ignore_eos=True)
    decode = {}
    for n in (1, spec["decode_batch"]):
        ps = [TokensPrompt(prompt_token_ids=[*spec["short"], 16 + i]) for i in range(n)]
        t0 = time.perf_counter()
        outs = llm.generate(ps, dec, use_tqdm=False)
        wall = time.perf_counter() - t0
        decode[str(n)] = {"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "wall_s": wall}
    print("RESULT " + json.dumps({"prefill_s": prefill_s, "decode": decode}), flush=True)


if __name__ == "__main__":  # vLLM spawns its engine process: the script must be import-safe
    main()
'''

LLAMACPP_SCRIPT = r'''
import json, os, sys, time


def main():
    import llama_cpp
    from llama_cpp import Llama

    spec = json.load(open(sys.argv[1]))
    n = os.cpu_count() or 1
    llm = Llama(model_path=spec["gguf"], n_ctx=spec["max_model_len"], n_batch=512, n_ubatch=512, n_threads=n,
                n_threads_batch=n, seed=0, verbose=False)
    llm.eval(spec["warmup"])
    t0 = time.perf_counter()
    for p in spec["prompts"]:
        llm.reset()
        llm.eval(p)
    prefill_s = time.perf_counter() - t0
    llm.reset()
    ids = [*spec["short"], 16]
    t0 = time.perf_counter()
    made = 0
    for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        made += 1
        if made >= spec["decode_tokens"]:
            break
    wall = time.perf_counter() - t0
    info = llama_cpp.llama_print_system_info().decode()
    print("RESULT " + json.dumps({"prefill_s": prefill_s, "decode": {"1": {"tokens": made, "wall_s": wall}},
                                  "system_info": info}), flush=True)


if __name__ == "__main__":
    main()
'''


def run_engine(python: str, script: str, spec: dict, env: dict, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        sp, sc = Path(tmp) / "spec.json", Path(tmp) / "engine.py"
        sp.write_text(json.dumps(spec))
        sc.write_text(script)
        proc = subprocess.run([python, str(sc), str(sp)], capture_output=True, text=True,
                              env={**os.environ, **env}, timeout=timeout_s)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{python} engine failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    return sorted(f for f in set(flags) if f.startswith(("avx512", "amx")) or f in ("avx2", "fma"))


def token_prompts(model_dir: Path, n: int, max_tokens: int) -> tuple[list[list[int]], list[int], list[int]]:
    """(prompts, warm-up prompt, short prompt) as token ids: the decomposition stage's requests."""
    from decompose_throughput import archive_episodes
    from transformers import AutoTokenizer

    from qumem_pipeline.memories.decompose import decompose_requests

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    eps = archive_episodes()
    if len(eps) < 2:
        raise SystemExit("the example archive has fewer than 2 sessions")
    reqs = decompose_requests(eps[1:], max_tokens=max_tokens)[:n]
    (warm,) = decompose_requests(eps[:1], max_tokens=max_tokens, types=("fact",))

    def ids(messages):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]

    short = ids([{"role": "user", "content": "Write a long story about a dog."}])
    return [ids(r.messages) for r in reqs], ids(warm.messages), short


def rates(res: dict, prompt_tokens: int) -> dict:
    out = {"prefill_tok_per_s": prompt_tokens / res["prefill_s"], "prefill_s": res["prefill_s"]}
    for n, d in res["decode"].items():
        out[f"decode_tok_per_s_{n}"] = d["tokens"] / d["wall_s"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / ".cache/models/Qwen2.5-Coder-1.5B-Instruct"),
                    help="safetensors model dir (vLLM; its tokenizer renders the prompts)")
    ap.add_argument("--gguf", default=str(ROOT / ".cache/downloads/eval-model/qwen2.5-coder-1.5b-instruct.gguf"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=12, help="decomposition prompts prefilled")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-batch", type=int, default=16)
    ap.add_argument("--vllm-python", default=os.environ.get("QUMEM_VLLM_PYTHON", ""))
    ap.add_argument("--llamacpp-python", default="", help="a python with llama-cpp-python (optional)")
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not args.vllm_python or not Path(args.vllm_python).exists():
        print("set QUMEM_VLLM_PYTHON (or --vllm-python): bash scripts/install_vllm_cpu.sh .venv-vllm", file=sys.stderr)
        return 2
    model_dir = Path(args.model)
    if not (model_dir / "config.json").exists():
        print(f"no model at {model_dir}: .venv/bin/python scripts/install_eval_model.py", file=sys.stderr)
        return 2
    prompts, warm, short = token_prompts(model_dir, args.prompts, 256)
    n_prompt = sum(len(p) for p in prompts)
    spec = {"model": str(model_dir), "gguf": args.gguf, "dtype": args.dtype, "max_model_len": args.max_model_len,
            "prompts": prompts, "warmup": warm, "short": short, "decode_tokens": args.decode_tokens,
            "decode_batch": args.decode_batch}
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}"),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")}
    result = {"cpu_count": os.cpu_count(), "cpu_flags": cpu_flags(), "prompts": len(prompts),
              "prompt_tokens": n_prompt, "decode_tokens": args.decode_tokens, "model": model_dir.name}
    print(f"{len(prompts)} decomposition prompts, {n_prompt} prompt tokens; CPU flags {result['cpu_flags']}", flush=True)
    result["vllm"] = {"dtype": args.dtype, **rates(run_engine(args.vllm_python, VLLM_SCRIPT, spec, env, args.timeout_s),
                                                  n_prompt)}
    if args.llamacpp_python:
        if not Path(args.gguf).exists():
            print(f"no GGUF at {args.gguf}: .venv/bin/python scripts/install_eval_model.py", file=sys.stderr)
            return 2
        res = run_engine(args.llamacpp_python, LLAMACPP_SCRIPT, spec, {}, args.timeout_s)
        result["llamacpp"] = {"gguf": Path(args.gguf).name, "system_info": res.pop("system_info"), **rates(res, n_prompt)}
        result["ratio_prefill"] = result["llamacpp"]["prefill_tok_per_s"] / result["vllm"]["prefill_tok_per_s"]
        result["ratio_decode_1"] = result["llamacpp"]["decode_tok_per_s_1"] / result["vllm"]["decode_tok_per_s_1"]
    else:
        result["llamacpp"] = {"skipped": "no --llamacpp-python given"}
    b = str(args.decode_batch)
    print(f"{'engine':<24} {'prefill tok/s':>14} {'decode tok/s (1)':>17} {'decode tok/s (' + b + ')':>18}")
    v = result["vllm"]
    print(f"{'vLLM ' + args.dtype:<24} {v['prefill_tok_per_s']:>14.1f} {v['decode_tok_per_s_1']:>17.1f} "
          f"{v['decode_tok_per_s_' + b]:>18.1f}")
    if "prefill_tok_per_s" in result["llamacpp"]:
        ll = result["llamacpp"]
        print(f"{'llama.cpp (GGUF)':<24} {ll['prefill_tok_per_s']:>14.1f} {ll['decode_tok_per_s_1']:>17.1f} {'-':>18}")
        print(f"llama.cpp / vLLM: prefill {result['ratio_prefill']:.2f}x, decode (1) {result['ratio_decode_1']:.2f}x")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
