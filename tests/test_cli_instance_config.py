"""`qumem` installs the repository's dagster.yaml into DAGSTER_HOME, brings an unedited older copy up
to date (how existing homes get the batched event log), and never overwrites an operator's edits."""

import hashlib

from qumem_pipeline.runtime import instance_config
from tests.conftest import REPO_ROOT


def test_current_instance_config_is_listed_as_shipped():
    current = hashlib.sha256((REPO_ROOT / "dagster.yaml").read_bytes()).hexdigest()
    assert current in instance_config.SHIPPED_INSTANCE_CONFIGS, "add the new dagster.yaml's sha256 to SHIPPED_INSTANCE_CONFIGS"


def test_new_home_gets_the_repository_config(tmp_path):
    cfg = tmp_path / "dagster.yaml"
    assert instance_config.install_instance_config(cfg) == "new"
    assert cfg.read_bytes() == (REPO_ROOT / "dagster.yaml").read_bytes()
    assert instance_config.install_instance_config(cfg) == "current"


def test_unedited_older_copy_is_upgraded_and_edited_one_is_kept(tmp_path, monkeypatch, capsys):
    older = b"telemetry:\n  enabled: false\n"  # stands for a dagster.yaml an earlier version shipped
    monkeypatch.setattr(instance_config, "SHIPPED_INSTANCE_CONFIGS", instance_config.SHIPPED_INSTANCE_CONFIGS | {hashlib.sha256(older).hexdigest()})
    cfg = tmp_path / "dagster.yaml"
    cfg.write_bytes(older)
    assert instance_config.install_instance_config(cfg) == "upgraded"
    assert cfg.read_bytes() == (REPO_ROOT / "dagster.yaml").read_bytes()
    assert "older copy" in capsys.readouterr().err

    edited = older + b"# my own retention settings\n"
    cfg.write_bytes(edited)
    assert instance_config.install_instance_config(cfg) == "edited"
    assert cfg.read_bytes() == edited
    assert "left as is" in capsys.readouterr().err
    assert not list(tmp_path.glob(".dagster.yaml.tmp-*"))
