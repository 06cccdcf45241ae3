"""The `episodes` asset applies the committed classifier's whole decision rule — P(same) and the base
MiniLM cosine dips — in a real Dagster run (turns -> episodes, real models, real Delta tables)."""

import dagster as dg
import numpy as np

from qumem_pipeline.storage.layout import DataLayout
from tests.conftest import conversation, write_jsonl

COOKING = ["I made fresh pasta tonight with eggs and semolina flour.",
           "The dough was a bit dry, so I added a spoonful of water.",
           "Next time I want to try a spinach ravioli filling.",
           "Do you think ricotta or mascarpone works better in ravioli?",
           "I'll serve it with a brown butter and sage sauce."]
CAR = ["My car's check engine light came on this morning.",
       "The mechanic says the oxygen sensor might be failing.",
       "Replacing it costs about two hundred dollars with labour.",
       "Should I also ask them to look at the brake pads?",
       "The car is a 2012 Honda Civic with 140,000 miles."]


def test_episodes_asset_applies_the_learned_rule_with_block_features(tmp_path):
    from assets.episodes import episodes
    from qumem_pipeline.index.embeddings import Embedder
    from assets.ingest import turns
    from qumem_pipeline.episodes.version import classifier_version
    from resources import PipelineConfig
    from resources.models import ContinuityClassifierResource

    texts = [t for u in COOKING + CAR for t in (u, "I see.")]
    write_jsonl(tmp_path / "archive" / "a.jsonl", conversation("alice", "c1", texts))
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("users", ["alice"])
    continuity = ContinuityClassifierResource(device="cpu")
    res = dg.materialize([turns, episodes], instance=instance, partition_key="alice", resources={
        "pipeline": PipelineConfig(data_root=str(tmp_path / "data"), archive_path=str(tmp_path / "archive")),
        "continuity": continuity})
    assert res.success
    eps = DataLayout(tmp_path / "data").read_user_table("episodes", "alice").sort("episode_index")

    clf = continuity.model
    assert clf.rule.needs_similarity and clf.rule.needs_embeddings
    users = COOKING + CAR
    pairs = list(zip(users[:-1], users[1:]))
    # the signals computed here independently of the stage: the base MiniLM rows of the utterances
    e = Embedder.load(device="cpu").encode(users)
    p, c = clf.predict_same_proba(pairs), clf.pair_cosine(pairs)
    want = clf.rule.boundaries(p, c, e)
    assert want.any() and not want.all()  # the rule decides something on this history
    # user utterance k is turn 2k; an episode starts after every boundary gap
    starts = [0] + [2 * (int(i) + 1) for i in np.flatnonzero(want)]
    assert eps["first_turn_index"].to_list() == starts
    assert sorted(t for ids in eps["turn_ids"].to_list() for t in ids) == list(range(len(texts)))
    assert set(eps["classifier_version"]) == {clf.version} == {classifier_version()}
    mat = res.asset_materializations_for_node("episodes")[0]
    assert mat.metadata["classifier_version"].value == clf.version
