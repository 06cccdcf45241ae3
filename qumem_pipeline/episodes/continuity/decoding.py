"""The boundary decision rule: P(same) sequence of one history -> boundary per gap.

One rule object, stored in the artifact's ``config.json`` under ``"decision"``, is what both the
episodes stage and ``qumem eval segmentation`` apply, so the artifact stays the single source of how
probabilities become boundaries. Its parameters are chosen on TIAGE dev only (:mod:`.tune_decoding`).

The rule, applied to the P(same) sequence ``p`` of one history (``p[i]`` joins utterances i, i+1):

1. smoothing: ``q[i] = (1 - w) * p[i] + w * mean(p[i-1], p[i+1])`` (the neighbours that exist);
   ``w = 0`` leaves ``p`` as is;
2. candidates: gap ``i`` is a boundary when ``q[i] < threshold``, or, with a ``peak_threshold``,
   when ``q[i] < peak_threshold`` and ``q[i]`` is a strict local minimum (a dip below both neighbours:
   a weaker link that still stands out locally);
3. minimum segment length: with ``min_segment = m > 1`` candidates are kept strongest (lowest q)
   first, dropping any closer than ``m`` gaps to a kept one, so no segment between two boundaries is
   shorter than ``m`` utterances. ``m = 1`` keeps every candidate.

With the defaults (``w = 0``, no peak threshold, ``m = 1``) it is the plain rule "boundary when
P(same) < threshold".
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

RULE_NAME = "smooth-threshold-peaks-v1"


@dataclass(frozen=True)
class DecisionRule:
    threshold: float
    peak_threshold: float | None = None
    smoothing: float = 0.0
    min_segment: int = 1

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"decision rule: threshold {self.threshold} outside [0, 1]")
        if self.peak_threshold is not None and not self.threshold <= self.peak_threshold <= 1.0:
            raise ValueError(f"decision rule: peak_threshold {self.peak_threshold} must lie in [threshold, 1]")
        if not 0.0 <= self.smoothing < 1.0:
            raise ValueError(f"decision rule: smoothing {self.smoothing} outside [0, 1)")
        if int(self.min_segment) != self.min_segment or self.min_segment < 1:
            raise ValueError(f"decision rule: min_segment {self.min_segment} must be an integer >= 1")

    @property
    def is_plain_threshold(self) -> bool:
        return self.peak_threshold is None and self.smoothing == 0.0 and self.min_segment == 1

    def smoothed(self, p_same: Sequence[float]) -> np.ndarray:
        p = np.asarray(p_same, dtype=np.float64)
        if self.smoothing == 0.0 or len(p) < 2:
            return p
        nb_sum = np.zeros_like(p)
        nb_cnt = np.zeros_like(p)
        nb_sum[1:] += p[:-1]
        nb_cnt[1:] += 1
        nb_sum[:-1] += p[1:]
        nb_cnt[:-1] += 1
        return (1.0 - self.smoothing) * p + self.smoothing * nb_sum / nb_cnt

    def boundaries(self, p_same: Sequence[float]) -> np.ndarray:
        """0/1 per gap (int8): 1 where a new segment starts after that gap."""
        q = self.smoothed(p_same)
        n = len(q)
        cand = q < self.threshold
        if self.peak_threshold is not None and n:
            left = np.concatenate([[np.inf], q[:-1]])
            right = np.concatenate([q[1:], [np.inf]])
            cand |= (q < self.peak_threshold) & (q < left) & (q < right)
        if self.min_segment > 1:
            kept = np.zeros(n, dtype=bool)
            for i in np.argsort(q, kind="stable"):
                if not cand[i]:
                    continue
                lo, hi = max(0, i - self.min_segment + 1), min(n, i + self.min_segment)
                if not kept[lo:hi].any():
                    kept[i] = True
            cand = kept
        return cand.astype(np.int8)

    def describe(self) -> str:
        parts = [f"P(same){' smoothed w=%g' % self.smoothing if self.smoothing else ''} < {self.threshold:g}"]
        if self.peak_threshold is not None:
            parts.append(f"or a strict local minimum < {self.peak_threshold:g}")
        if self.min_segment > 1:
            parts.append(f"min segment {self.min_segment}")
        return "boundary when " + ", ".join(parts)

    def to_json(self) -> dict:
        return {"rule": RULE_NAME, **asdict(self)}

    @classmethod
    def from_json(cls, d: dict) -> "DecisionRule":
        if d.get("rule", RULE_NAME) != RULE_NAME:
            raise ValueError(f"unknown decision rule {d.get('rule')!r}; this code applies {RULE_NAME!r}")
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known - {"rule", "chosen_on", "selection"}
        if unknown:
            raise ValueError(f"decision rule: unknown field(s) {sorted(unknown)}")
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_config(cls, config: dict) -> "DecisionRule":
        """The artifact's rule: its ``decision`` block, else (v1 artifacts) the plain threshold."""
        if "decision" in config:
            return cls.from_json(config["decision"])
        return cls(threshold=float(config["threshold"]))

    def fingerprint(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)


def as_rule(rule_or_threshold: "DecisionRule | float") -> DecisionRule:
    """Accept a bare threshold where a rule is expected (the plain rule)."""
    if isinstance(rule_or_threshold, DecisionRule):
        return rule_or_threshold
    return DecisionRule(threshold=float(rule_or_threshold))


def rule_of(classifier) -> DecisionRule:
    """A classifier's decision rule; an object with only a ``threshold`` gets the plain rule."""
    rule = getattr(classifier, "rule", None)
    return rule if rule is not None else as_rule(classifier.threshold)
