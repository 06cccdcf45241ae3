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

4. similarity dips (optional, ``sim_threshold`` and/or ``sim_window`` set): gap ``i`` is also a
   boundary when the cosine ``c[i]`` of the base all-MiniLM-L6-v2 embeddings of utterances i, i+1
   is low — below ``sim_threshold`` (absolute), and/or more than ``sim_drop`` below the mean cosine
   of the up to ``sim_window`` gaps on each side (relative; a gap without neighbours never dips) —
   while P(same) ``p[i]`` (unsmoothed) is below ``sim_gate`` (``None``: no gate) and, with
   ``sim_local_min``, ``c[i]`` is a strict local minimum of the history's cosine sequence. These are
   added after step 3 (an OR with the classifier's own decision). The relative form adapts to how
   similar a domain's adjacent turns are at all (TIAGE's short turns: low everywhere; LoCoMo's: high).
   Why: out of domain (LoCoMo excerpts joined at known boundaries, :mod:`qumem_pipeline.episodes.
   continuity.ood_data`) the classifier gives P(same) ~0.78 at joins, against ~0.87 inside excerpts,
   while the base cosine separates them (~0.20 against ~0.44); TIAGE's short turns have low cosine
   everywhere, so an ungated cosine rule costs TIAGE — the gate and the dip keep the cosine to the
   clear cases. Its parameters are chosen on TIAGE dev (no worse than the rule without it) and the
   OOD calib half (:func:`qumem_pipeline.episodes.continuity.tune_decoding.choose_sim_dip`).

5. learned (optional, ``learned`` set; rule ``learned-logistic-v1``): steps 1-4 are replaced by a
   logistic score over named per-gap features of both sequences (:mod:`.gap_features`: the logit of
   P(same), the cosine, their relative dips over several windows, depth scores, local minima, an
   edge flag; block similarity over the history's utterance embeddings; any of them standardised
   over a local window) — coefficients, intercept and cutoff stored as plain JSON numbers. A gap is a
   boundary when its score exceeds ``cutoff`` (and, with ``local_max``, is no lower than either
   neighbour's score). Why: a fixed OR of hand-set thresholds cannot weigh the two signals against
   each other per domain; the weights are fitted, and the cutoff chosen, without TIAGE test or an eval
   half: the shipped score (block features, locally standardised) by
   :func:`qumem_pipeline.episodes.continuity.tune_learned.choose_learned_block` (fit on TIAGE train + OOD
   calib + generated calib, TIAGE dev a guard), the P(same)/cosine-only one by
   :func:`qumem_pipeline.episodes.continuity.tune_decoding.choose_learned`.
   The fields of steps 1-3 stay in the rule as the classifier's decision alone
   (:meth:`DecisionRule.without_similarity`, the reference row of the evaluation).

The artifact's ``version`` is derived from its weights version and this rule's JSON
(:func:`artifact_version`), never typed in: a rule change is a new classifier version.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np

from qumem_pipeline.episodes.continuity.gap_features import (check_feature_names, feature_matrix, uses_cosine,
                                                              uses_embeddings)
from qumem_pipeline.episodes.continuity.gap_features import neighbour_mean  # noqa: F401  (re-exported)

RULE_NAME = "smooth-threshold-peaks-v1"  # steps 1-3 only (its JSON is unchanged, so are old versions)
RULE_NAME_SIM = "smooth-threshold-peaks-simdip-v1"  # steps 1-4
RULE_NAME_LEARNED = "learned-logistic-v1"  # step 5 (steps 1-3 kept as the classifier-alone reference)
ARTIFACT_FORMAT_V2 = "continuity-minilm-lora-v2"
_SIM_FIELDS = ("sim_threshold", "sim_window", "sim_drop", "sim_gate", "sim_local_min")


@dataclass(frozen=True)
class LearnedScore:
    """Step 5: P(boundary) = sigmoid(intercept + coef . features(gap)); boundary when > cutoff."""

    features: tuple[str, ...]
    coef: tuple[float, ...]
    intercept: float
    cutoff: float
    local_max: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", tuple(str(f) for f in self.features))
        object.__setattr__(self, "coef", tuple(float(x) for x in self.coef))
        object.__setattr__(self, "intercept", float(self.intercept))
        object.__setattr__(self, "cutoff", float(self.cutoff))
        check_feature_names(self.features)
        if not self.features:
            raise ValueError("learned decision rule: no features")
        if len(self.coef) != len(self.features):
            raise ValueError(f"learned decision rule: {len(self.coef)} coefficients for {len(self.features)} features")
        if not all(np.isfinite(self.coef)) or not np.isfinite(self.intercept):
            raise ValueError("learned decision rule: coefficients and intercept must be finite numbers")
        if not 0.0 < self.cutoff < 1.0:
            raise ValueError(f"learned decision rule: cutoff {self.cutoff} outside (0, 1)")

    @property
    def uses_cosine(self) -> bool:
        return uses_cosine(self.features)

    @property
    def uses_embeddings(self) -> bool:
        return uses_embeddings(self.features)

    def score(self, p_same: Sequence[float], cosine: Sequence[float] | None,
              embeddings: np.ndarray | None = None) -> np.ndarray:
        """P(boundary) per gap (float64)."""
        p = np.asarray(p_same, dtype=np.float64)
        c = np.zeros(len(p)) if cosine is None else cosine
        if not len(p):
            return np.zeros(0)
        z = feature_matrix(self.features, p, c, embeddings) @ np.asarray(self.coef) + self.intercept
        return 1.0 / (1.0 + np.exp(-z))

    def boundaries(self, p_same: Sequence[float], cosine: Sequence[float] | None,
                   embeddings: np.ndarray | None = None) -> np.ndarray:
        s = self.score(p_same, cosine, embeddings)
        b = s > self.cutoff
        if self.local_max and len(s):
            left = np.concatenate([[-np.inf], s[:-1]])
            right = np.concatenate([s[1:], [-np.inf]])
            b &= (s >= left) & (s >= right)
        return b

    def to_json(self) -> dict:
        return {"features": list(self.features), "coef": list(self.coef), "intercept": self.intercept,
                "cutoff": self.cutoff, "local_max": self.local_max}

    @classmethod
    def from_json(cls, d: dict) -> "LearnedScore":
        if not isinstance(d, dict):
            raise ValueError("learned decision rule: 'learned' must be an object")
        unknown = set(d) - {"features", "coef", "intercept", "cutoff", "local_max"}
        if unknown:
            raise ValueError(f"learned decision rule: unknown field(s) {sorted(unknown)}")
        missing = {"features", "coef", "intercept", "cutoff"} - set(d)
        if missing:
            raise ValueError(f"learned decision rule: missing field(s) {sorted(missing)}")
        return cls(tuple(d["features"]), tuple(d["coef"]), d["intercept"], d["cutoff"], bool(d.get("local_max", False)))


@dataclass(frozen=True)
class DecisionRule:
    threshold: float
    peak_threshold: float | None = None
    smoothing: float = 0.0
    min_segment: int = 1
    sim_threshold: float | None = None
    sim_window: int | None = None
    sim_drop: float | None = None
    sim_gate: float | None = None
    sim_local_min: bool = True
    learned: LearnedScore | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"decision rule: threshold {self.threshold} outside [0, 1]")
        if self.peak_threshold is not None and not self.threshold <= self.peak_threshold <= 1.0:
            raise ValueError(f"decision rule: peak_threshold {self.peak_threshold} must lie in [threshold, 1]")
        if not 0.0 <= self.smoothing < 1.0:
            raise ValueError(f"decision rule: smoothing {self.smoothing} outside [0, 1)")
        if int(self.min_segment) != self.min_segment or self.min_segment < 1:
            raise ValueError(f"decision rule: min_segment {self.min_segment} must be an integer >= 1")
        if self.sim_threshold is not None and not -1.0 <= self.sim_threshold <= 1.0:
            raise ValueError(f"decision rule: sim_threshold {self.sim_threshold} outside [-1, 1]")
        if self.sim_gate is not None and not 0.0 <= self.sim_gate <= 1.0:
            raise ValueError(f"decision rule: sim_gate {self.sim_gate} outside [0, 1] (None: no gate)")
        if (self.sim_window is None) != (self.sim_drop is None):
            raise ValueError("decision rule: sim_window and sim_drop go together")
        if self.sim_window is not None and (int(self.sim_window) != self.sim_window or self.sim_window < 1):
            raise ValueError(f"decision rule: sim_window {self.sim_window} must be an integer >= 1")
        if self.sim_drop is not None and not 0.0 <= self.sim_drop <= 2.0:
            raise ValueError(f"decision rule: sim_drop {self.sim_drop} outside [0, 2]")
        if not self.has_sim_dips and (self.sim_gate is not None or self.sim_local_min is not True):
            raise ValueError("decision rule: sim_gate / sim_local_min need a sim_threshold or sim_window")
        if self.learned is not None and not isinstance(self.learned, LearnedScore):
            raise ValueError("decision rule: learned must be a LearnedScore")
        if self.learned is not None and self.has_sim_dips:
            raise ValueError("decision rule: a learned score replaces the similarity dips; not both")

    @property
    def is_plain_threshold(self) -> bool:
        return (self.peak_threshold is None and self.smoothing == 0.0 and self.min_segment == 1
                and not self.needs_similarity and self.learned is None)

    @property
    def has_sim_dips(self) -> bool:
        return self.sim_threshold is not None or self.sim_window is not None

    @property
    def needs_similarity(self) -> bool:
        """Whether :meth:`boundaries` needs the adjacent cosine sequence beside P(same)."""
        return self.has_sim_dips or (self.learned is not None and self.learned.uses_cosine)

    @property
    def needs_embeddings(self) -> bool:
        """Whether :meth:`boundaries` needs the history's utterance embeddings (block features)."""
        return self.learned is not None and self.learned.uses_embeddings

    def without_similarity(self) -> "DecisionRule":
        """Steps 1-3 alone: the classifier's own decision, without the similarity dips or a learned score."""
        return DecisionRule(self.threshold, self.peak_threshold, self.smoothing, self.min_segment)

    def similarity_dips(self, p_same: Sequence[float], cosine: Sequence[float]) -> np.ndarray:
        """Step 4's candidates (bool per gap)."""
        c = np.asarray(cosine, dtype=np.float64)
        dip = np.ones(len(c), dtype=bool)
        if self.sim_threshold is not None:
            dip &= c < self.sim_threshold
        if self.sim_window is not None:
            dip &= c - neighbour_mean(c, int(self.sim_window)) < -self.sim_drop
        if self.sim_gate is not None:
            dip &= np.asarray(p_same, dtype=np.float64) < self.sim_gate
        if self.sim_local_min and len(c):
            left = np.concatenate([[np.inf], c[:-1]])
            right = np.concatenate([c[1:], [np.inf]])
            dip &= (c < left) & (c < right)
        return dip

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

    def boundaries(self, p_same: Sequence[float], cosine: Sequence[float] | None = None,
                   embeddings: np.ndarray | None = None) -> np.ndarray:
        """0/1 per gap (int8): 1 where a new segment starts after that gap.

        ``cosine``: the adjacent base-MiniLM cosine per gap (same order); required when the rule
        has similarity dips or a learned score that reads it, ignored otherwise. ``embeddings``: the
        history's unit-norm base-MiniLM utterance embeddings (one row per utterance, gaps + 1),
        required by a learned score with block features."""
        if self.needs_embeddings and embeddings is None:
            raise ValueError(f"decision rule {self.describe()!r} needs the history's utterance embeddings "
                             "(embeddings=)")
        if self.needs_similarity:
            if cosine is None:
                raise ValueError(f"decision rule {self.describe()!r} needs the adjacent cosine per gap (cosine=)")
            if len(cosine) != len(p_same):
                raise ValueError(f"decision rule: {len(cosine)} cosines for {len(p_same)} P(same) values")
        if self.learned is not None:
            return self.learned.boundaries(p_same, cosine, embeddings).astype(np.int8)
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
        if self.has_sim_dips and n:
            cand = cand | self.similarity_dips(p_same, cosine)
        return cand.astype(np.int8)

    def describe(self) -> str:
        if self.learned is not None:
            ls = self.learned
            names = ", ".join(ls.features) if len(ls.features) <= 8 else ", ".join(ls.features[:6]) + ", ..."
            return (f"boundary when a logistic score over {len(ls.features)} per-gap features "
                    f"({names}) is above {ls.cutoff:g}"
                    f"{' and a local maximum' if ls.local_max else ''} "
                    f"(classifier alone: {self.without_similarity().describe()[len('boundary when '):]})")
        parts = [f"P(same){' smoothed w=%g' % self.smoothing if self.smoothing else ''} < {self.threshold:g}"]
        if self.peak_threshold is not None:
            parts.append(f"or a strict local minimum < {self.peak_threshold:g}")
        if self.min_segment > 1:
            parts.append(f"min segment {self.min_segment}")
        if self.has_sim_dips:
            gate = f", P(same) < {self.sim_gate:g}" if self.sim_gate is not None else ""
            lm = " and a strict local minimum" if self.sim_local_min else ""
            low = [f"< {self.sim_threshold:g}"] if self.sim_threshold is not None else []
            if self.sim_window is not None:
                low.append(f"more than {self.sim_drop:g} below the mean of {self.sim_window} gaps each side")
            parts.append(f"or adjacent MiniLM cosine {' and '.join(low)}{lm}{gate}")
        return "boundary when " + ", ".join(parts)

    def to_json(self) -> dict:
        """Without similarity dips, exactly the v1 JSON (so versions of such artifacts do not move)."""
        d = {k: v for k, v in asdict(self).items() if k != "learned"}
        if self.learned is not None:
            return {"rule": RULE_NAME_LEARNED, **{k: v for k, v in d.items() if k not in _SIM_FIELDS},
                    "learned": self.learned.to_json()}
        if not self.has_sim_dips:
            return {"rule": RULE_NAME, **{k: v for k, v in d.items() if k not in _SIM_FIELDS}}
        return {"rule": RULE_NAME_SIM, **d}

    @classmethod
    def from_json(cls, d: dict) -> "DecisionRule":
        name = d.get("rule", RULE_NAME)
        if name not in (RULE_NAME, RULE_NAME_SIM, RULE_NAME_LEARNED):
            raise ValueError(f"unknown decision rule {name!r}; this code applies {RULE_NAME!r}, {RULE_NAME_SIM!r} "
                             f"or {RULE_NAME_LEARNED!r}")
        if name == RULE_NAME_LEARNED:
            if "learned" not in d:
                raise ValueError(f"decision rule {name!r}: the 'learned' block is missing")
            extra = set(d) & set(_SIM_FIELDS)
            if extra:
                raise ValueError(f"decision rule {name!r}: field(s) {sorted(extra)} not allowed")
            base = cls.from_json({k: v for k, v in d.items() if k != "learned"} | {"rule": RULE_NAME})
            return replace(base, learned=LearnedScore.from_json(d["learned"]))
        if "learned" in d:
            raise ValueError(f"decision rule {name!r}: a 'learned' block needs rule {RULE_NAME_LEARNED!r}")
        known = set(cls.__dataclass_fields__) - {"learned"}
        unknown = set(d) - known - {"rule", "chosen_on", "selection"}
        if unknown:
            raise ValueError(f"decision rule: unknown field(s) {sorted(unknown)}")
        has_sim = d.get("sim_threshold") is not None or d.get("sim_window") is not None
        if has_sim != (name == RULE_NAME_SIM):
            raise ValueError(f"decision rule {name!r}: sim_threshold / sim_window "
                             f"{'missing' if not has_sim else 'not allowed'}")
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_config(cls, config: dict) -> "DecisionRule":
        """The artifact's rule: its ``decision`` block, else (v1 artifacts) the plain threshold."""
        if "decision" in config:
            return cls.from_json(config["decision"])
        return cls(threshold=float(config["threshold"]))

    def fingerprint(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)



def artifact_version(weights_version: str, rule: DecisionRule) -> str:
    """The classifier version: its adapter weights and its decision rule, hashed."""
    digest = hashlib.sha256((weights_version + "|" + rule.fingerprint()).encode()).hexdigest()[:12]
    return f"{ARTIFACT_FORMAT_V2}-{digest}"


def version_of_config(config: dict) -> str:
    """An artifact config's version, derived from its content (v2) and checked against the stored
    ``version`` field, so a hand edit of the rule can never keep an old version. v1 artifacts (no
    ``weights_version``) keep their stored version: it hashes their weights and their rule is the
    plain threshold."""
    if "weights_version" not in config:
        return str(config["version"])
    derived = artifact_version(str(config["weights_version"]), DecisionRule.from_config(config))
    stored = config.get("version")
    if stored is not None and stored != derived:
        raise ValueError(
            f"artifact config: stored version {stored!r} does not match its weights and decision rule "
            f"({derived!r}); rewrite it with tune_decoding --write (the version is derived, not typed in)"
        )
    return derived


def as_rule(rule_or_threshold: "DecisionRule | float") -> DecisionRule:
    """Accept a bare threshold where a rule is expected (the plain rule)."""
    if isinstance(rule_or_threshold, DecisionRule):
        return rule_or_threshold
    return DecisionRule(threshold=float(rule_or_threshold))


def rule_of(classifier) -> DecisionRule:
    """A classifier's decision rule; an object with only a ``threshold`` gets the plain rule."""
    rule = getattr(classifier, "rule", None)
    return rule if rule is not None else as_rule(classifier.threshold)


# ------------------------------------------------------------------------------ precision
PRECISIONS = ("fp32", "bf16")


def classifier_precision(precision: str | None = None) -> str:
    """fp32 (default) or bf16 (CUDA only: autocast), from the argument or `QUMEM_CLASSIFIER_PRECISION`."""
    p = (precision or os.environ.get("QUMEM_CLASSIFIER_PRECISION") or "fp32").strip().lower()
    if p not in PRECISIONS:
        raise ValueError(f"QUMEM_CLASSIFIER_PRECISION={p!r}: expected one of {PRECISIONS}")
    return p


def version_with_precision(version: str, precision: str | None = None) -> str:
    """bf16 can move a decision next to the threshold, so it is part of the version rows carry."""
    return version + "+bf16" if classifier_precision(precision) == "bf16" else version
