"""Batched inference: P(same event) for many (previous, next) utterance pairs.

One forward per pair. Pairs are tokenised once (fast tokenizer, no padding), sorted by token length,
cut into batches, padded only to the longest pair of each batch, run under ``torch.inference_mode()``
and scattered back into input order. LoRA is merged into the base weights at load time, so a batch
costs exactly one plain MiniLM forward. CUDA when available, else CPU: the same code path, float32 on
both by default, so a GPU host and a CPU host cut the same episodes (bf16 autocast on CUDA moved P(same)
by up to 0.0033 on an H200 and flipped 22 of 4,096 threshold decisions: docs/operating.md#gpu-check;
`QUMEM_CLASSIFIER_PRECISION=bf16` opts into it, and the classifier version then says so).

When the artifact's decision rule uses similarity dips (:mod:`.decoding`, step 4), the base MiniLM
sentence encoder is loaded beside the classifier (:mod:`.similarity`) and :meth:`pair_cosine` gives
the cosine sequence the rule needs; :meth:`predict_boundaries` applies both.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from qumem_pipeline.runtime.batching import length_buckets, pad_batch
from qumem_pipeline.embedding.base_model import base_model_dir, base_weights_sha256, load_tokenizer
from qumem_pipeline.episodes.continuity.decoding import (
    DecisionRule, classifier_precision, version_of_config, version_with_precision,
)
from qumem_pipeline.episodes.continuity.similarity import history_embeddings, history_signals_of, pair_cosine
from qumem_pipeline.episodes.continuity.model import ContinuityNet, ModelConfig

DEFAULT_ARTIFACT_DIR = Path(__file__).resolve().parents[2] / "artifacts" / "continuity"
ADAPTER_FILE = "adapters.safetensors"
CONFIG_FILE = "config.json"

ProgressFn = Callable[[int, int], None]


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def tokenize_pairs(tokenizer, pairs: Sequence[tuple[str, str]], max_len: int) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids and token-type ids per pair, unpadded (``[CLS] a [SEP] b [SEP]``)."""
    if not pairs:
        return [], []
    a = [p[0] if p[0] is not None else "" for p in pairs]
    b = [p[1] if p[1] is not None else "" for p in pairs]
    enc = tokenizer(
        a, b, truncation="longest_first", max_length=max_len, padding=False,
        return_attention_mask=False, return_token_type_ids=True,
    )
    return enc["input_ids"], enc["token_type_ids"]


def prepare_batches(tokenizer, pairs, max_len: int, batch_size: int, pad_to_multiple: int = 1):
    """Pre-tokenised, padded, length-bucketed CPU batches: list of (indices, ids, mask, types)."""
    ids, types = tokenize_pairs(tokenizer, pairs, max_len)
    out = []
    for idx in length_buckets([len(x) for x in ids], batch_size):
        out.append((idx, *pad_batch(ids, idx, tokenizer.pad_token_id or 0, pad_to_multiple, types=types)))
    return out


