"""Train the continuity classifier on TIAGE train (plus, with ``--mix``, other domains' training
dialogues built from calibration halves only), select epoch + threshold on TIAGE dev, report on test.

    python -m qumem_pipeline.episodes.continuity.train --out /tmp/clf --seed 0 --mix ood,gen --threads 2  # the shipped recipe
    python -m qumem_pipeline.episodes.continuity.train --out /tmp/tiage --seed 0                         # TIAGE alone

A retrain writes to `--out` (default `.artifacts/continuity/`), never the committed artifact unless
`--overwrite-shipped` says so, and ends by storing the boundary rule kind that ships: the learned block
rule (`tune_learned`), not `tune_decoding`'s (`--tuned-rule` keeps that one).

Only LoRA adapters, the token-type table and the head are trained and saved (a ~1-2 MB artifact);
the base MiniLM weights are verified by sha256 at load time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

from qumem_pipeline.runtime.batching import pad_batch
from qumem_pipeline.episodes.metrics import evaluate
from qumem_pipeline.embedding.base_model import BASE_MODEL_NAME, base_weights_sha256, load_tokenizer
from qumem_pipeline.episodes.continuity.data import Pair, dialogue_pairs, load_tiage
from qumem_pipeline.episodes.continuity.inference import ADAPTER_FILE, prepare_batches, tokenize_pairs
from qumem_pipeline.episodes.continuity.model import ContinuityNet, ModelConfig
from qumem_pipeline.episodes.continuity.tune_decoding import rule_metrics, tune, versioned_config, write_config_atomic

ARTIFACT_FORMAT = "continuity-minilm-lora-v1"


@dataclass
class TrainConfig:
    epochs: int = 5
    batch_size: int = 32
    lr: float = 1e-3
    head_lr: float = 2e-3
    weight_decay: float = 0.01
    warmup_frac: float = 0.06
    boundary_weight: float = 1.0  # loss weight of "new event" (same = 0) examples
    eval_batch_size: int = 128
    threads: int = 2
    swap_aug: bool = False  # also train on (b, a) with the same label (continuity is ~symmetric)
    label_smoothing: float = 0.0  # BCE targets y -> y * (1 - eps) + eps / 2
    cross_neg: float = 0.0  # extra "new event" pairs per train pair: (a, utterance of another dialogue)
    mix: tuple[str, ...] = ()  # other domains' training dialogues added to TIAGE train: "ood", "gen" (mixed_pairs)
    swa_from: int = 0  # >0: from this epoch on, the running mean of the epoch-end weights is a candidate too
    bucket_chunk: int = 0  # >1: batches per length-sorted chunk (less padding); 0: plain random batches
    max_steps: int | None = None  # for tests: stop after this many optimizer steps
    train_limit: int | None = None  # for tests: use only the first N train pairs
    cli_args: tuple[str, ...] = ()  # the command-line arguments, recorded in the artifact
    model: ModelConfig = field(default_factory=ModelConfig)


def set_determinism(seed: int, threads: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)


def epoch_batches(gen: np.random.Generator, lengths: np.ndarray, batch_size: int, chunk: int) -> list[np.ndarray]:
    """Shuffled batches of similar-length pairs: shuffle, cut into chunks of ``chunk`` batches, sort
    each chunk by length, batch it, shuffle the batches (less padding, same randomness budget)."""
    order = gen.permutation(len(lengths))
    if chunk and chunk > 1:
        span = batch_size * chunk
        parts = [order[i : i + span] for i in range(0, len(order), span)]
        order = np.concatenate([p[np.argsort(lengths[p], kind="stable")] for p in parts])
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    if chunk and chunk > 1:
        batches = [batches[i] for i in gen.permutation(len(batches))]
    return batches


def cross_dialogue_negatives(pairs: list[Pair], rate: float, seed: int) -> list[tuple[str, str]]:
    """Sure "new event" pairs: an utterance followed by one drawn from a different dialogue.

    TIAGE train has 887 boundaries in 4,392 pairs; these add topic changes with no shared thread at all, seeded."""
    rng = np.random.default_rng(seed + 7919)
    by_dial: dict[str, list[str]] = {}
    for p in pairs:
        by_dial.setdefault(p.dial_id, []).append(p.b)
    dials = list(by_dial)
    if len(dials) < 2:
        return []
    out = []
    n = round(rate * len(pairs))
    for i in rng.choice(len(pairs), size=n, replace=n > len(pairs)):
        p = pairs[int(i)]
        other = dials[int(rng.integers(len(dials)))]
        while other == p.dial_id:
            other = dials[int(rng.integers(len(dials)))]
        utts = by_dial[other]
        out.append((p.a, utts[int(rng.integers(len(utts)))]))
    return out


MIX_DOMAINS = ("ood", "gen")


def parse_mix(text: str) -> tuple[str, ...]:
    """``--mix``'s comma-separated domains ('' = none)."""
    return tuple(x for x in text.split(",") if x)


