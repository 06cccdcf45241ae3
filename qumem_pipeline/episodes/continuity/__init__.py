"""Continuity classifier: P(same event | previous user utterance, next user utterance).

Public API (used by the episodes asset)::

    from qumem_pipeline.episodes.continuity import ContinuityClassifier
    clf = ContinuityClassifier.load()            # committed artifact; CUDA+bf16 if available
    p_same = clf.predict_same_proba(pairs, batch_size=64, progress=None)  # np.float32, input order
    clf.version, clf.rule                         # clf.rule.boundaries(p_same of one history)

The torch-backed names load lazily, so importing :mod:`.decoding` (numpy only) from the episodes
module does not pull torch into Dagster's code server.
"""

from qumem_pipeline.episodes.continuity.decoding import DecisionRule

_LAZY = {"ContinuityClassifier", "DEFAULT_ARTIFACT_DIR", "load_classifier"}


def __getattr__(name: str):
    if name in _LAZY:
        from qumem_pipeline.episodes.continuity import inference

        return getattr(inference, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ContinuityClassifier", "DEFAULT_ARTIFACT_DIR", "DecisionRule", "load_classifier"]
