"""The continuity network's LoRA by peft equals the hand-written adapters it replaced
(tests/lora_reference.py, verbatim): the committed artifact gives the same P(same), merged and
unmerged; a seeded model starts from the same adapters and gets the same gradients; the targets
and the artifact's key names are unchanged."""

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from qumem_pipeline.episodes.continuity import lora
from qumem_pipeline.embedding.base_model import load_base_model, load_tokenizer
from qumem_pipeline.episodes.continuity.inference import ADAPTER_FILE, DEFAULT_ARTIFACT_DIR, prepare_batches
from qumem_pipeline.episodes.continuity.model import ContinuityNet, ModelConfig
from tests import lora_reference as ref

FALLBACK_PAIRS = [
    ("i just adopted a puppy , she is a golden retriever .", "what breed is she ? golden retrievers are so friendly ."),
    ("i just adopted a puppy , she is a golden retriever .", "what do you do for a living ? i work as an accountant ."),
    ("do you like hiking ?", "yes , every weekend in the mountains ."),
    ("my sister is getting married next month .", "i love pizza with pineapple ."),
]


def _pairs(n=64):
    try:
        from qumem_pipeline.episodes.continuity.data import dialogue_pairs, load_tiage

        return [(p.a, p.b) for p in dialogue_pairs(load_tiage("test"))][:n]
    except FileNotFoundError:
        return FALLBACK_PAIRS


def _artifact():
    if not (DEFAULT_ARTIFACT_DIR / "config.json").is_file():
        pytest.skip("no committed continuity artifact")
    cfg = ModelConfig.from_json(json.loads((DEFAULT_ARTIFACT_DIR / "config.json").read_text())["model"])
    return cfg, load_file(str(DEFAULT_ARTIFACT_DIR / ADAPTER_FILE))


def _reference_net(cfg: ModelConfig, sd: dict) -> ContinuityNet:
    net = ContinuityNet(cfg, bert=load_base_model(), with_lora=False)
    ref.inject_lora(net.bert, cfg.lora_targets, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout)
    _, unexpected = net.load_state_dict(sd, strict=False)
    assert not unexpected
    return net.eval()


@torch.inference_mode()
def _p_same(net, batches, n):
    out = np.empty(n, dtype=np.float32)
    for idx, ids, mask, types in batches:
        out[idx] = torch.sigmoid(net(ids, mask, types)).numpy()
    return out


def test_committed_artifact_gives_the_same_predictions_merged_and_unmerged():
    cfg, sd = _artifact()
    pairs = _pairs()
    batches = prepare_batches(load_tokenizer(), pairs, cfg.max_len, 16)
    ours = ContinuityNet(cfg)
    ours.load_trainable_state(sd)  # the committed file, unchanged
    ours.eval()
    theirs = _reference_net(cfg, sd)
    p_ours, p_ref = _p_same(ours, batches, len(pairs)), _p_same(theirs, batches, len(pairs))
    assert np.max(np.abs(p_ours - p_ref)) <= 1e-6
    assert ours.merge() == ref.merge_lora(theirs.bert) == 6 * 6  # 6 layers x 6 targets
    assert not [m for m in ours.modules() if "lora" in type(m).__module__]  # plain Linear back
    m_ours, m_ref = _p_same(ours, batches, len(pairs)), _p_same(theirs, batches, len(pairs))
    assert np.max(np.abs(m_ours - m_ref)) <= 1e-6
    assert np.max(np.abs(m_ours - p_ours)) <= 1e-5  # merging changes nothing that matters
    assert 0.0 < p_ours.min() and p_ours.max() < 1.0 and p_ours.std() > 0.01  # not a constant


def test_artifact_keys_round_trip_unchanged():
    cfg, sd = _artifact()
    net = ContinuityNet(cfg)
    net.load_trainable_state(sd)
    state = net.trainable_state()
    assert set(state) == set(sd)
    assert all(torch.equal(state[k], sd[k]) for k in sd)
    with pytest.raises(ValueError, match="unexpected"):
        net.load_trainable_state({**sd, "bert.encoder.layer.0.attention.self.query.lora_C": sd[next(iter(sd))]})


def test_seeded_adapters_and_gradients_equal_the_hand_written():
    targets = lora.TARGETS_ALL
    torch.manual_seed(7)
    ours = load_base_model()
    names = lora.inject_lora(ours, targets, 4, 8.0)
    torch.manual_seed(7)
    theirs = load_base_model()
    ref_names = ref.inject_lora(theirs, targets, 4, 8.0)
    assert names == ref_names
    a, b = lora.lora_state_dict(ours), ref.lora_state_dict(theirs)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)  # same draws, same order
    # B starts at zero: give it the same random values in both, then compare one backward pass
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for k in sorted(b):
            if k.endswith("lora_B"):
                v = torch.randn(b[k].shape, generator=g) * 0.01
                ours.get_parameter(lora.peft_key(k)).copy_(v)
                theirs.get_parameter(k).copy_(v)
    (_, ids, mask, types), = prepare_batches(load_tokenizer(), FALLBACK_PAIRS, 32, 8)
    for m in (ours, theirs):
        m.eval()  # no dropout: both forwards deterministic (gradients flow all the same)
        m(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state[:, 0].sum().backward()
    trainable = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)  # peft leaves only the adapters trainable
    for k in b:
        ga, gb = ours.get_parameter(lora.peft_key(k)).grad, theirs.get_parameter(k).grad
        torch.testing.assert_close(ga, gb, atol=1e-6, rtol=1e-5)


def test_targets_match_the_layer_local_suffix_only():
    ours, theirs = load_base_model(), load_base_model()
    names = lora.inject_lora(ours, ("output.dense",), 2, 4.0)
    assert names == ref.inject_lora(theirs, ("output.dense",), 2, 4.0)
    assert names and not [n for n in names if "attention" in n]
    with pytest.raises(ValueError, match="no linear layer matched"):
        lora.inject_lora(load_base_model(), ("no.such.layer",), 2, 4.0)
