"""Per-gap features for the learned decision rule (:class:`~.decoding.LearnedScore`), numpy only.

A gap ``i`` joins utterances ``i`` and ``i + 1`` of one history. Every feature is computed from the
two sequences the episodes stage already has for a history — the classifier's P(same) ``p`` and the
base-MiniLM adjacent cosine ``c`` (:mod:`.similarity`) — so a learned rule costs the stage nothing
beyond the similarity dips' rule. Names are plain strings stored in the artifact's ``decision``
block; a name this code does not know is an error at load, never silently zero.

Names (``k``: a window, gaps on each side):

- ``lp``: logit of P(same) (clipped to [1e-4, 1 - 1e-4]);
- ``c``: the adjacent cosine;
- ``lp_rel<k>`` / ``c_rel<k>``: the value minus the mean of the up to ``k`` gaps on each side
  (:func:`~.decoding.neighbour_mean`; 0 for a gap without neighbours) — the relative dip, which
  adapts to how similar a domain's adjacent turns are at all;
- ``lp_depth<k>`` / ``c_depth<k>``: TextTiling's depth score — how far the value lies below the
  highest of the ``k`` gaps on its left, plus below the highest on its right (a side without gaps
  adds 0; negative where the value stands above a side);
- ``lp_lmin`` / ``c_lmin``: 1 where the value is a strict local minimum (edges: one neighbour);
- ``edge``: 1 for the first and the last gap (their relative features see one side only).

Also here: the weighted L2 logistic regression that fits the scores (:func:`fit_logistic`; Newton
steps, no dependency beyond numpy), used by :mod:`.tune_decoding` ``--learned``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

_WINDOWED = re.compile(r"^(lp|c)_(rel|depth)([1-9][0-9]?)$")
_PLAIN = ("lp", "c", "lp_lmin", "c_lmin", "edge")


def logit(p: Sequence[float]) -> np.ndarray:
    q = np.clip(np.asarray(p, dtype=np.float64), 1e-4, 1 - 1e-4)
    return np.log(q / (1 - q))


def neighbour_mean(x: np.ndarray, window: int) -> np.ndarray:
    """Mean of the up to ``window`` values on each side (itself excluded); no neighbours: its own value."""
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    c = np.concatenate([[0.0], np.cumsum(x)])
    i = np.arange(n)
    lo, hi = np.maximum(0, i - window), np.minimum(n, i + window + 1)
    cnt = (hi - lo - 1).astype(np.float64)
    tot = c[hi] - c[lo] - x
    return np.where(cnt > 0, tot / np.maximum(cnt, 1.0), x)


def strict_local_min(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if not len(x):
        return np.zeros(0)
    left = np.concatenate([[np.inf], x[:-1]])
    right = np.concatenate([x[1:], [np.inf]])
    return ((x < left) & (x < right)).astype(np.float64)


def depth(x: np.ndarray, window: int) -> np.ndarray:
    """Highest of the ``window`` values on the left minus x, plus the same on the right (0 for a missing side)."""
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    out = np.zeros(n)
    for i in range(n):
        left = x[max(0, i - window) : i]
        right = x[i + 1 : i + 1 + window]
        out[i] = (left.max() - x[i] if len(left) else 0.0) + (right.max() - x[i] if len(right) else 0.0)
    return out


def check_feature_names(names: Sequence[str]) -> None:
    for name in names:
        if name not in _PLAIN and not _WINDOWED.match(name):
            raise ValueError(f"learned decision rule: unknown feature {name!r} (known: {', '.join(_PLAIN)}, "
                             "lp_rel<k>, c_rel<k>, lp_depth<k>, c_depth<k>)")
    if len(set(names)) != len(names):
        raise ValueError(f"learned decision rule: repeated feature names in {list(names)}")


def feature_matrix(names: Sequence[str], p_same: Sequence[float], cosine: Sequence[float]) -> np.ndarray:
    """(n_gaps, len(names)) float64: the named features of one history's gaps."""
    check_feature_names(names)
    base = {"lp": logit(p_same), "c": np.asarray(cosine, dtype=np.float64)}
    n = len(base["lp"])
    if len(base["c"]) != n:
        raise ValueError(f"learned decision rule: {len(base['c'])} cosines for {n} P(same) values")
    cols = []
    for name in names:
        if name in ("lp", "c"):
            cols.append(base[name])
        elif name.endswith("_lmin"):
            cols.append(strict_local_min(base[name[: -len("_lmin")]]))
        elif name == "edge":
            idx = np.arange(n)
            cols.append(((idx == 0) | (idx == n - 1)).astype(np.float64))
        else:
            sig, kind, k = _WINDOWED.match(name).groups()
            x = base[sig]
            cols.append(x - neighbour_mean(x, int(k)) if kind == "rel" else depth(x, int(k)))
    return np.column_stack(cols) if cols else np.zeros((n, 0))


def fit_logistic(X: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None, l2: float = 1.0,
                 max_iter: int = 100) -> tuple[np.ndarray, float]:
    """Weighted L2-regularised logistic regression (intercept not penalised), on standardised
    columns; returns (coefficients, intercept) on the ORIGINAL scale. Deterministic (Newton steps)."""
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n, m = X.shape
    w = np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64)
    mu = X.mean(0) if n else np.zeros(m)
    sd = X.std(0) if n else np.ones(m)
    sd = np.where(sd > 1e-9, sd, 1.0)
    Z = np.column_stack([(X - mu) / sd, np.ones(n)])
    beta = np.zeros(m + 1)
    reg = l2 * np.eye(m + 1)
    reg[-1, -1] = 0.0
    for _ in range(max_iter):
        pr = 1.0 / (1.0 + np.exp(-(Z @ beta)))
        grad = Z.T @ (w * (pr - y)) + reg @ beta
        hess = (Z * (w * pr * (1 - pr))[:, None]).T @ Z + reg + 1e-10 * np.eye(m + 1)
        step = np.linalg.solve(hess, grad)
        beta -= step
        if np.abs(step).max() < 1e-9:
            break
    coef = beta[:-1] / sd
    return coef, float(beta[-1] - mu @ coef)


def block_cosine(emb: np.ndarray, window: int) -> np.ndarray:
    """Per gap of a history with unit-norm utterance embeddings ``emb`` (n, d): the cosine of the mean
    embedding of the up to ``window`` utterances before the gap with the mean of the up to
    ``window`` after it (TextTiling's block comparison). Not yet a rule feature: the episodes stage
    passes the rule per-gap signals only, and this needs each history's utterance embeddings
    (``bench/segmentation_learned_features.py`` measures what it would add)."""
    e = np.asarray(emb, dtype=np.float64)
    n = len(e) - 1
    out = np.zeros(max(n, 0))
    for i in range(max(n, 0)):
        a = e[max(0, i - window + 1) : i + 1].mean(0)
        b = e[i + 1 : i + 1 + window].mean(0)
        out[i] = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-9))
    return out
