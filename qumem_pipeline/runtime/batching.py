"""Length-bucketed padding for the small encoders (continuity classifier, MiniLM embedder).

One implementation so the product's inference, the benchmarks' raw-forward baselines and the
segmentation baselines pad the same way: sorting by token length keeps padding (wasted compute)
small, and the stable sort keeps results deterministic.
"""

from collections.abc import Sequence

import numpy as np
import torch


def length_buckets(lengths: Sequence[int], batch_size: int) -> list[np.ndarray]:
    """Indices sorted by length (stable), cut into consecutive batches of ``batch_size``."""
    order = np.argsort(np.asarray(lengths, dtype=np.int64), kind="stable")
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def pad_batch(ids: Sequence[Sequence[int]], idx: np.ndarray, pad_id: int, pad_to_multiple: int = 1,
              types: Sequence[Sequence[int]] | None = None) -> tuple[torch.Tensor, ...]:
    """(input_ids, attention_mask[, token_type_ids]) for the rows ``idx`` of ``ids``, right-padded."""
    L = max(len(ids[i]) for i in idx)
    if pad_to_multiple > 1:
        L = -(-L // pad_to_multiple) * pad_to_multiple
    n = len(idx)
    input_ids = np.full((n, L), pad_id, dtype=np.int64)
    mask = np.zeros((n, L), dtype=np.int64)
    token_type = np.zeros((n, L), dtype=np.int64) if types is not None else None
    for r, i in enumerate(idx):
        s = ids[i]
        input_ids[r, : len(s)] = s
        mask[r, : len(s)] = 1
        if token_type is not None:
            token_type[r, : len(s)] = types[i]
    out = (torch.from_numpy(input_ids), torch.from_numpy(mask))
    return out + (torch.from_numpy(token_type),) if token_type is not None else out