class ContinuityClassifier:
    """A loaded continuity model. Use :meth:`load`; then :meth:`predict_same_proba`."""

    def __init__(self, net: ContinuityNet, tokenizer, config: dict, device: torch.device,
                 version: str, rule: DecisionRule, precision: str | None = None):
        self.net = net
        self.tokenizer = tokenizer
        self.config = config
        self.device = device
        self.version = version
        self.rule = rule  # how P(same) becomes boundaries: the artifact's dev-chosen decision rule
        self.threshold = float(rule.threshold)
        self.max_len = int(net.cfg.max_len)
        self.precision = classifier_precision(precision)
        self.use_bf16 = device.type == "cuda" and self.precision == "bf16"
        self.pad_to_multiple = 8 if device.type == "cuda" else 1
        self._encoder = None  # the base sentence encoder (:meth:`sentence_encoder`)
        if rule.needs_similarity:
            # Loaded here, not at the first pair_cosine: a rule that needs it needs it for every
            # history, and a missing or broken encoder should fail the load, not a run midway.
            self.sentence_encoder()

    # ------------------------------------------------------------------------------------
    @classmethod
    def load(cls, artifact_dir: str | os.PathLike | None = None,
             device: str | torch.device | None = None, verify_base: bool = True,
             verify_version: bool = True, precision: str | None = None) -> "ContinuityClassifier":
        """``verify_version=False``: accept a stored version that no longer matches the config's rule
        (only for the tool that rewrites it, :mod:`.tune_decoding`); the version is then the derived one."""
        from safetensors.torch import load_file

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        adir = Path(artifact_dir) if artifact_dir is not None else DEFAULT_ARTIFACT_DIR
        cfg_path = adir / CONFIG_FILE
        if not cfg_path.is_file():
            raise FileNotFoundError(f"no continuity artifact at {adir} (missing {CONFIG_FILE})")
        config = json.loads(cfg_path.read_text())
        if verify_base:
            want = config.get("base_model_sha256")
            got = base_weights_sha256()
            if want and want != got:
                raise ValueError(
                    f"base model weights at {base_model_dir()} have sha256 {got[:12]}…, but the "
                    f"artifact was trained on {want[:12]}…; retrain or install the matching base"
                )
        mcfg = ModelConfig.from_json(config["model"])
        net = ContinuityNet(mcfg)
        net.load_trainable_state(load_file(str(adir / ADAPTER_FILE)))
        net.merge()
        net.eval()
        dev = resolve_device(device)
        net.to(dev)
        version = version_of_config(config if verify_version else {k: v for k, v in config.items() if k != "version"})
        precision = classifier_precision(precision)  # once: the argument, else QUMEM_CLASSIFIER_PRECISION
        return cls(net, load_tokenizer(), config, dev, version_with_precision(version, precision),
                   DecisionRule.from_config(config), precision)

    # ------------------------------------------------------------------------------------
    def prepare(self, pairs: Sequence[tuple[str, str]], batch_size: int):
        return prepare_batches(self.tokenizer, pairs, self.max_len, batch_size, self.pad_to_multiple)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        nb = self.device.type == "cuda"
        ids = ids.to(self.device, non_blocking=nb)
        mask = mask.to(self.device, non_blocking=nb)
        types = types.to(self.device, non_blocking=nb)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=self.use_bf16):
            return self.net(ids, mask, types)

    @torch.inference_mode()
    def predict_same_proba(self, pairs: Sequence[tuple[str, str]], batch_size: int = 64,
                           progress: ProgressFn | None = None) -> np.ndarray:
        """P(same event) per (previous, next) pair, float32, in input order."""
        n = len(pairs)
        out = np.empty(n, dtype=np.float32)
        if n == 0:
            return out
        done = 0
        for idx, ids, mask, types in self.prepare(pairs, batch_size):
            logits = self._forward(ids, mask, types)
            out[idx] = torch.sigmoid(logits.float()).cpu().numpy()
            done += len(idx)
            if progress is not None:
                progress(done, n)
        return out

    def sentence_encoder(self):
        """The base all-MiniLM-L6-v2 sentence encoder (the shared embedder, also the index stage's), on this
        classifier's device."""
        if self._encoder is None:
            from qumem_pipeline.embedding.minilm import Embedder

            self._encoder = Embedder.load(device=self.device, path=base_model_dir())
        return self._encoder

    def pair_cosine(self, pairs: Sequence[tuple[str, str]], batch_size: int = 32) -> np.ndarray:
        """Cosine of the base MiniLM embeddings per (previous, next) pair, float32, input order.

        ``batch_size`` 32, not the index stage's 128: chat turns vary in length and a batch pads to
        its longest (``bench/episodes_similarity.py`` measures what the cosine adds to the stage)."""
        enc = self.sentence_encoder()
        return pair_cosine(pairs, lambda texts: enc.encode(texts, batch_size=batch_size))

    def history_embeddings(self, histories: Sequence[Sequence[str]], batch_size: int = 32) -> list[np.ndarray]:
        """Base-MiniLM unit-norm embeddings per utterance of each history (distinct texts encoded once):
        what a decision rule with block features reads (:meth:`DecisionRule.boundaries` ``embeddings=``)."""
        enc = self.sentence_encoder()
        return history_embeddings(histories, lambda texts: enc.encode(texts, batch_size=batch_size))

    def history_signals(self, histories: Sequence[Sequence[str]], batch_size: int = 64, *,
                        cosine: bool | None = None, embeddings: bool | None = None):
        """Per history (its utterances in order): (P(same) per gap, cosine per gap or None, utterance
        embeddings or None), computed as the episodes stage does: each history in calls of its own, so
        its signals do not depend on the other histories (:func:`~qumem_pipeline.episodes.segmentation.build_episodes_for_users`).
        ``cosine`` / ``embeddings``: whether to compute them (None: as this classifier's rule needs);
        with embeddings the cosine comes from them."""
        embeddings = self.rule.needs_embeddings if embeddings is None else embeddings
        cosine = self.rule.needs_similarity if cosine is None else cosine
        embed = self.history_embeddings if embeddings else None
        sim = self.pair_cosine if cosine and not embeddings else None
        return [history_signals_of(h, lambda pairs: self.predict_same_proba(pairs, batch_size),
                                   embed_histories=embed, similarity=sim) for h in histories]

    def predict_boundaries(self, pairs: Sequence[tuple[str, str]], batch_size: int = 64) -> np.ndarray:
        """1 where a new event starts, for ``pairs`` = the consecutive pairs of ONE history (the
        decision rule may look at neighbouring gaps)."""
        history = [pairs[0][0], *(b for _, b in pairs)] if pairs else []
        (p, c, e), = self.history_signals([history], batch_size)
        return self.rule.boundaries(p, c, e)

    @torch.inference_mode()
    def raw_forward(self, batches) -> None:
        """Forward only (for benchmarks): same model, same pre-tokenised padded batches."""
        for _, ids, mask, types in batches:
            self._forward(ids, mask, types)
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def load_classifier(artifact_dir=None, device=None) -> ContinuityClassifier:
    return ContinuityClassifier.load(artifact_dir, device)
