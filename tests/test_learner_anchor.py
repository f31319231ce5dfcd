"""The demonstration anchor (learner/anchor.py): its gradient, its order, its folder and its config rules."""

from __future__ import annotations

import pytest
import torch
from support.synthetic import make_group, tiny_llama

from agentrl.common.config import ConfigError
from agentrl.common.trajectory import GroupRejected
from agentrl.learner.advantages import AdvantageConfig, compute_advantages
from agentrl.learner.anchor import Anchor
from agentrl.learner.batching import PackedPolicy, Sample, build_micro_batches
from agentrl.learner.config import LearnerConfig
from agentrl.learner.ledger import Spool
from agentrl.learner.rewards import RewardWeights
from agentrl.learner.service import check_runnable
from agentrl.learner.trainer import Trainer, compute_dtype, set_trainable
from agentrl.learner.trainer_config import OptimizerConfig, TrainerConfig
from agentrl.runconfig import load_run_config

VOCAB = 128


def _trainer(config: TrainerConfig) -> Trainer:
    model = tiny_llama(VOCAB, seed=0)
    set_trainable(model, config.train_layers, config.train_embeddings)
    return Trainer(PackedPolicy(model, kernels=config.kernels, compute_dtype=compute_dtype(config)), config)


def _grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in trainer.policy.named_parameters() if p.grad is not None}


def _demos(n: int, turns=((6, 3), (5, 0))) -> list[Sample]:
    groups = [make_group(f"demo-{i}", [1.0], turns=list(turns), vocab_size=VOCAB, seed=100 + i) for i in range(n)]
    return [Sample(g.group_id, 0, g.trajectories[0], None) for g in groups]


def test_anchor_adds_coef_times_the_demonstrations_nll_gradient_to_the_rl_step():
    config = TrainerConfig(precision="fp32", kernels="reference", optimizer=OptimizerConfig(lr=1e-9, grad_clip=0.0))
    group = make_group("g", [1.0, 0.0], turns=[(6, 3), (5, 0)], vocab_size=VOCAB)
    advs = compute_advantages([group], RewardWeights(), AdvantageConfig("grpo"))[0]
    rl = build_micro_batches([Sample("g", t.sample_index, t, a) for t, a in zip(group.trajectories, advs, strict=True)], 4096)
    anchor = build_micro_batches(_demos(3), 4096)

    plain = _trainer(config)
    plain.rl_step(rl)
    pg = _grads(plain)
    sft = _trainer(config)
    sft.sft_step(anchor)
    nll = _grads(sft)
    anchored = _trainer(config)
    stats = anchored.rl_step(rl, anchor=anchor, anchor_coef=0.25)
    both = _grads(anchored)
    assert set(both) == set(pg) == set(nll)
    for name in both:  # the policy-gradient term plus 0.25 x the SFT gradient of the same demonstrations
        torch.testing.assert_close(both[name], pg[name] + 0.25 * nll[name], atol=1e-6, rtol=1e-4, msg=name)
    assert max(float((nll[n]).abs().max()) for n in nll) > 1e-4  # the anchor's share is not zero
    assert stats.kernel_stats["anchor_nll"] == pytest.approx(sft.sft_step(anchor).loss, rel=1e-4)
    assert stats.num_action_tokens == 22  # the step's counts are the RL samples'; the anchor is reported apart
    # Without an anchor the step has no anchor figure.
    assert "anchor_nll" not in plain.rl_step(rl).kernel_stats


def test_anchor_raises_the_demonstrations_likelihood_where_rl_alone_has_no_gradient():
    """Equal rewards: GRPO gives the group no gradient, so only the anchor moves the policy."""
    config = TrainerConfig(precision="fp32", kernels="reference", optimizer=OptimizerConfig(lr=1e-2))
    group = make_group("solved", [1.0, 1.0], turns=[(6, 3), (5, 0)], vocab_size=VOCAB)
    advs = compute_advantages([group], RewardWeights(), AdvantageConfig("grpo"))[0]
    assert all(not a.any() for a in advs)
    rl = build_micro_batches([Sample("solved", t.sample_index, t, a) for t, a in zip(group.trajectories, advs, strict=True)], 4096)
    anchor = build_micro_batches(_demos(2), 4096)
    trainer = _trainer(config)
    first = trainer.rl_step(rl, anchor=anchor, anchor_coef=1.0).kernel_stats["anchor_nll"]
    for _ in range(4):
        last = trainer.rl_step(rl, anchor=anchor, anchor_coef=1.0).kernel_stats["anchor_nll"]
    assert last < first - 0.3, (first, last)


def test_anchor_takes_whole_demonstrations_up_to_its_budget_each_once_per_pass():
    demos = _demos(5)  # 6 + 3 + 5 action/observation tokens after a prompt: every demo the same length
    size = demos[0].num_tokens
    anchor = Anchor(demos, tokens_per_step=2 * size + 1, seed=3)
    passes = [anchor.next_samples() for _ in range(5)]
    assert [len(p) for p in passes] == [2, 2, 1, 2, 2]  # the pass's last one alone, then a new pass
    first_pass = [s.group_id for p in passes[:3] for s in p]
    assert sorted(first_pass) == sorted(d.group_id for d in demos)
    again = Anchor(demos, tokens_per_step=2 * size + 1, seed=3)
    assert [[s.group_id for s in again.next_samples()] for _ in range(5)] == [[s.group_id for s in p] for p in passes]
    assert len(Anchor(demos, tokens_per_step=1).next_samples()) == 1  # over budget: still one whole demonstration
    with pytest.raises(ValueError, match="at least one"):
        Anchor([], tokens_per_step=10)


