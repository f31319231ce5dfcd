"""The learner's config file and its off-policy control (staleness) without starting the loop."""

import numpy as np
import pytest
from support.synthetic import make_trajectory

from agentrl.common.trajectory import TrajectoryGroup
from agentrl.learner.config import LearnerConfig, LearnerTransportConfig
from agentrl.learner.rewards import RewardWeights
from agentrl.learner.service import Learner, load_config

FULL = """
output_dir = "{out}"
tokens_per_step = 4096
max_steps = 10
staleness_bound = 2
publish.every = 2
server_urls = ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]

[trainer]
precision = "bf16"
train_layers = 4
train_embeddings = false

[trainer.optimizer]
lr = 2e-6
betas = [0.9, 0.95]
grad_clip = 0.5

[trainer.loss]
eps_high = 0.3
kl_coef = 0.0

[trainer.advantage]
estimator = "rloo"
dynamic_sampling = true

[reward_schedule]
num_steps = 50
"""


def test_full_config_parses_into_typed_dataclasses(tmp_path):
    path = tmp_path / "learner.toml"
    path.write_text(FULL.format(out=tmp_path / "run"))
    config = load_config(path)
    assert config.trainer.optimizer.betas == (0.9, 0.95) and config.trainer.optimizer.lr == 2e-6
    assert config.trainer.loss.eps_high == 0.3 and config.trainer.advantage.estimator == "rloo"
    assert config.trainer.train_layers == 4 and config.reward_schedule.num_steps == 50
    assert config.server_urls == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    assert (config.publish.every, config.publish.kv_refresh_every, config.checkpoint.every) == (2, 1, 10)


@pytest.mark.parametrize("text, message", [
    ('output_dir = "x"\nlearning_rate = 1', "learning_rate: unknown key; accepted keys here: output_dir, model_dir"),
    ('output_dir = "x"\n[trainer.optimizer]\nlrr = 1', r"trainer.optimizer.lrr: unknown key; accepted keys here: lr, betas"),
    ('output_dir = "x"\npublish.every = 0\n[trainer.advantage]\nestimator = "ppo"',
     r"trainer.advantage.estimator: Input should be 'grpo', 'dr_grpo'.* \(got \"ppo\"\)"),
    ('output_dir = "x"\ntokens_per_step = "8192"', r"tokens_per_step: Input should be a valid integer \(got \"8192\"\)"),
    ('output_dir = "x"\ntokens_per_step = 0', "bad.toml: tokens_per_step: 0 must be > 0"),
    # Keys of an older layout are refused naming where they went.
    ('output_dir = "x"\npublish_every = 2', "bad.toml: publish_every: this key moved; write it as publish.every$"),
    ('output_dir = "x"\nanchor_coef = 0.1', "bad.toml: anchor_coef: this key moved; write it as anchor.coef$"),
    ('output_dir = "x"\nweight_transport = "stream"', "bad.toml: weight_transport: this key moved; write it as publish.transport$"),
    ('output_dir = "x"\n[checkpoint]\nevery = 0', "bad.toml: checkpoint.every: every \\(0\\) must be > 0"),
    ('output_dir = "x"\ngroup_endpoint = "tcp://127.0.0.1:5555"',
     "bad.toml: group_endpoint: this key moved; write it as transport.group_endpoint$"),
    ('output_dir = "x"\n[transport]\ngroup_endpoint = "tcp://0.0.0.0:5555"',
     "bad.toml: transport.group_endpoint: refusing to bind tcp://0.0.0.0:5555"),
    ('output_dir = "x"\n[transport]\nmax_group_frame_bytes = 10', "bad.toml: transport.max_group_frame_bytes: 10 must be >= 1024"),
])
def test_bad_config_fails_early_with_the_fix(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config(path)


def test_a_learner_that_publishes_needs_servers(tmp_path):
    with pytest.raises(ValueError, match="needs server_urls"):
        Learner(LearnerConfig(output_dir=str(tmp_path), publish={"every": 1}))


def _traj(index, versions, reward):
    traj = make_trajectory(prompt_len=3, turns=[(2, 1), (2, 0)], task_reward=reward, sample_index=index)
    traj.policy_versions[traj.is_action.astype(bool)] = versions
    return traj


def test_stale_samples_are_rejected_and_reported(tmp_path):
    learner = Learner(LearnerConfig(output_dir=str(tmp_path), publish={"every": 0}, staleness_bound=2))
    learner.step = 5
    mixed = TrajectoryGroup("mixed", "t", [_traj(0, [5, 5, 4, 4], 1.0), _traj(1, [3, 3, 3, 3], 0.0),
                                           _traj(2, [2, 2, 5, 5], 1.0)])  # sample 2 has tokens 3 versions old
    old = TrajectoryGroup("old", "t", [_traj(0, [1, 1, 1, 1], 1.0), _traj(1, [0, 0, 0, 0], 0.0)])
    batch = learner.prepare([mixed, old], RewardWeights())
    report = batch.report
    assert [(s.group_id, s.sample_index) for s in batch.samples] == [("mixed", 0), ("mixed", 1)]
    assert report["staleness/rejected_samples"] == 3
    assert batch.rejected == {"old": "stale"}
    assert report["staleness/hist"] == {"0": 4, "1": 2, "2": 4, "3": 2, "4": 4, "5": 4}
    assert report["staleness/max"] == 5
    assert np.isclose(report["staleness/mean"], (0 * 4 + 1 * 2 + 2 * 4 + 3 * 2 + 4 * 4 + 5 * 4) / 20)


@pytest.mark.parametrize("endpoint, local", [("tcp://127.0.0.1:5555", True), ("tcp://localhost:5555", True),
                                             ("tcp://[::1]:5555", True), ("ipc:///tmp/learner.sock", True),
                                             ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False),
                                             ("tcp://10.1.2.3:5555", False)])
def test_without_curve_keys_the_learner_binds_its_sockets_on_loopback_only(endpoint, local):
    """With keys it may bind anywhere: tests/test_learner_curve.py."""
    for key in ("group_endpoint", "version_endpoint"):
        if local:
            LearnerTransportConfig(**{key: endpoint})
        else:
            with pytest.raises(ValueError, match=f"{key}: refusing to bind .*reachable from other hosts.*CurveZMQ"):
                LearnerTransportConfig(**{key: endpoint})
