"""LoRA adapters for the continuity network's ``nn.Linear`` layers, by ``peft``.

``y = x W^T + b + scale * (dropout(x) A^T) B^T`` with ``A`` (r x in) Kaiming-initialised and ``B``
(out x r) zero-initialised, ``scale = alpha / r``. :func:`merge_lora` folds ``scale * B @ A`` into
``W`` and puts the plain ``nn.Linear`` back, so that inference costs exactly a plain forward of the
base model.

peft replaced a hand-written ``LoRALinear`` (kept verbatim as the test oracle, tests/lora_reference.py)
because it reproduces the shipped artifact exactly: the committed ``adapters.safetensors`` loads
unchanged (its keys ``...query.lora_A`` map to peft's ``...query.lora_A.default.weight``) and gives
the same P(same) on 200 TIAGE test pairs (max abs diff 0.0, merged and unmerged; no decision changes
at the threshold). Speed is the same: merged, both are a plain BertModel forward (peft/hand-written
pairs/s 1.17x and 0.98x in two runs on a loaded 2-core machine, i.e. noise); unmerged, the training
path, 1.04x and 0.91x. ``python bench/lora_peft.py --pairs 200 --repeats 5 --json``. Importing peft
costs ~0.3 s CPU on top of transformers at classifier load.
Two things are kept from the hand-written code on purpose:

- targets match the layer-local suffix (``_target_pattern``), so "output.dense" never also adapts
  "attention.output.dense" (peft's plain suffix match would);
- the initial adapters are drawn exactly as before (same RNG draws, same order), so a seeded
  retraining starts from the same point as the one that produced the committed artifact: peft's own
  layer constructors draw extra random numbers.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

# BertModel linear-layer suffixes that may carry adapters
TARGETS_ALL = (
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "intermediate.dense",
    "output.dense",
)
ADAPTER = "default"  # peft's adapter name; one adapter per model


def _target_pattern(targets: tuple[str, ...]) -> str:
    """A full-match regex on module names: ``...layer.<n>.<target>`` and nothing else."""
    return r".*\.layer\.\d+\.(" + "|".join(re.escape(t) for t in targets) + r")"


def _lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def inject_lora(
    model: nn.Module, targets: tuple[str, ...], r: int, alpha: float, dropout: float = 0.0
) -> list[str]:
    """Adapt the targeted ``nn.Linear`` modules in place; returns the adapted module names.

    Only the adapters are left trainable (peft freezes the rest of ``model``).
    """
    from peft import LoraConfig, inject_adapter_in_model

    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=_target_pattern(targets),
                     bias="none")
    rng = torch.get_rng_state()
    try:
        inject_adapter_in_model(cfg, model, adapter_name=ADAPTER)
    except ValueError as e:
        raise ValueError(f"no linear layer matched LoRA targets {targets}") from e
    torch.set_rng_state(rng)  # draw the initial adapters as the hand-written code did, in module order
    layers = _lora_layers(model)
    with torch.no_grad():
        for _, m in layers:
            nn.init.kaiming_uniform_(m.lora_A[ADAPTER].weight, a=math.sqrt(5))
            nn.init.zeros_(m.lora_B[ADAPTER].weight)
    if not layers:
        raise ValueError(f"no linear layer matched LoRA targets {targets}")
    return [n for n, _ in layers]


def artifact_key(peft_name: str) -> str:
    """peft's parameter name (``...query.lora_A.default.weight``) as the artifact stores it (``...query.lora_A``)."""
    return re.sub(rf"\.(lora_[AB])\.{ADAPTER}\.weight$", r".\1", peft_name)


def peft_key(key: str) -> str:
    """The artifact's adapter key (``...query.lora_A``) as peft names the parameter."""
    return f"{key}.{ADAPTER}.weight" if key.endswith((".lora_A", ".lora_B")) else key


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters under the artifact's key names."""
    return {
        artifact_key(n): p.detach().cpu().clone()
        for n, p in model.named_parameters()
        if re.search(rf"\.lora_[AB]\.{ADAPTER}\.weight$", n)
    }


def merge_lora(model: nn.Module) -> int:
    """Fold every LoRA layer into its base weight and put the plain Linear back."""
    layers = _lora_layers(model)
    for name, layer in layers:
        parent_name, _, child = name.rpartition(".")
        layer.merge()
        setattr(model.get_submodule(parent_name), child, layer.get_base_layer())
    return len(layers)
