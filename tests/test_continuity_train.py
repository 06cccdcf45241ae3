"""The training loop runs a few steps on a tiny inline subset, the loss falls, an artifact is written."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

from qumem_pipeline.episodes.continuity.data import Pair
from qumem_pipeline.episodes.continuity.model import ModelConfig
from qumem_pipeline.episodes.continuity.train import TrainConfig, train

SAME = [
    ("i just adopted a puppy", "what breed is your new puppy ?"),
    ("i love cooking italian food", "my favourite pasta is lasagna"),
    ("we went hiking in the mountains", "the trail up the mountain was steep"),
    ("i play guitar in a band", "our band plays rock songs on guitar"),
]
DIFF = [
    ("i just adopted a puppy", "do you like jazz music ?"),
    ("i love cooking italian food", "what car do you drive ?"),
    ("we went hiking in the mountains", "i work as an accountant"),
    ("i play guitar in a band", "my grandmother lives in florida"),
]


def _pairs():
    out = [Pair(a, b, 1, f"d{i}", 0) for i, (a, b) in enumerate(SAME)]
    out += [Pair(a, b, 0, f"d{i}", 1) for i, (a, b) in enumerate(DIFF)]
    return out


def test_train_few_steps_loss_falls(tmp_path):
    pairs = _pairs()
    cfg = TrainConfig(epochs=8, batch_size=8, lr=3e-3, head_lr=1e-2, warmup_frac=0.0, eval_batch_size=8,
                      model=ModelConfig(max_len=32, lora_r=4, head_dropout=0.0))
    res = train(tmp_path / "art", seed=0, cfg=cfg, train_pairs=pairs, dev_pairs=pairs, test_pairs=pairs,
                log=lambda m: None)
    losses = res["losses"]
    assert len(losses) == 8
    assert np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.05, losses
    cfg_json = json.loads((tmp_path / "art" / "config.json").read_text())
    assert cfg_json["version"].startswith("continuity-minilm-lora-v2-")
    assert 0.0 < cfg_json["threshold"] < 1.0
    # the decision rule is chosen on dev at the end of training and stored with the weights
    assert cfg_json["decision"]["threshold"] == cfg_json["threshold"]
    assert cfg_json["decision"]["selection"]["chosen_on"] == "TIAGE dev"
    assert (tmp_path / "art" / "adapters.safetensors").stat().st_size < 5_000_000


def test_train_is_seeded(tmp_path):
    pairs = _pairs()
    cfg = TrainConfig(epochs=1, batch_size=4, max_steps=2, eval_batch_size=8,
                      model=ModelConfig(max_len=32, lora_r=2))
    a = train(None, seed=1, cfg=cfg, train_pairs=pairs, dev_pairs=pairs, test_pairs=[], log=lambda m: None)
    b = train(None, seed=1, cfg=cfg, train_pairs=pairs, dev_pairs=pairs, test_pairs=[], log=lambda m: None)
    assert a["losses"] == b["losses"]
    assert a["version"] == b["version"]


def test_swap_aug_and_cls_mean_pooling(tmp_path):
    pairs = _pairs()
    cfg = TrainConfig(epochs=1, batch_size=4, max_steps=3, eval_batch_size=8, swap_aug=True, label_smoothing=0.1,
                      model=ModelConfig(max_len=32, lora_r=2, pooling="cls_mean"))
    res = train(tmp_path / "art", seed=0, cfg=cfg, train_pairs=pairs, dev_pairs=pairs, test_pairs=[],
                log=lambda m: None)
    assert res["train"]["n_train_pairs"] == 2 * len(pairs)  # swapped copies were added
    assert len(res["losses"]) == 3
    from qumem_pipeline.episodes.continuity import ContinuityClassifier

    clf = ContinuityClassifier.load(tmp_path / "art", device="cpu")
    p = clf.predict_same_proba([(a, b) for a, b in SAME[:2]])
    assert p.shape == (2,) and np.all((p >= 0) & (p <= 1))


def test_seg_pair_features_pool_each_utterance_separately():
    import torch

    from qumem_pipeline.episodes.continuity.model import seg_pair_features

    # [CLS] a a [SEP] | b [SEP] | pad ; hidden states chosen so the two means are easy to check
    h = torch.tensor([[[9.0, 9.0], [1.0, 2.0], [3.0, 4.0], [2.0, 3.0], [5.0, 1.0], [5.0, 1.0], [7.0, 7.0]]])
    types = torch.tensor([[0, 0, 0, 0, 1, 1, 1]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])
    f = seg_pair_features(h, mask, types)
    a = torch.tensor([15.0 / 4, 18.0 / 4])  # mean of type-0 tokens incl. [CLS] and first [SEP]
    b = torch.tensor([5.0, 1.0])  # the padded position (7, 7) is ignored
    torch.testing.assert_close(f[0], torch.cat([h[0, 0], a * b, (a - b).abs()]))


def test_seg_pair_pooling_trains_and_loads(tmp_path):
    pairs = _pairs()
    cfg = TrainConfig(epochs=1, batch_size=4, max_steps=2, eval_batch_size=8,
                      model=ModelConfig(max_len=32, lora_r=2, pooling="seg_pair"))
    train(tmp_path / "art", seed=0, cfg=cfg, train_pairs=pairs, dev_pairs=pairs, test_pairs=[], log=lambda m: None)
    from qumem_pipeline.episodes.continuity import ContinuityClassifier

    clf = ContinuityClassifier.load(tmp_path / "art", device="cpu")
    assert clf.net.cfg.pooling == "seg_pair" and clf.net.head[-1].in_features == 3 * 384
    p = clf.predict_same_proba([(a, b) for a, b in SAME[:2]])
    assert p.shape == (2,) and np.all((p >= 0) & (p <= 1))


def test_cross_dialogue_negatives_pair_utterances_of_different_dialogues(tmp_path):
    from qumem_pipeline.episodes.continuity.train import cross_dialogue_negatives

    pairs = _pairs()
    dial_of = {}
    for p in pairs:
        dial_of.setdefault(p.b, set()).add(p.dial_id)
    extra = cross_dialogue_negatives(pairs, 0.5, seed=3)
    assert len(extra) == 4 and extra == cross_dialogue_negatives(pairs, 0.5, seed=3)  # seeded
    for a, b in extra:
        a_dials = {p.dial_id for p in pairs if p.a == a}
        assert dial_of[b].isdisjoint(a_dials), (a, b)  # b never comes from a's own dialogue
    cfg = TrainConfig(epochs=1, batch_size=4, max_steps=2, eval_batch_size=8, cross_neg=0.5,
                      model=ModelConfig(max_len=32, lora_r=2))
    res = train(None, seed=0, cfg=cfg, train_pairs=pairs, dev_pairs=pairs, test_pairs=[], log=lambda m: None)
    assert res["train"]["n_train_pairs"] == len(pairs) + 4 and res["train"]["cross_neg"] == 0.5


def test_weight_averaging_candidate_is_evaluated_and_loadable(tmp_path):
    pairs = _pairs()
    cfg = TrainConfig(epochs=3, batch_size=8, lr=3e-3, head_lr=1e-2, warmup_frac=0.0, eval_batch_size=8,
                      swa_from=2, model=ModelConfig(max_len=32, lora_r=2, head_dropout=0.0))
    res = train(tmp_path / "art", seed=0, cfg=cfg, train_pairs=pairs, dev_pairs=pairs, test_pairs=[],
                log=lambda m: None)
    labels = [h["epoch"] for h in res["history"]]
    assert labels == [1, 2, 3, "swa2-3"], labels  # the mean of epochs 2 and 3 was scored on dev
    assert res["train"]["swa_from"] == 2
    from qumem_pipeline.episodes.continuity import ContinuityClassifier

    clf = ContinuityClassifier.load(tmp_path / "art", device="cpu")
    assert clf.predict_same_proba([SAME[0]]).shape == (1,)


def test_mixed_domains_join_the_training_pairs_and_the_artifact_says_so():
    from qumem_pipeline.episodes.continuity.train import mixed_pairs

    pairs = _pairs()
    cfg = TrainConfig(epochs=1, batch_size=4, max_steps=2, eval_batch_size=8, mix=("gen",),
                      model=ModelConfig(max_len=32, lora_r=2))
    res = train(None, seed=0, cfg=cfg, train_pairs=pairs, dev_pairs=pairs, test_pairs=[], log=lambda m: None)
    assert res["train"]["n_train_pairs"] == len(pairs) + len(mixed_pairs(("gen",)))
    assert tuple(res["train"]["mix"]) == ("gen",)
