"""The committed continuity artifact loads offline and gives sane probabilities."""

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import numpy as np
import pytest
import torch

from qumem_pipeline.episodes.continuity import DEFAULT_ARTIFACT_DIR, ContinuityClassifier
from peft.tuners.lora import LoraLayer  # the adapter layer (continuity/lora.py is peft-based)
from qumem_pipeline.episodes.continuity.model import ContinuityNet, ModelConfig

PREV = "i just adopted a puppy , she is a golden retriever ."
CONT = "what breed is she ? golden retrievers are so friendly with kids ."
SHIFT = "what do you do for a living ? i work as an accountant ."


@pytest.fixture(scope="module")
def clf():
    return ContinuityClassifier.load(device="cpu")


def test_artifact_small_and_complete():
    files = list(DEFAULT_ARTIFACT_DIR.iterdir())
    assert sum(f.stat().st_size for f in files) <= 5 * 1024 * 1024
    cfg = json.loads((DEFAULT_ARTIFACT_DIR / "config.json").read_text())
    for key in ("version", "base_model", "base_model_sha256", "max_len", "lora", "threshold", "metrics", "train"):
        assert key in cfg, key
    assert cfg["metrics"]["test"]["pk"] < 0.35


def test_loads_offline_and_is_merged(clf):
    assert clf.version.startswith("continuity-minilm-lora-v2-")
    assert clf.config["weights_version"] != clf.version  # the version covers weights + decision rule
    assert clf.rule.threshold == clf.threshold == clf.config["decision"]["threshold"]
    assert 0.0 < clf.threshold < 1.0
    assert not any(isinstance(m, LoraLayer) for m in clf.net.modules())


def test_sane_probabilities(clf):
    p = clf.predict_same_proba([(PREV, CONT), (PREV, SHIFT)])
    assert p.dtype == np.float32 and p.shape == (2,)
    assert np.all((p >= 0) & (p <= 1))
    assert p[0] > p[1]
    assert p[0] > clf.threshold > p[1]


def test_order_and_batching_invariant(clf):
    pairs = [(PREV, CONT), (PREV, SHIFT), ("", ""), ("hi", "hello how are you doing today my friend ?"), (CONT, PREV)]
    seen = []
    p_all = clf.predict_same_proba(pairs, batch_size=2, progress=lambda d, t: seen.append((d, t)))
    p_one = np.array([clf.predict_same_proba([x])[0] for x in pairs])
    np.testing.assert_allclose(p_all, p_one, atol=1e-4)
    assert seen[-1] == (5, 5) and len(seen) == 3
    assert clf.predict_same_proba([]).shape == (0,)


def test_merged_equals_unmerged(clf):
    from safetensors.torch import load_file

    net = ContinuityNet(ModelConfig.from_json(clf.config["model"]))
    net.load_trainable_state(load_file(str(DEFAULT_ARTIFACT_DIR / "adapters.safetensors")))
    net.eval()
    (idx, ids, mask, types), = clf.prepare([(PREV, CONT), (PREV, SHIFT)], 8)
    with torch.inference_mode():
        a = torch.sigmoid(net(ids, mask, types))
        b = torch.sigmoid(clf.net(ids, mask, types))
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_base_hash_is_verified(tmp_path):
    cfg = json.loads((DEFAULT_ARTIFACT_DIR / "config.json").read_text())
    cfg["base_model_sha256"] = "0" * 64
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "adapters.safetensors").write_bytes((DEFAULT_ARTIFACT_DIR / "adapters.safetensors").read_bytes())
    with pytest.raises(ValueError, match="sha256"):
        ContinuityClassifier.load(tmp_path)


def test_the_committed_rule_is_learned_with_block_features_and_a_derived_version(clf):
    from qumem_pipeline.episodes.version import classifier_version
    from qumem_pipeline.episodes.continuity.decoding import artifact_version

    assert clf.rule.needs_similarity and clf.rule.needs_embeddings, clf.rule.describe()
    sel = clf.config["decision"]["selection"]["learned_block"]
    # chosen with TIAGE dev as a guard only (never fitted on), no worse than the classifier alone there
    assert "guard: TIAGE dev" in sel["chosen_on"] and "test" not in sel["chosen_on"]
    assert sel["cv_pk"]["dev"] <= sel["dev_pk_classifier_alone"]
    assert sel["cutoff"] == clf.rule.learned.cutoff and sel["local_max"] == clf.rule.learned.local_max
    assert clf.version == artifact_version(clf.config["weights_version"], clf.rule) == classifier_version()


def test_history_embeddings_are_the_base_minilm_rows_and_give_the_pair_cosine(clf):
    from qumem_pipeline.episodes.continuity.similarity import adjacent_cosine
    from qumem_pipeline.index.embeddings import Embedder

    history = [PREV, CONT, SHIFT, CONT]
    (e,) = clf.history_embeddings([history])
    emb = Embedder.load(device="cpu")
    np.testing.assert_allclose(e, emb.encode(history), atol=1e-5)
    pairs = list(zip(history[:-1], history[1:]))
    np.testing.assert_allclose(adjacent_cosine(e), clf.pair_cosine(pairs), atol=1e-5)
    both = clf.history_embeddings([history, [SHIFT], []])  # distinct texts encoded once, rows per history
    np.testing.assert_allclose(both[0], e, atol=1e-6)
    assert both[1].shape == (1, e.shape[1]) and len(both[2]) == 0
    # the shipped boundaries are the rule applied to the signals the stage computes
    p = clf.predict_same_proba(pairs)
    assert clf.predict_boundaries(pairs).tolist() == clf.rule.boundaries(p, adjacent_cosine(e), e).tolist()
    with pytest.raises(ValueError, match="embeddings"):
        clf.rule.boundaries(p, adjacent_cosine(e))


def test_pair_cosine_is_the_base_minilm_cosine(clf):
    from qumem_pipeline.index.embeddings import Embedder

    pairs = [(PREV, CONT), (PREV, SHIFT), (CONT, PREV), ("", "hi")]
    c = clf.pair_cosine(pairs)
    emb = Embedder.load(device="cpu")
    want = [float(emb.encode([a])[0] @ emb.encode([b])[0]) for a, b in pairs]
    assert c.dtype == np.float32 and c.shape == (4,)
    np.testing.assert_allclose(c, want, atol=1e-5)
    assert c[0] == pytest.approx(c[2], abs=1e-6) and c[0] > c[1]  # symmetric; the puppy pair is closer
    assert clf.pair_cosine([]).shape == (0,)


def test_precision_is_fp32_unless_bf16_is_asked_for_and_bf16_is_in_the_version(clf, monkeypatch):
    """A GPU host and a CPU host must cut the same episodes: fp32 on both unless bf16 is chosen, and a
    bf16 choice changes the version rows carry (so its episodes are never mistaken for fp32's)."""
    from qumem_pipeline.episodes.version import classifier_version
    from qumem_pipeline.episodes.continuity.decoding import classifier_precision

    monkeypatch.delenv("QUMEM_CLASSIFIER_PRECISION", raising=False)
    assert classifier_precision() == "fp32" and not clf.use_bf16 and clf.version == classifier_version()
    monkeypatch.setenv("QUMEM_CLASSIFIER_PRECISION", "bf16")
    assert classifier_precision() == "bf16"
    assert classifier_version() == clf.version + "+bf16"
    monkeypatch.setenv("QUMEM_CLASSIFIER_PRECISION", "fp8")
    with pytest.raises(ValueError, match="QUMEM_CLASSIFIER_PRECISION='fp8'"):
        classifier_precision()
