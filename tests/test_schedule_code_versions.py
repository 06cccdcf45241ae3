"""Code versions: changing the classifier, prompt, LLM or embedder changes the affected assets' own versions,
and through them (a stage's version includes its upstream's) exactly those assets and their downstream
(what makes Dagster show them as stale)."""

import json
import shutil


import qumem_pipeline.embedding.version as embedding_version
from qumem_pipeline import code_versions
from qumem_pipeline.code_versions import downstream, stage_own_versions
from qumem_pipeline.episodes.version import DEFAULT_CLASSIFIER_DIR, classifier_version


def _versions() -> tuple[dict, dict]:
    """(own, full) versions now: own = a stage's source and inputs; full = own + upstream (the asset's)."""
    return stage_own_versions(), code_versions.stage_code_versions()


def _changed(before: tuple[dict, dict], after: tuple[dict, dict]) -> set[str]:
    """The stages a change touches directly; checks that the full versions move for them and downstream only."""
    own = {k for k in before[0] if before[0][k] != after[0][k]}
    assert {k for k in before[1] if before[1][k] != after[1][k]} == downstream(own)
    return own


def test_assets_carry_the_stage_code_versions():
    from assets.definitions import ALL_ASSETS

    versions = {k.to_user_string(): v for a in ALL_ASSETS for k, v in a.code_versions_by_key.items()}
    expected = code_versions.stage_code_versions()
    assert {k: versions[k] for k in expected} == expected


def test_llm_model_change_touches_only_llm_stages(monkeypatch):
    monkeypatch.delenv("QUMEM_LLM_MODEL", raising=False)
    monkeypatch.delenv("QUMEM_LLM_KIND", raising=False)
    before = _versions()
    monkeypatch.setenv("QUMEM_LLM_KIND", "openai")
    monkeypatch.setenv("QUMEM_LLM_MODEL", "Qwen/Qwen2.5-7B-Instruct")
    assert _changed(before, _versions()) == {"memories", "persona_profiles", "query_states"}


def test_classifier_artifact_change_touches_only_episodes(tmp_path, monkeypatch):
    before = _versions()
    retrained = tmp_path / "continuity"
    shutil.copytree(DEFAULT_CLASSIFIER_DIR, retrained)
    cfg = json.loads((retrained / "config.json").read_text())
    cfg["weights_version"] = cfg["weights_version"] + "-retrained"
    cfg.pop("version")  # derived from the weights version and the decision rule, never typed in
    (retrained / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setenv("QUMEM_CLASSIFIER_DIR", str(retrained))
    assert _changed(before, _versions()) == {"episodes"}


def test_a_decision_rule_change_alone_moves_the_classifier_version(tmp_path, monkeypatch):
    before = _versions()
    retuned = tmp_path / "continuity"
    shutil.copytree(DEFAULT_CLASSIFIER_DIR, retuned)
    cfg = json.loads((retuned / "config.json").read_text())
    was = classifier_version(str(retuned))
    cfg["decision"]["threshold"] = round(cfg["decision"]["threshold"] + 0.01, 2)
    cfg.pop("version")
    (retuned / "config.json").write_text(json.dumps(cfg))
    assert classifier_version(str(retuned)) != was
    monkeypatch.setenv("QUMEM_CLASSIFIER_DIR", str(retuned))
    assert _changed(before, _versions()) == {"episodes"}
    cfg["version"] = was  # an edited rule under the old version is refused, not silently kept
    (retuned / "config.json").write_text(json.dumps(cfg))
    try:
        classifier_version(str(retuned))
    except RuntimeError as e:
        assert "does not match" in str(e)
    else:
        raise AssertionError("a stale stored version must fail")


def test_prompt_and_embedder_changes(monkeypatch):
    import qumem_pipeline.memories.decompose as decompose

    # A prompt edit is a source edit: the module that holds the prompts and derives PROMPT_VERSION
    # from them is hashed into the stage's version (tests/test_versions.py edits a copy and sees it move).
    from pathlib import Path

    from qumem_pipeline.query.strategies import agents
    from qumem_pipeline.query.strategies.adamem import profiles

    assert Path(decompose.__file__).resolve() in {p.resolve() for p in code_versions.stage_files("memories")}
    assert Path(agents.__file__).resolve() in {p.resolve() for p in code_versions.stage_files("query_states")}
    assert Path(profiles.__file__).resolve() in {p.resolve() for p in code_versions.stage_files("persona_profiles")}
    before = _versions()
    monkeypatch.setattr(embedding_version, "embedder_version", lambda: "all-MiniLM-L12-v2@other")
    assert _changed(before, _versions()) == {"memory_embeddings", "memory_indexes", "persona_profiles",
                                                       "query_states"}


def test_unreadable_classifier_artifact_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("QUMEM_CLASSIFIER_DIR", str(tmp_path))
    try:
        classifier_version()
    except RuntimeError as e:
        assert "config.json" in str(e) and "version" in str(e)
    else:
        raise AssertionError("a missing artifact must fail")
