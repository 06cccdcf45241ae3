"""The continuity network: MiniLM cross-encoder ``[CLS] a [SEP] b [SEP]`` + a small head.

Output: one logit of P(same event | a, b). Trainable parts: LoRA adapters (peft, see :mod:`.lora`), the
token-type embedding table (2 x 384; the base model was trained on single sentences only) and the
head. Everything else stays frozen at the shipped base weights.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from qumem_pipeline.embedding.base_model import load_base_model
from qumem_pipeline.episodes.continuity.lora import TARGETS_ALL, inject_lora, lora_state_dict, merge_lora, peft_key


@dataclass
class ModelConfig:
    max_len: int = 128
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = field(default_factory=lambda: TARGETS_ALL)
    pooling: str = "cls"  # "cls" | "mean" | "cls_mean" (concat [CLS, mean]) | "seg_pair" (see forward)
    head_hidden: int = 0  # 0: a single Linear(384, 1)
    head_dropout: float = 0.1
    train_token_type: bool = True

    def to_json(self) -> dict:
        d = asdict(self)
        d["lora_targets"] = list(self.lora_targets)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        d["lora_targets"] = tuple(d.get("lora_targets", TARGETS_ALL))
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


def seg_pair_features(hidden: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
    """[CLS, a * b, |a - b|] with a / b the mean token states of each utterance (SBERT-style).

    Why: all-MiniLM-L6-v2 was pre-trained so that mean-pooled states compare by similarity; giving
    the head each utterance's mean explicitly lets it use that similarity signal (which adds to the
    plain [CLS] classifier on TIAGE dev) inside the same single forward per pair.
    """
    m = attention_mask.unsqueeze(-1).to(hidden.dtype)
    tb = (token_type_ids.unsqueeze(-1) == 1).to(hidden.dtype) * m
    ta = m - tb
    a = (hidden * ta).sum(1) / ta.sum(1).clamp_min(1.0)
    b = (hidden * tb).sum(1) / tb.sum(1).clamp_min(1.0)
    return torch.cat([hidden[:, 0], a * b, (a - b).abs()], dim=-1)


class ContinuityNet(nn.Module):
    def __init__(self, cfg: ModelConfig, bert: nn.Module | None = None, with_lora: bool = True):
        super().__init__()
        self.cfg = cfg
        self.bert = bert if bert is not None else load_base_model()
        for p in self.bert.parameters():
            p.requires_grad_(False)
        if with_lora:
            inject_lora(self.bert, cfg.lora_targets, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout)
        if cfg.train_token_type:
            self.bert.embeddings.token_type_embeddings.weight.requires_grad_(True)
        hid = self.bert.config.hidden_size * {"cls_mean": 2, "seg_pair": 3}.get(cfg.pooling, 1)
        if cfg.head_hidden > 0:
            self.head = nn.Sequential(
                nn.Dropout(cfg.head_dropout),
                nn.Linear(hid, cfg.head_hidden),
                nn.Tanh(),
                nn.Dropout(cfg.head_dropout),
                nn.Linear(cfg.head_hidden, 1),
            )
        else:
            self.head = nn.Sequential(nn.Dropout(cfg.head_dropout), nn.Linear(hid, 1))

    def forward(self, input_ids, attention_mask, token_type_ids) -> torch.Tensor:
        out = self.bert(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state
        if self.cfg.pooling == "seg_pair":
            pooled = seg_pair_features(out, attention_mask, token_type_ids)
        elif self.cfg.pooling in ("mean", "cls_mean"):
            m = attention_mask.unsqueeze(-1).to(out.dtype)
            pooled = (out * m).sum(1) / m.sum(1).clamp_min(1.0)
            if self.cfg.pooling == "cls_mean":
                pooled = torch.cat([out[:, 0], pooled], dim=-1)
        else:
            pooled = out[:, 0]
        return self.head(pooled).squeeze(-1).float()

    # ---- artifact state -------------------------------------------------------------------
    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Exactly what the artifact stores: LoRA A/B, token-type table, head."""
        sd = {f"bert.{k}": v for k, v in lora_state_dict(self.bert).items()}
        if self.cfg.train_token_type:
            sd["bert.embeddings.token_type_embeddings.weight"] = (
                self.bert.embeddings.token_type_embeddings.weight.detach().cpu().clone()
            )
        for k, v in self.head.state_dict().items():
            sd[f"head.{k}"] = v.detach().cpu().clone()
        return {k: v.contiguous() for k, v in sd.items()}

    def load_trainable_state(self, sd: dict[str, torch.Tensor]) -> None:
        """Load an artifact's state (adapter keys as ``...lora_A``; peft's parameter names are mapped)."""
        missing, unexpected = self.load_state_dict({peft_key(k): v for k, v in sd.items()}, strict=False)
        if unexpected:
            raise ValueError(f"unexpected keys in adapter state: {unexpected[:5]}")
        want = set(self.trainable_state())
        absent = want - set(sd)
        if absent:
            raise ValueError(f"adapter state lacks keys: {sorted(absent)[:5]}")

    def merge(self) -> int:
        return merge_lora(self.bert)
