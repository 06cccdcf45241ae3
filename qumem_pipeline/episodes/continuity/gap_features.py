"""Per-gap features for the learned decision rule (:class:`~.decoding.LearnedScore`), numpy only.

A gap ``i`` joins utterances ``i`` and ``i + 1`` of one history. Every feature is computed from what the
episodes stage has for a history — the classifier's P(same) ``p``, and the base-MiniLM embeddings of its
utterances (:mod:`.similarity`), which give the adjacent cosine ``c`` and the block cosines — so a learned
rule costs the stage one sentence-encoder pass over the user texts, as the similarity dips did. Names are plain strings stored in the artifact's ``decision``
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
- ``edge``: 1 for the first and the last gap (their relative features see one side only);
- ``b<k>``: block similarity — the cosine of the mean embedding of the up to ``k`` utterances
  before the gap with that of the up to ``k`` after it (:func:`block_cosine`; TextTiling's block
  comparison on MiniLM embeddings). It takes the history's unit-norm utterance embeddings
  (``emb``), and ``b<k>_rel<w>`` / ``b<k>_depth<w>`` / ``b<k>_lmin`` are its relative dip, depth
  and local minimum as above. Why: a join between two unrelated dialogues shows as a drop of
  *block* similarity even where the two utterances at the gap look alike (measured:
  ``bench/segmentation_learned_features.py``);
- ``z<w>:<feature>``: any feature above standardised over the ``w`` gaps on each side of the gap
  (itself included; a flat window divides by 1). Why local: it adapts the scale to a history's
  own domain (how alike its adjacent turns are at all) while a history that grows at its end
  changes no decision more than ``w`` + the widest window gaps back, so a nightly rebuild does not
  reshuffle a long user's old episodes.

Also here: the weighted L2 logistic regression that fits the scores (:func:`fit_logistic`; Newton
steps, no dependency beyond numpy), used by :mod:`.tune_decoding` ``--learned``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

_SIGNAL = r"(?:lp|c|b[1-9])"
_WINDOWED = re.compile(rf"^({_SIGNAL})_(rel|depth)([1-9][0-9]?)$")
_PLAIN = re.compile(rf"^(?:{_SIGNAL}|{_SIGNAL}_lmin|edge)$")
_ZSCORED = re.compile(r"^z([1-9][0-9]{0,2}):(.+)$")


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
    left = np.full(n, -np.inf)
    right = np.full(n, -np.inf)
    for k in range(1, min(window, n - 1) + 1):  # shifted copies: O(n * window), no per-gap loop
        left[k:] = np.maximum(left[k:], x[:-k])
        right[:-k] = np.maximum(right[:-k], x[k:])
    return np.where(np.isfinite(left), left - x, 0.0) + np.where(np.isfinite(right), right - x, 0.0)


def _base_name(name: str) -> str:
    m = _ZSCORED.match(name)
    return m.group(2) if m else name


def check_feature_names(names: Sequence[str]) -> None:
    for name in names:
        base = _base_name(name)
        if not (_PLAIN.match(base) or _WINDOWED.match(base)) or _ZSCORED.match(base):
            raise ValueError(f"learned decision rule: unknown feature {name!r} (known: lp, c, b<k>, each plain, "
                             "_lmin, _rel<w> or _depth<w>; edge; any of them as z<w>:<feature>)")
    if len(set(names)) != len(names):
        raise ValueError(f"learned decision rule: repeated feature names in {list(names)}")


def uses_embeddings(names: Sequence[str]) -> bool:
    """Whether any feature is a block similarity (needs the history's utterance embeddings)."""
    return any(_base_name(n).startswith("b") for n in names)


def uses_cosine(names: Sequence[str]) -> bool:
    return any(_base_name(n) == "c" or _base_name(n).startswith("c_") for n in names)


def local_zscore(x: np.ndarray, window: int) -> np.ndarray:
    """(x - mean) / std over the up to ``window`` values on each side and x itself (std 0: divide by 1)."""
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    if not n:
        return x
    c1 = np.concatenate([[0.0], np.cumsum(x)])
    c2 = np.concatenate([[0.0], np.cumsum(x * x)])
    i = np.arange(n)
    lo, hi = np.maximum(0, i - window), np.minimum(n, i + window + 1)
    cnt = hi - lo
    mu = (c1[hi] - c1[lo]) / cnt
    sd = np.sqrt(np.maximum((c2[hi] - c2[lo]) / cnt - mu * mu, 0.0))
    return (x - mu) / np.where(sd > 1e-9, sd, 1.0)


def feature_matrix(names: Sequence[str], p_same: Sequence[float], cosine: Sequence[float],
                   embeddings: np.ndarray | None = None) -> np.ndarray:
    """(n_gaps, len(names)) float64: the named features of one history's gaps. ``embeddings``: the
    history's unit-norm utterance embeddings (n_gaps + 1 rows), needed by block features only."""
    check_feature_names(names)
    base = {"lp": logit(p_same), "c": np.asarray(cosine, dtype=np.float64)}
    n = len(base["lp"])
    if len(base["c"]) != n:
        raise ValueError(f"learned decision rule: {len(base['c'])} cosines for {n} P(same) values")
    if uses_embeddings(names):
        if embeddings is None:
            raise ValueError("learned decision rule: block features need the history's utterance embeddings")
        if n and len(embeddings) != n + 1:
            raise ValueError(f"learned decision rule: {len(embeddings)} utterance embeddings for {n} gaps")

    def signal(sig: str) -> np.ndarray:
        if sig not in base:  # b<k>, computed once per history
            base[sig] = block_cosine(embeddings, int(sig[1:])) if n else np.zeros(0)
        return base[sig]

    def column(name: str) -> np.ndarray:
        z = _ZSCORED.match(name)
        if z:
            return local_zscore(column(z.group(2)), int(z.group(1)))
        if name == "edge":
            idx = np.arange(n)
            return ((idx == 0) | (idx == n - 1)).astype(np.float64)
        if name.endswith("_lmin"):
            return strict_local_min(signal(name[: -len("_lmin")]))
        w = _WINDOWED.match(name)
        if w:
            sig, kind, k = w.groups()
            x = signal(sig)
            return x - neighbour_mean(x, int(k)) if kind == "rel" else depth(x, int(k))
        return signal(name)

    cols = [column(name) for name in names]
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
    ``window`` after it (TextTiling's block comparison): the learned rule's ``b<k>`` features."""
    e = np.asarray(emb, dtype=np.float64)
    n = len(e) - 1
    if n <= 0:
        return np.zeros(0)
    pre = np.vstack([np.zeros((1, e.shape[1])), np.cumsum(e, axis=0)])  # the cosine of means is that of sums
    i = np.arange(n)
    a = pre[i + 1] - pre[np.maximum(0, i - window + 1)]
    b = pre[np.minimum(n + 1, i + 1 + window)] - pre[i + 1]
    return np.einsum("ij,ij->i", a, b) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-9)