def test_anchor_reads_a_spool_folder_through_the_receivers_checks(tmp_path):
    spool = Spool(tmp_path / "anchor")
    for i in range(3):
        spool.put(make_group(f"anchor-{i}", [1.0], turns=[(4, 2), (3, 0)], vocab_size=VOCAB, seed=i))
    anchor = Anchor.from_dir(tmp_path / "anchor", vocab_size=VOCAB, tokens_per_step=10_000)
    assert sorted(s.group_id for s in anchor.next_samples()) == ["anchor-0", "anchor-1", "anchor-2"]
    with pytest.raises(GroupRejected, match="vocab"):  # token ids past the policy's vocabulary are refused
        Anchor.from_dir(tmp_path / "anchor", vocab_size=8, tokens_per_step=10_000)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        Anchor.from_dir(tmp_path / "missing", vocab_size=VOCAB, tokens_per_step=100)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no demonstration"):
        Anchor.from_dir(tmp_path / "empty", vocab_size=VOCAB, tokens_per_step=100)


def test_anchor_config_rules(tmp_path):
    with pytest.raises(ValueError, match="coef=-0.1 must be >= 0"):
        LearnerConfig(anchor={"coef": -0.1})
    with pytest.raises(ValueError, match="for mode = 'rl'"):
        LearnerConfig(mode="sft", anchor={"coef": 0.1})
    with pytest.raises(ConfigError, match="anchor.coef > 0 needs anchor_dir"):
        check_runnable(LearnerConfig(output_dir=str(tmp_path), publish={"every": 0}, anchor={"coef": 0.1}))
    # A run: the anchor trains on the SFT cold start's demonstrations (agentrl train fills anchor_dir);
    # with sft.enabled = false alone the run is accepted and its RL phase turns the anchor off
    # (agentrl/phases/rl.py; the run that reads no demonstration is tests/test_train_budget.py's).
    assert load_run_config(sets=["learner.anchor.coef=0.1", "sft.enabled=false"]).config.sft.enabled is False
    with pytest.raises(ConfigError, match="anchor_dir: set by agentrl train"):
        load_run_config(sets=["learner.anchor.coef=0.1", f"learner.anchor_dir={str(tmp_path)!r}"])
    assert load_run_config(sets=["learner.anchor.coef=0.1"]).config.learner.anchor.coef == 0.1


def test_anchor_skips_demonstrations_without_action_tokens_and_a_restart_takes_a_new_order(tmp_path):
    spool = Spool(tmp_path / "anchor")
    for i in range(6):
        spool.put(make_group(f"anchor-{i}", [1.0], turns=[(4, 2), (3, 0)], vocab_size=VOCAB, seed=i))
    spool.put(make_group("observation-only", [1.0], turns=[(0, 5)], vocab_size=VOCAB, seed=9))
    anchor = Anchor.from_dir(tmp_path / "anchor", vocab_size=VOCAB, tokens_per_step=1)
    assert len(anchor.samples) == 6 and "observation-only" not in {s.group_id for s in anchor.samples}
    first = [anchor.next_samples()[0].group_id for _ in range(6)]
    anchor.restart(0)
    assert [anchor.next_samples()[0].group_id for _ in range(6)] == first  # the same step: the same order
    anchor.restart(40)  # resumed at step 40: another order of the same demonstrations
    resumed = [anchor.next_samples()[0].group_id for _ in range(6)]
    assert sorted(resumed) == sorted(first) and resumed != first


def test_a_demonstration_spool_is_written_whole_and_a_partial_one_is_replaced(tmp_path):
    """`agentrl train` writes the anchor's demonstrations with `Spool.write_whole`: one group of one
    trajectory each, in order; a folder a stopped writer left (NAME.partial) is removed first, and
    no partial folder remains."""
    from agentrl.common.trajectory import single_group

    gold = [make_group(f"g{i}", [1.0]).trajectories[0] for i in range(3)]
    stale = tmp_path / "rl-anchor.partial"
    stale.mkdir()
    (stale / "000000000000-old.grp").write_bytes(b"not a group")
    path = Spool.write_whole(tmp_path / "rl-anchor", (single_group(f"anchor-{i}", t) for i, t in enumerate(gold)))
    assert not stale.exists() and path == tmp_path / "rl-anchor"
    spool = Spool(path)
    assert spool.pending() == ["anchor-0", "anchor-1", "anchor-2"]
    for i, traj in enumerate(gold):
        group = spool.load(f"anchor-{i}")
        assert [t.group_id for t in group.trajectories] == [f"anchor-{i}"]
        assert group.trajectories[0].token_ids.tolist() == traj.token_ids.tolist()