def mixed_pairs(mix: tuple[str, ...]) -> list[Pair]:
    """Pairs of other domains' training dialogues, built from the calibration halves only (never a
    session or task domain of an eval half): ``ood`` LoCoMo excerpts joined again
    (:func:`.ood_data.build_ood_train`), ``gen`` generated task dialogues of the calib domains
    (:func:`.generated_dialogues.build_generated_train`). Why: trained on TIAGE alone the classifier's
    P(same) barely moves at a join of other domains (≈ 0.78 against ≈ 0.87 inside an excerpt)."""
    unknown = sorted(set(mix) - set(MIX_DOMAINS))
    if unknown:
        raise ValueError(f"unknown training domains {unknown}; expected some of {MIX_DOMAINS}")
    from qumem_pipeline.episodes.continuity.generated_dialogues import generated_train_dialogues
    from qumem_pipeline.episodes.continuity.ood_data import ood_train_dialogues

    dialogues = []
    if "ood" in mix:
        dialogues += ood_train_dialogues()
    if "gen" in mix:
        dialogues += generated_train_dialogues()
    return dialogue_pairs(dialogues)


def predict_net(net: ContinuityNet, tokenizer, pairs: list[Pair], max_len: int, batch_size: int) -> np.ndarray:
    net.eval()
    out = np.empty(len(pairs), dtype=np.float32)
    with torch.inference_mode():
        for idx, ids, mask, types in prepare_batches(tokenizer, [(p.a, p.b) for p in pairs], max_len, batch_size):
            out[idx] = torch.sigmoid(net(ids, mask, types)).numpy()
    return out


def group_boundaries(pairs: list[Pair], is_boundary: np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
    """Per-dialogue (reference, hypothesis) gap strings, in pair order."""
    refs: dict[str, list[int]] = {}
    hyps: dict[str, list[int]] = {}
    for p, b in zip(pairs, is_boundary):
        refs.setdefault(p.dial_id, []).append(1 - p.same)
        hyps.setdefault(p.dial_id, []).append(int(b))
    keys = list(refs)
    return [refs[k] for k in keys], [hyps[k] for k in keys]


def choose_threshold(pairs: list[Pair], p_same: np.ndarray) -> tuple[float, dict]:
    """Threshold on P(same) (boundary when below) minimising dev Pk (ties: WD, then F1)."""
    best = None
    for thr in np.round(np.arange(0.02, 0.99, 0.01), 2):
        refs, hyps = group_boundaries(pairs, p_same < thr)
        s = evaluate(refs, hyps)
        key = (round(s.pk, 6), round(s.windowdiff, 6), -s.f1)
        if best is None or key < best[0]:
            best = (key, float(thr), s)
    _, thr, s = best
    return thr, {"pk": s.pk, "windowdiff": s.windowdiff, "f1": s.f1, "precision": s.precision, "recall": s.recall}


def per_dialogue(pairs: list[Pair], values: np.ndarray) -> tuple[list[np.ndarray], list[list[int]]]:
    """(values, reference gap string) per dialogue, in pair order — what the decision rule sees."""
    vals: dict[str, list[float]] = {}
    refs: dict[str, list[int]] = {}
    for p, v in zip(pairs, values):
        vals.setdefault(p.dial_id, []).append(float(v))
        refs.setdefault(p.dial_id, []).append(1 - p.same)
    return [np.asarray(vals[k]) for k in vals], [refs[k] for k in vals]


def metrics_at(pairs: list[Pair], p_same: np.ndarray, thr: float) -> dict:
    refs, hyps = group_boundaries(pairs, p_same < thr)
    s = evaluate(refs, hyps)
    return {"pk": s.pk, "windowdiff": s.windowdiff, "f1": s.f1, "precision": s.precision, "recall": s.recall}


def _weights_version(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].float().contiguous().numpy().tobytes())
    return f"{ARTIFACT_FORMAT}-{h.hexdigest()[:12]}"


