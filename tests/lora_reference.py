"""The hand-written LoRA adapters that ``continuity/lora.py`` used before peft, kept verbatim as the test
oracle (tests/test_continuity_peft.py) and the baseline of bench/lora_peft.py; the committed artifact
was trained with them.

Hand-written LoRA adapters for ``nn.Linear`` layers (no peft dependency).

``y = x W^T + b + scale * (dropout(x) A^T) B^T`` with ``A`` (r x in) Kaiming-initialised and ``B``
(out x r) zero-initialised, ``scale = alpha / r``. :func:`merge_lora` folds ``scale * B @ A`` into
``W`` and swaps the wrapper back for the plain ``nn.Linear``, so that inference costs exactly a plain
forward of the base model.
"""

from __future__ import annotations

import math

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


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base = base
        self.r = r
        self.scale = alpha / r
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (self.drop(x) @ self.lora_A.t() @ self.lora_B.t()) * self.scale

    def merged_linear(self) -> nn.Linear:
        lin = self.base
        with torch.no_grad():
            delta = (self.lora_B.float() @ self.lora_A.float()) * self.scale
            lin.weight.add_(delta.to(lin.weight.dtype))
        return lin


def _matches(name: str, targets: tuple[str, ...]) -> bool:
    # "output.dense" must not match "attention.output.dense": compare on the layer-local suffix
    parts = name.split(".")
    if "layer" not in parts:
        return False
    i = parts.index("layer")
    local = ".".join(parts[i + 2 :])  # strip "layer.<n>."
    return local in targets


def inject_lora(
    model: nn.Module, targets: tuple[str, ...], r: int, alpha: float, dropout: float = 0.0
) -> list[str]:
    """Replace the targeted ``nn.Linear`` modules in place; returns the replaced module names."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and _matches(n, targets)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoRALinear(getattr(parent, child), r, alpha, dropout))
    if not names:
        raise ValueError(f"no linear layer matched LoRA targets {targets}")
    return names


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().cpu().clone()
        for n, p in model.named_parameters()
        if n.endswith(".lora_A") or n.endswith(".lora_B")
    }


def merge_lora(model: nn.Module) -> int:
    """Fold every LoRALinear into its base weight and replace it by the plain Linear."""
    names = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, getattr(parent, child).merged_linear())
    return len(names)
