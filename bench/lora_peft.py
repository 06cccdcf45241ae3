"""The shipped continuity artifact through peft (``continuity/lora.py``, the product) and through the
hand-written LoRA it replaced (``tests/lora_reference.py``), the committed weights unchanged: P(same)
on TIAGE test pairs and pairs/s, merged (how inference runs) and unmerged (how training runs), both
ways in one run, interleaved.

    python bench/lora_peft.py [--pairs 200] [--repeats 3] [--json]

Prints one JSON object as the last line.
"""

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import lora_reference as ref  # noqa: E402
from qumem_pipeline.embedding.base_model import load_base_model, load_tokenizer
from qumem_pipeline.episodes.continuity.data import dialogue_pairs, load_tiage
from qumem_pipeline.episodes.continuity.inference import ADAPTER_FILE, DEFAULT_ARTIFACT_DIR, prepare_batches
from qumem_pipeline.episodes.continuity.model import ContinuityNet, ModelConfig


def build(kind: str, merged: bool) -> ContinuityNet:
    cfg = ModelConfig.from_json(json.loads((DEFAULT_ARTIFACT_DIR / "config.json").read_text())["model"])
    sd = load_file(str(DEFAULT_ARTIFACT_DIR / ADAPTER_FILE))
    if kind == "peft":  # the product's path
        net = ContinuityNet(cfg)
        net.load_trainable_state(sd)
        if merged:
            net.merge()
    else:
        net = ContinuityNet(cfg, bert=load_base_model(), with_lora=False)
        ref.inject_lora(net.bert, cfg.lora_targets, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout)
        missing, unexpected = net.load_state_dict(sd, strict=False)
        assert not unexpected, unexpected
        assert not [k for k in missing if "lora" in k], missing
        if merged:
            ref.merge_lora(net.bert)
    return net.eval()


@torch.inference_mode()
def predict(net, batches, n) -> np.ndarray:
    out = np.empty(n, dtype=np.float32)
    for idx, ids, mask, types in batches:
        out[idx] = torch.sigmoid(net(ids, mask, types)).numpy()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    pairs = [(p.a, p.b) for p in dialogue_pairs(load_tiage("test"))][: args.pairs]
    cfg = json.loads((DEFAULT_ARTIFACT_DIR / "config.json").read_text())
    batches = prepare_batches(load_tokenizer(), pairs, cfg["model"]["max_len"], args.batch_size)
    res = {"pairs": len(pairs), "torch_threads": torch.get_num_threads(), "repeats": args.repeats}
    for merged in (True, False):
        mode = "merged" if merged else "unmerged"
        nets = {k: build(k, merged) for k in ("hand", "peft")}
        probs = {k: predict(n, batches, len(pairs)) for k, n in nets.items()}  # also the warm-up
        secs = {k: [] for k in nets}
        for _ in range(args.repeats):  # interleaved, so load on the machine hits both alike
            for k, n in nets.items():
                t0 = time.perf_counter()
                predict(n, batches, len(pairs))
                secs[k].append(time.perf_counter() - t0)
        res[mode] = {
            "max_abs_diff_p_same": float(np.max(np.abs(probs["hand"] - probs["peft"]))),
            "pairs_per_s_hand": round(len(pairs) / min(secs["hand"]), 1),
            "pairs_per_s_peft": round(len(pairs) / min(secs["peft"]), 1),
            "peft_over_hand_speed": round(min(secs["hand"]) / min(secs["peft"]), 3),
        }
        if merged:
            res["mean_p_same"] = float(probs["hand"].mean())
            shipped = json.loads((DEFAULT_ARTIFACT_DIR / "config.json").read_text())["threshold"]
            res["merged"]["decisions_differ_at_threshold"] = int(((probs["hand"] < shipped) != (probs["peft"] < shipped)).sum())
    print(json.dumps(res, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
