"""`qumem train-classifier` writes outside the committed artifact unless told otherwise, and stores the
boundary rule kind that ships (the learned block rule, `tune_learned`), not `tune_decoding`'s."""

import json
import os
import subprocess
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from qumem_pipeline.episodes.continuity import train as train_mod
from qumem_pipeline.episodes.continuity import tune_learned
from qumem_pipeline.episodes.continuity.model import ModelConfig
from qumem_pipeline.episodes.continuity.train import (DEFAULT_OUT, SHIPPED_DIR, ShippedArtifactRefused, TrainConfig,
                                                      output_dir, train_as_shipped)
from tests.conftest import REPO_ROOT
from tests.test_continuity_train import _pairs


def test_the_default_is_outside_the_committed_artifact(tmp_path):
    assert output_dir(None) == DEFAULT_OUT and not DEFAULT_OUT.is_relative_to(REPO_ROOT / "qumem_pipeline")
    assert output_dir(tmp_path / "clf") == tmp_path / "clf"
    assert output_dir(None, overwrite_shipped=True) == SHIPPED_DIR
    with pytest.raises(ShippedArtifactRefused, match="--overwrite-shipped"):
        output_dir(SHIPPED_DIR)
    with pytest.raises(ShippedArtifactRefused, match="two places"):
        output_dir(tmp_path / "clf", overwrite_shipped=True)


@pytest.mark.parametrize("args", [["--out", "qumem_pipeline/artifacts/continuity"],
                                  ["--out", "/tmp/elsewhere", "--overwrite-shipped"]])
def test_the_cli_refuses_before_training(args):
    before = (SHIPPED_DIR / "config.json").read_bytes()
    r = subprocess.run([sys.executable, "-m", "qumem_pipeline.cli", "train-classifier", *args], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().count("\n") == 0 and "train-classifier" in r.stderr and "--overwrite-shipped" in r.stderr
    assert (SHIPPED_DIR / "config.json").read_bytes() == before


def test_a_retrain_stores_the_learned_rule(tmp_path, monkeypatch):
    """A tiny retrain (inline pairs, a few dialogues of each set for the rule's signals) ends with the learned
    block rule in its config.json, as the committed artifact has, and the version that rule makes."""
    sets = tune_learned.load_sets()
    monkeypatch.setattr(tune_learned, "load_sets", lambda seed=None: {n: ds[:4] for n, ds in sets.items()})
    pairs = _pairs()
    cfg = TrainConfig(epochs=1, batch_size=4, max_steps=2, eval_batch_size=8, model=ModelConfig(max_len=32, lora_r=2))
    trained = train_mod.train(None, seed=0, cfg=cfg, train_pairs=pairs, dev_pairs=pairs, test_pairs=[],
                              log=lambda m: None)
    res = train_as_shipped(tmp_path / "clf", 0, cfg, log=lambda m: None, train_pairs=pairs, dev_pairs=pairs,
                           test_pairs=[])
    stored = json.loads((tmp_path / "clf" / "config.json").read_text())
    shipped = json.loads((SHIPPED_DIR / "config.json").read_text())
    assert "learned_block" in stored["decision"]["selection"] and "learned_block" in shipped["decision"]["selection"]
    assert stored["decision"].keys() == shipped["decision"].keys()  # the same rule kind as the one that ships
    assert stored["version"] == res["version"] != trained["version"]  # the rule is part of the version
    from qumem_pipeline.episodes.continuity.inference import ContinuityClassifier

    assert ContinuityClassifier.load(tmp_path / "clf").version == stored["version"]  # loads, version checked
