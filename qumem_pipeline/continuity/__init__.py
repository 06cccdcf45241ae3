"""Continuity classifier: P(same event | previous user utterance, next user utterance).

Public API (used by the episodes asset)::

    from qumem_pipeline.continuity import ContinuityClassifier
    clf = ContinuityClassifier.load()            # committed artifact; CUDA+bf16 if available
    p_same = clf.predict_same_proba(pairs, batch_size=64, progress=None)  # np.float32, input order
    clf.version, clf.threshold                    # boundary when p_same < threshold
"""

from .inference import DEFAULT_ARTIFACT_DIR, ContinuityClassifier, load_classifier

__all__ = ["ContinuityClassifier", "DEFAULT_ARTIFACT_DIR", "load_classifier"]