def _artifact_config(cfg: TrainConfig, seed: int, best: dict, history: list, test_m: dict, n: int,
                     step: int, wall: float, partial: bool = False) -> dict:
    mcfg = cfg.model
    train_cfg = {k: v for k, v in cfg.__dict__.items() if k not in ("model", "cli_args")}
    return {
        "format": ARTIFACT_FORMAT,
        "version": _weights_version(best["state"]),
        "base_model": BASE_MODEL_NAME,
        "base_model_sha256": base_weights_sha256(),
        "model": mcfg.to_json(),
        "max_len": mcfg.max_len,
        "lora": {"r": mcfg.lora_r, "alpha": mcfg.lora_alpha, "dropout": mcfg.lora_dropout,
                 "targets": list(mcfg.lora_targets)},
        "threshold": best["threshold"],
        "threshold_rule": "boundary (new event) when P(same) < threshold; chosen on TIAGE dev to minimise Pk",
        "selected_epoch": best["epoch"],
        "metrics": {"dev": best["dev"], "test": test_m},
        "history": history,
        "partial": partial,
        "train": {**train_cfg, "seed": seed, "n_train_pairs": n, "steps": step,
                  "wall_time_s": round(wall, 1), "torch": torch.__version__,
                  "command": " ".join(["python -m qumem_pipeline.episodes.continuity.train", *cfg.cli_args])
                  if cfg.cli_args else f"python -m qumem_pipeline.episodes.continuity.train --seed {seed}",
                  "trained_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    }


def _write_artifact(out_dir, state: dict[str, torch.Tensor], config: dict) -> None:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.float().contiguous() for k, v in state.items()}
    tmp = out / f".tmp-{ADAPTER_FILE}"
    save_file(state, str(tmp), metadata={"version": config["version"]})
    os.replace(tmp, out / ADAPTER_FILE)
    write_config_atomic(out, config)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _splits(train_pairs, dev_pairs, test_pairs, cfg: TrainConfig):
    """TIAGE's splits for whichever the caller did not pass (test may be absent)."""
    if train_pairs is None:
        train_pairs = dialogue_pairs(load_tiage("train"))
    if dev_pairs is None:
        dev_pairs = dialogue_pairs(load_tiage("dev"))
    if test_pairs is None:
        try:
            test_pairs = dialogue_pairs(load_tiage("test"))
        except FileNotFoundError:
            test_pairs = []
    if cfg.train_limit:
        train_pairs = train_pairs[: cfg.train_limit]
    if cfg.mix:
        train_pairs = train_pairs + mixed_pairs(cfg.mix)
    return train_pairs, dev_pairs, test_pairs


@dataclass
class _TrainSet:
    ids: list
    types: list
    labels: np.ndarray
    lengths: np.ndarray

    @property
    def n(self) -> int:
        return len(self.ids)


def _train_set(tok, train_pairs: list[Pair], cfg: TrainConfig, seed: int) -> _TrainSet:
    """Tokenized pairs and labels, with the configured augmentations (swapped pairs, cross-dialogue negatives)."""
    raw = [(p.a, p.b) for p in train_pairs]
    labels = np.array([p.same for p in train_pairs], dtype=np.float32)
    if cfg.swap_aug:
        raw += [(p.b, p.a) for p in train_pairs]
        labels = np.concatenate([labels, labels])
    if cfg.cross_neg:
        extra = cross_dialogue_negatives(train_pairs, cfg.cross_neg, seed)
        raw += extra
        labels = np.concatenate([labels, np.zeros(len(extra), dtype=np.float32)])
    ids, types = tokenize_pairs(tok, raw, cfg.model.max_len)
    return _TrainSet(ids, types, labels, np.array([len(x) for x in ids]))


def _optimizer(net: ContinuityNet, cfg: TrainConfig, total: int):
    """AdamW (LoRA body and head at their own rates), linear warm-up then linear decay to 0."""
    warm = max(1, int(cfg.warmup_frac * total))
    head_params = [p for p in net.head.parameters()]
    body_params = [p for p in net.bert.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [{"params": body_params, "lr": cfg.lr}, {"params": head_params, "lr": cfg.head_lr}],
        weight_decay=cfg.weight_decay,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else max(0.0, (total - s) / max(1, total - warm))
    )
    return opt, sched


def _loss(net: ContinuityNet, data: _TrainSet, idx: np.ndarray, pad_id: int, cfg: TrainConfig) -> torch.Tensor:
    """Weighted (boundary_weight on "new event" pairs), optionally label-smoothed BCE of one batch."""
    x, m, t = pad_batch(data.ids, idx, pad_id, types=data.types)
    y = torch.from_numpy(data.labels[idx])
    logits = net(x, m, t)
    w = torch.where(y < 0.5, torch.full_like(y, cfg.boundary_weight), torch.ones_like(y))
    target = y * (1.0 - cfg.label_smoothing) + 0.5 * cfg.label_smoothing if cfg.label_smoothing else y
    return (torch.nn.functional.binary_cross_entropy_with_logits(logits, target, reduction="none") * w).sum() / w.sum()


class _Selection:
    """Epoch-end candidates (and their running weight average from `swa_from`), scored on dev by Pk;
    the best so far is written as a partial artifact so a run cut short still leaves a usable one."""

    def __init__(self, cfg: TrainConfig, seed: int, tok, dev_pairs: list[Pair], out_dir, checkpoint: bool, log):
        self.cfg, self.seed, self.tok, self.dev_pairs = cfg, seed, tok, dev_pairs
        self.out_dir, self.checkpoint, self.log = out_dir, checkpoint, log
        self.best: dict | None = None
        self.swa = None
        self.history: list[dict] = []

    def _dev(self, net: ContinuityNet):
        p_dev = predict_net(net, self.tok, self.dev_pairs, self.cfg.model.max_len, self.cfg.eval_batch_size)
        thr, dev_m = choose_threshold(self.dev_pairs, p_dev)
        return p_dev, thr, dev_m

    def epoch_end(self, net: ContinuityNet, epoch: int, step: int, n: int, t0: float) -> None:
        p_dev, thr, dev_m = self._dev(net)
        self.history.append({"epoch": epoch + 1, "step": step, "threshold": thr, **{f"dev_{k}": v for k, v in dev_m.items()}})
        self.log(f"epoch {epoch + 1}: dev Pk {dev_m['pk']:.4f} WD {dev_m['windowdiff']:.4f} F1 {dev_m['f1']:.4f} "
                 f"thr {thr:.2f} ({time.time() - t0:.0f}s)")
        candidates = [(epoch + 1, thr, dev_m, net.trainable_state(), p_dev)]
        if self.cfg.swa_from and epoch + 1 >= self.cfg.swa_from:
            candidates += self._averaged(net, epoch, step, candidates[0][3])
        for ep, thr_c, dev_c, state_c, p_c in candidates:
            if self.best is None or dev_c["pk"] < self.best["dev"]["pk"]:
                self.best = {"epoch": ep, "threshold": thr_c, "dev": dev_c, "state": state_c, "p_dev": p_c}
                if self.out_dir is not None and self.checkpoint:
                    _write_artifact(self.out_dir, self.best["state"], _artifact_config(
                        self.cfg, self.seed, self.best, self.history, {}, n, step, time.time() - t0, partial=True))

    def _averaged(self, net: ContinuityNet, epoch: int, step: int, cur: dict) -> list:
        """Weight averaging over epoch ends: one model (one forward per pair), flatter optimum."""
        k = epoch + 2 - self.cfg.swa_from
        self.swa = cur if self.swa is None else {name: self.swa[name] + (cur[name] - self.swa[name]) / k for name in cur}
        if k <= 1:
            return []
        net.load_trainable_state(self.swa)
        p_swa, thr_s, dev_s = self._dev(net)
        net.load_trainable_state(cur)
        label = f"swa{self.cfg.swa_from}-{epoch + 1}"
        self.history.append({"epoch": label, "step": step, "threshold": thr_s, **{f"dev_{key}": v for key, v in dev_s.items()}})
        self.log(f"{label}: dev Pk {dev_s['pk']:.4f} WD {dev_s['windowdiff']:.4f} F1 {dev_s['f1']:.4f} thr {thr_s:.2f}")
        return [(label, thr_s, dev_s, {name: v.clone() for name, v in self.swa.items()}, p_swa)]


def _rule_and_test(net: ContinuityNet, tok, best: dict, dev_pairs, test_pairs, cfg: TrainConfig, seed: int, log):
    """The decision rule (threshold + rule parameters), chosen on dev only; then test under it."""
    rule = selection = None
    if "p_dev" in best:
        rule, selection = tune(*per_dialogue(dev_pairs, best["p_dev"]), seed=seed)
        log(f"decision rule on dev: {rule.describe()} ({selection['cv_pk']})")
    test_m = {}
    if test_pairs:
        p_test = predict_net(net, tok, test_pairs, cfg.model.max_len, cfg.eval_batch_size)
        test_m = (rule_metrics(rule, *per_dialogue(test_pairs, p_test)) if rule is not None
                  else metrics_at(test_pairs, p_test, best["threshold"]))
        log(f"test (epoch {best['epoch']}): Pk {test_m['pk']:.4f} WD {test_m['windowdiff']:.4f} F1 {test_m['f1']:.4f}")
    return rule, selection, test_m


SHIPPED_DIR = Path(__file__).resolve().parents[2] / "artifacts" / "continuity"  # the committed artifact
DEFAULT_OUT = Path(__file__).resolve().parents[3] / ".artifacts" / "continuity"  # a retrain's default home


class ShippedArtifactRefused(ValueError):
    """A retrain was pointed at the committed artifact without --overwrite-shipped."""


def output_dir(out: str | os.PathLike | None, overwrite_shipped: bool = False) -> Path:
    """Where a retrain writes: `out` (default `.artifacts/continuity/`), never the committed artifact
    (`qumem_pipeline/artifacts/continuity/`) unless `overwrite_shipped` asks for exactly that."""
    if overwrite_shipped:
        if out is not None and Path(out).resolve() != SHIPPED_DIR:
            raise ShippedArtifactRefused(f"--out {out} and --overwrite-shipped name two places: give one")
        return SHIPPED_DIR
    path = Path(out).resolve() if out is not None else DEFAULT_OUT
    if path == SHIPPED_DIR:
        raise ShippedArtifactRefused(f"--out {path} is the committed artifact: pass --overwrite-shipped to replace it")
    return path


def train_as_shipped(out_dir: Path, seed: int, cfg: TrainConfig, log=_log, cache: Path | None = None,
                     **pairs) -> dict:
    """Train into `out_dir` (`pairs`: train_pairs / dev_pairs / test_pairs, default the recipe's), then store
    the boundary rule kind that ships (the learned block rule, `tune_learned`) instead of the `tune_decoding`
    rule training picks; `cache` holds the rule's signals (default next to the artifact). Returns the config."""
    from qumem_pipeline.episodes.continuity.tune_learned import learned_rule

    res = train(out_dir, seed, cfg, log=log, **pairs)
    chosen = learned_rule(Path(out_dir), cache or Path(out_dir).parent / f".{Path(out_dir).name}-signals.pkl", write=True)
    log(f"stored the learned rule in {out_dir} (version {chosen['version']})")
    return {**res, "version": chosen["version"], "rule": chosen["rule"]}


def train(out_dir: str | os.PathLike | None, seed: int = 0, cfg: TrainConfig | None = None,
          train_pairs: list[Pair] | None = None, dev_pairs: list[Pair] | None = None,
          test_pairs: list[Pair] | None = None, log=_log, checkpoint: bool = True) -> dict:
    """Train, select on dev, evaluate on test, write the artifact to ``out_dir`` (if given).

    Returns the artifact config dict (also holding ``losses``: per-step training losses).
    """
    cfg = cfg or TrainConfig()
    t0 = time.time()
    set_determinism(seed, cfg.threads)
    train_pairs, dev_pairs, test_pairs = _splits(train_pairs, dev_pairs, test_pairs, cfg)
    tok = load_tokenizer()
    net = ContinuityNet(cfg.model)
    data = _train_set(tok, train_pairs, cfg, seed)
    total = math.ceil(data.n / cfg.batch_size) * cfg.epochs
    if cfg.max_steps:
        total = min(total, cfg.max_steps)
    opt, sched = _optimizer(net, cfg, total)
    gen = np.random.default_rng(seed)
    selection = _Selection(cfg, seed, tok, dev_pairs, out_dir, checkpoint, log)
    losses: list[float] = []
    step = 0
    pad_id = tok.pad_token_id or 0
    for epoch in range(cfg.epochs):
        net.train()
        te = time.time()
        for idx in epoch_batches(gen, data.lengths, cfg.batch_size, cfg.bucket_chunk):
            if cfg.max_steps and step >= cfg.max_steps:
                break
            loss = _loss(net, data, idx, pad_id, cfg)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            losses.append(float(loss.detach()))
            if step % 20 == 0:
                log(f"epoch {epoch + 1} step {step}/{total} loss {np.mean(losses[-20:]):.4f} ({time.time() - te:.0f}s)")
        if not dev_pairs:
            break
        selection.epoch_end(net, epoch, step, data.n, t0)
        if cfg.max_steps and step >= cfg.max_steps:
            break

    best = selection.best or {"epoch": cfg.epochs, "threshold": 0.5, "dev": {}, "state": net.trainable_state()}
    net.load_trainable_state(best["state"])
    rule, chosen, test_m = _rule_and_test(net, tok, best, dev_pairs, test_pairs, cfg, seed, log)
    wall = time.time() - t0
    config = _artifact_config(cfg, seed, best, selection.history, test_m, data.n, step, wall)
    if rule is not None:
        config = versioned_config(config, rule, chosen)
        config["metrics"]["dev"] = rule_metrics(rule, *per_dialogue(dev_pairs, best["p_dev"]))
    if out_dir is not None:
        _write_artifact(out_dir, best["state"], config)
        log(f"wrote {out_dir} (version {config['version']}, {wall:.0f}s)")
    return {**config, "losses": losses}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help=f"artifact dir (default {DEFAULT_OUT}; never the committed one "
                    "without --overwrite-shipped)")
    ap.add_argument("--overwrite-shipped", action="store_true", help=f"write into the committed artifact {SHIPPED_DIR}")
    ap.add_argument("--tuned-rule", action="store_true", help="keep tune_decoding's rule instead of the learned "
                    "block rule that ships (tune_learned)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=TrainConfig.epochs)
    ap.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    ap.add_argument("--lr", type=float, default=TrainConfig.lr)
    ap.add_argument("--head-lr", type=float, default=TrainConfig.head_lr)
    ap.add_argument("--boundary-weight", type=float, default=TrainConfig.boundary_weight)
    ap.add_argument("--lora-r", type=int, default=ModelConfig.lora_r)
    ap.add_argument("--pooling", choices=["cls", "mean", "cls_mean", "seg_pair"], default=ModelConfig.pooling)
    ap.add_argument("--swap-aug", type=int, choices=[0, 1], default=int(TrainConfig.swap_aug),
                    help="1: also train on swapped (b, a) pairs")
    ap.add_argument("--label-smoothing", type=float, default=TrainConfig.label_smoothing)
    ap.add_argument("--cross-neg", type=float, default=TrainConfig.cross_neg,
                    help="extra cross-dialogue 'new event' pairs per train pair (0 = off)")
    ap.add_argument("--mix", default="", help=f"comma-separated other domains to train on too: {', '.join(MIX_DOMAINS)}"
                    " (their calibration halves' sessions/domains only; '' = TIAGE train alone)")
    ap.add_argument("--swa-from", type=int, default=TrainConfig.swa_from,
                    help="also try the running mean of epoch-end weights from this epoch on (0 = off)")
    ap.add_argument("--train-limit", type=int, default=None)
    ap.add_argument("--threads", type=int, default=TrainConfig.threads)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--bucket-chunk", type=int, default=TrainConfig.bucket_chunk,
                    help="length-bucketed training batches (e.g. 32; faster, changes the run); 0 = off")
    args = ap.parse_args(argv)
    mcfg = ModelConfig(lora_r=args.lora_r, pooling=args.pooling)
    cfg = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, head_lr=args.head_lr,
                      boundary_weight=args.boundary_weight, threads=args.threads,
                      max_steps=args.max_steps, bucket_chunk=args.bucket_chunk, swap_aug=bool(args.swap_aug),
                      label_smoothing=args.label_smoothing, cross_neg=args.cross_neg,
                      mix=parse_mix(args.mix), swa_from=args.swa_from, train_limit=args.train_limit, model=mcfg,
                      cli_args=tuple(sys.argv[1:] if argv is None else argv))
    try:
        out = output_dir(args.out, args.overwrite_shipped)
    except ShippedArtifactRefused as e:
        ap.error(str(e))
    res = train(out, args.seed, cfg) if args.tuned_rule else train_as_shipped(out, args.seed, cfg)
    print(json.dumps({"out": str(out), "version": res["version"], "threshold": res["threshold"], "metrics": res["metrics"],
                      "wall_time_s": res["train"]["wall_time_s"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
