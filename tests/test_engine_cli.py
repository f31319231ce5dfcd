"""The eval/rollout config: TOML sections map onto the component dataclasses; mistakes fail early."""

from __future__ import annotations

import pytest

from agentrl.engine.cli import load_config, load_tasks

EXAMPLE = """
[tasks]
source = "synthetic"
split = "train"
num = 32
hops = [1, 2]
[inference]
servers = ["http://127.0.0.1:8000"]
[env]
max_turns = 4
[env.rewards]
malformed_call = -0.5
[sampling]
temperature = 1.0
seed = 0
[orchestrator]
group_size = 4
"""


def test_config_maps_onto_component_dataclasses(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(EXAMPLE)
    config = load_config(str(path))
    assert config.env.max_turns == 4 and config.env.rewards.malformed_call == -0.5
    assert config.orchestrator.group_size == 4 and config.sampling.temperature == 1.0
    tasks, corpus = load_tasks(config.tasks, tmp_path)
    assert len(tasks) == 32 and {t.num_hops for t in tasks} <= {1, 2} and corpus.exists()


@pytest.mark.parametrize("text, message", [
    ("[env]\nmax_turn = 4\n", "unknown key.*max_turn"),
    ("[envv]\n", "unknown key.*envv"),
    ("[env]\ntask_metric = 'bleu'\n", "task_metric"),
    ("[tasks]\nsource = 'hotpotqa'\n", "needs path"),
])
def test_config_mistakes_fail_with_the_fix(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_tasks(load_config(str(path)).tasks, tmp_path)
