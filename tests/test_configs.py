"""Every shipped config parses, and the learner accepts the learner config the supervisor derives from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.common.config import deep_merge, dump_toml
from agentrl.learner.service import load_config as load_learner_config
from agentrl.train import DEFAULT_CONFIG, load_train_config

CONFIGS = sorted((Path(DEFAULT_CONFIG).parent).glob("*.toml"))


def test_configs_are_shipped():
    assert {p.name for p in CONFIGS} >= {"cpu_default.toml", "gpu_agent_r1.toml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_parses(path, tmp_path):
    config = load_train_config(path)
    assert config.minutes > 0
    phases = [("rl", {})] + ([("sft", config.sft.learner)] if config.sft.enabled else [])
    for phase, overrides in phases:
        data = deep_merge(config.learner, overrides)
        data.update(output_dir=str(tmp_path / phase), mode=phase, server_urls=["http://127.0.0.1:1"])
        learner_path = tmp_path / f"{phase}.toml"
        learner_path.write_text(dump_toml(data))
        learner = load_learner_config(learner_path)
        assert learner.mode == phase



def test_cpu_recipe_trains_each_step_as_one_row(tmp_path):
    """The CPU recipe's learner speed rests on a step being one packed row (the shared prompt then
    runs once through the frozen layers: cpu_default.toml, docs/notes/issue-6.md)."""
    config = load_train_config(DEFAULT_CONFIG)
    for phase, overrides in (("rl", {}), ("sft", config.sft.learner)):
        data = deep_merge(config.learner, overrides)
        data.update(output_dir=str(tmp_path / phase), mode=phase, server_urls=["http://127.0.0.1:1"])
        (tmp_path / f"{phase}.toml").write_text(dump_toml(data))
        learner = load_learner_config(tmp_path / f"{phase}.toml")
        assert learner.trainer.max_row_tokens >= learner.tokens_per_step, phase

def test_unknown_keys_are_refused_with_the_known_ones(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("minutes = 1.0\n[orchestrator]\ngroup_sise = 4\n")
    with pytest.raises(ValueError, match="group_sise.*accepted"):
        load_train_config(bad)


def test_datasets_need_their_files(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[tasks]\nsource = "datasets"\n[sft]\nenabled = false\n')
    with pytest.raises(ValueError, match="train_files and eval_files"):
        load_train_config(bad)


def test_toml_writer_round_trips():
    import tomllib

    data = {"a": 1, "b": [1, 2], "c": {"d": "x\"y", "e": {"f": True, "g": 0.5}}, "h": None}
    assert tomllib.loads(dump_toml(data)) == json.loads(json.dumps({k: v for k, v in data.items() if v is not None}))
