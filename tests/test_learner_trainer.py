"""Packing, the packed forward, the loss mask and the optimizer step on a tiny random Llama."""

import numpy as np
import pytest
import torch
from support.synthetic import make_group, make_trajectory, tiny_llama

from agentrl.common.trajectory import TrajectoryGroup
from agentrl.kernels.policy_loss import PolicyLossConfig
from agentrl.learner.advantages import AdvantageConfig, compute_advantages
from agentrl.learner.batching import PackedPolicy, Sample, build_micro_batches, pack_first_fit
from agentrl.learner.rewards import RewardWeights, token_rewards
from agentrl.learner.trainer import Trainer, compute_dtype, set_trainable
from agentrl.learner.trainer_config import OptimizerConfig, TrainerConfig

VOCAB = 128


def _samples(groups, advantages=None):
    advantages = advantages or [[np.where(t.is_action, 1.0, 0.0).astype(np.float32) for t in g.trajectories]
                                for g in groups]
    return [Sample(g.group_id, t.sample_index, t, a) for g, advs in zip(groups, advantages, strict=True)
            for t, a in zip(g.trajectories, advs, strict=True)]


def test_pack_first_fit_respects_budget_and_places_everything_once():
    lengths = [700, 300, 1200, 50, 900, 2000, 5000]
    rows = pack_first_fit(lengths, 2048)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    for row in rows:
        assert len(row) == 1 or sum(lengths[i] for i in row) <= 2048
    assert rows == [[6], [5], [2, 0, 3], [4, 1]]  # 5000 alone, 2000 alone, 1200+700+50, 900+300


def test_packed_row_matches_separate_forwards():
    model = tiny_llama(VOCAB).eval()
    stock = tiny_llama(VOCAB).eval()  # same weights (same seed), transformers' own sdpa attention
    policy = PackedPolicy(model, kernels="reference")
    group = make_group("g", [1.0, 0.0, 1.0], turns=[(5, 3), (4, 0)], vocab_size=VOCAB)
    samples = _samples([group])
    [packed] = build_micro_batches(samples, max_row_tokens=10_000)
    assert packed.num_seqs == 3 and packed.num_tokens == sum(s.num_tokens for s in samples)
    with torch.no_grad():
        lp_packed, _, _ = policy(packed.input_ids_L, packed.position_ids_L, packed.gather_idx_N, packed.targets_N)
        separate = []
        for s in samples:
            [mb] = build_micro_batches([s], max_row_tokens=10_000)
            separate.append(policy(mb.input_ids_L, mb.position_ids_L, mb.gather_idx_N, mb.targets_N)[0])
        # The same numbers, straight from the HF logits: log p(token t+1 | tokens <= t) at action tokens.
        s0 = samples[0].trajectory
        logits = stock(input_ids=torch.from_numpy(s0.token_ids.astype(np.int64))[None]).logits[0]
        act = np.flatnonzero(s0.is_action)
        direct = torch.log_softmax(logits, -1)[act - 1, torch.from_numpy(s0.token_ids[act].astype(np.int64))]
    torch.testing.assert_close(lp_packed, torch.cat([separate[i] for i in packed_order(packed, samples)]),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(separate[0], direct, atol=1e-5, rtol=1e-5)


def packed_order(packed, samples):
    return [next(i for i, s in enumerate(samples) if s is ps) for ps in packed.samples]


def _shared_prefix_groups(prefix_len: int):
    """Two groups whose sequences all start with the same `prefix_len` tokens (a system prompt); within
    a group the question continues the shared prefix too, as in a GRPO group."""
    rng = np.random.default_rng(3)
    system = rng.integers(0, VOCAB, prefix_len)
    groups = []
    for g, turns in enumerate([[(5, 3), (4, 0)], [(3, 6), (6, 2), (2, 0)]]):
        group = make_group(f"g{g}", [1.0, 0.0, 0.5], prompt_len=prefix_len + 6, turns=turns, vocab_size=VOCAB, seed=g)
        question = rng.integers(0, VOCAB, 6)
        for t in group.trajectories:
            t.token_ids[:prefix_len] = system
            t.token_ids[prefix_len:prefix_len + 6] = question
        groups.append(group)
    return groups


@pytest.mark.parametrize("train_layers, dtype", [(1, torch.float32), (2, torch.float32), (1, torch.bfloat16)])
def test_shared_prefix_forward_gives_the_same_logprobs_and_gradients(train_layers, dtype):
    samples = _samples(_shared_prefix_groups(prefix_len=11))
    [mb] = build_micro_batches(samples, max_row_tokens=10_000)
    assert mb.shared_prefix_len == 11 and mb.num_seqs == 6
    [one_group] = build_micro_batches(samples[:3], max_row_tokens=10_000)
    assert one_group.shared_prefix_len == 17  # system prompt + the group's question
    # bf16: matmuls of different shapes round differently (prefix alone vs inside the row).
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    results = []
    for share in (False, True):
        model = tiny_llama(VOCAB, num_layers=3)
        set_trainable(model, train_layers, train_embeddings=False)
        policy = PackedPolicy(model, kernels="reference", compute_dtype=dtype)
        assert policy._frozen_bottom_layers() == 3 - train_layers
        logprobs, entropy, _ = policy(mb.input_ids_L, mb.position_ids_L, mb.gather_idx_N, mb.targets_N,
                                      shared_prefix_len=mb.shared_prefix_len if share else 0)
        (logprobs.sum() + entropy.sum()).backward()
        results.append((logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (plain_lp, plain_grads), (shared_lp, shared_grads) = results
    torch.testing.assert_close(shared_lp, plain_lp, **tol)
    assert shared_grads.keys() == plain_grads.keys() and plain_grads
    for name in plain_grads:
        torch.testing.assert_close(shared_grads[name], plain_grads[name], **tol, msg=name)


def test_shared_prefix_forward_when_a_sequence_is_the_prefix_plus_one_token():
    groups = _shared_prefix_groups(prefix_len=11)
    long, short = groups[0].trajectories[0], groups[0].trajectories[1]
    cut = 18  # a 17-token shared prompt (system + question) and one action token
    short.token_ids, short.is_action = short.token_ids[:cut].copy(), short.is_action[:cut].copy()
    short.is_action[-1] = 1
    short.behavior_logprobs, short.policy_versions = short.behavior_logprobs[:cut].copy(), short.policy_versions[:cut].copy()
    short.turns = [type(short.turns[0])(cut - 1, cut, cut, {})]
    samples = _samples([type(groups[0])("g", "t", [long, short])])
    [mb] = build_micro_batches(samples, max_row_tokens=10_000)
    assert mb.shared_prefix_len == cut - 1
    out = []
    for share in (False, True):
        model = tiny_llama(VOCAB, num_layers=3)
        set_trainable(model, 1, train_embeddings=False)
        policy = PackedPolicy(model, kernels="reference")
        with torch.no_grad():
            out.append(policy(mb.input_ids_L, mb.position_ids_L, mb.gather_idx_N, mb.targets_N,
                              shared_prefix_len=mb.shared_prefix_len if share else 0)[0])
    torch.testing.assert_close(out[1], out[0], atol=1e-5, rtol=1e-5)


def test_shared_prefix_is_not_used_for_unknown_model_types():
    model = tiny_llama(VOCAB, num_layers=3)
    set_trainable(model, 1, train_embeddings=False)
    model.config.model_type = "gemma"  # its forward scales the embedding: not the path we reproduce
    assert PackedPolicy(model, kernels="reference")._frozen_bottom_layers() == 0


def test_no_shared_prefix_when_sequences_differ_from_the_first_token():
    group = make_group("g", [1.0, 0.0], vocab_size=VOCAB)  # random prompts
    group.trajectories[1].token_ids[0] = (group.trajectories[0].token_ids[0] + 1) % VOCAB
    [mb] = build_micro_batches(_samples([group]), max_row_tokens=10_000)
    assert mb.shared_prefix_len == 0
    [single] = build_micro_batches(_samples([group])[:1], max_row_tokens=10_000)
    assert single.shared_prefix_len == 0


def test_observation_tokens_get_zero_gradient_and_loss_matches_masked_full_logits():
    torch.manual_seed(0)
    model = tiny_llama(VOCAB)
    policy = PackedPolicy(model, kernels="reference")
    rng = np.random.default_rng(1)
    trajs = [make_trajectory(prompt_len=4, turns=[(3, 5), (4, 3)], task_reward=r, sample_index=i, vocab_size=VOCAB,
                             behavior_logprob=-4.0, rng=rng) for i, r in enumerate([1.0, 0.0])]
    group = TrajectoryGroup("g", "t", trajs)
    advs = compute_advantages([group], RewardWeights(), AdvantageConfig("grpo"))[0]
    [mb] = build_micro_batches(_samples([group], [advs]), max_row_tokens=4096)

    captured = {}

    def keep(_module, _inp, out):
        out.retain_grad()
        captured["hidden"] = out

    handle = model.model.norm.register_forward_hook(keep)
    trainer = Trainer(policy, TrainerConfig(precision="fp32", kernels="reference",
                                            optimizer=OptimizerConfig(lr=1e-9, grad_clip=0.0)))
    trainer.rl_step([mb])
    handle.remove()
    grad_LH = captured["hidden"].grad[0]
    # Position i predicts token i + 1; the last position of each sequence predicts nothing.
    predicts_action_L = torch.from_numpy(
        np.concatenate([np.append(s.trajectory.is_action[1:], 0) for s in mb.samples]).astype(bool))
    assert (grad_LH[~predicts_action_L] == 0).all(), "a prompt/observation position received gradient"
    assert (grad_LH[predicts_action_L].abs().sum(-1) > 0).all()

    # The same gradient from the full [L, V] logits with the action mask applied by hand: ratio 1 at the
    # proximal point, so d loss = -sum_t A_t w_t d logp_t / num_action_tokens, w_t = min(exp(prox - behav), 2).
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    loss_terms, num_action = [], 0
    for s in mb.samples:
        traj = s.trajectory
        ids = torch.from_numpy(traj.token_ids.astype(np.int64))
        logp_TV = torch.log_softmax(model(input_ids=ids[None]).logits[0].float(), -1)
        act = torch.from_numpy(np.flatnonzero(traj.is_action))
        logp = logp_TV[act - 1, ids[act]]
        w = torch.exp(logp.detach() - torch.from_numpy(traj.behavior_logprobs)[act]).clamp(max=2.0)
        loss_terms.append(-(torch.from_numpy(s.advantages_T)[act] * w * logp).sum())
        num_action += len(act)
    (sum(loss_terms) / num_action).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


def _train(config, steps, samples, value_head=False, seed=0):
    model = tiny_llama(VOCAB, seed=seed)
    set_trainable(model, config.train_layers, config.train_embeddings)
    trainer = Trainer(PackedPolicy(model, kernels=config.kernels, value_head=value_head,
                                   compute_dtype=compute_dtype(config)), config)
    mbs = build_micro_batches(samples, config.max_row_tokens)
    return model, trainer, [trainer.rl_step(mbs) for _ in range(steps)], mbs


def _mean_logprob(trainer, mb):
    with torch.no_grad():
        lp, _, _ = trainer.policy(mb.input_ids_L, mb.position_ids_L, mb.gather_idx_N, mb.targets_N)
    return [float(lp[mb.seq_ids_N == s].mean()) for s in range(mb.num_seqs)]


@pytest.mark.parametrize("kernels", ["fused", "reference"])
def test_rl_step_raises_logprob_of_positive_advantage_sample(kernels):
    group = make_group("g", [1.0, 0.0], turns=[(6, 3), (5, 0)], vocab_size=VOCAB)
    advs = compute_advantages([group], RewardWeights(), AdvantageConfig("grpo"))[0]
    config = TrainerConfig(precision="fp32", kernels=kernels, optimizer=OptimizerConfig(lr=1e-2),
                           loss=PolicyLossConfig(is_cap=None))
    model, trainer, _, [mb] = _train(config, 0, _samples([group], [advs]))
    before = _mean_logprob(trainer, mb)
    stats = [trainer.rl_step([mb]) for _ in range(3)]
    after = _mean_logprob(trainer, mb)
    pos = next(i for i, s in enumerate(mb.samples) if s.trajectory.task_reward == 1.0)
    assert after[pos] > before[pos] and after[1 - pos] < before[1 - pos]
    assert stats[0].num_action_tokens == 22 and stats[0].num_seqs == 2
    assert {"clip_frac_low", "clip_frac_high", "is_trunc_frac", "entropy"} <= set(stats[0].kernel_stats)


def test_split_micro_batches_give_the_same_gradient_as_one():
    groups = [make_group(f"g{i}", [1.0, 0.0, 0.5], turns=[(6, 3), (5, 0)], vocab_size=VOCAB, seed=i) for i in range(2)]
    advs = compute_advantages(groups, RewardWeights(), AdvantageConfig("grpo"))
    samples = _samples(groups, advs)
    norms = []
    for row_tokens in (10_000, 30):
        config = TrainerConfig(precision="fp32", kernels="reference", max_row_tokens=row_tokens,
                               optimizer=OptimizerConfig(lr=1e-9, grad_clip=0.0))
        _, _, stats, mbs = _train(config, 1, samples)
        norms.append(stats[0].grad_norm)
        assert len(mbs) == (1 if row_tokens == 10_000 else 6)
    assert norms[0] == pytest.approx(norms[1], rel=1e-4)


def test_sft_lowers_nll_and_bf16_runs():
    group = make_group("gold", [1.0], turns=[(8, 2), (6, 0)], vocab_size=VOCAB)
    samples = _samples([group])
    for precision in ("fp32", "bf16"):
        model = tiny_llama(VOCAB)
        trainer = Trainer(PackedPolicy(model, compute_dtype=torch.bfloat16 if precision == "bf16" else torch.float32),
                          TrainerConfig(precision=precision, optimizer=OptimizerConfig(lr=3e-2)))
        mbs = build_micro_batches(samples, 4096)
        losses = [trainer.sft_step(mbs).loss for _ in range(8)]
        assert losses[-1] < losses[0] - 0.5, (precision, losses)


def test_gae_with_value_head_fits_values():
    group = make_group("g", [1.0, 0.0], turns=[(6, 3), (5, 0)], vocab_size=VOCAB)
    config = TrainerConfig(precision="fp32", advantage=AdvantageConfig("gae", lam=0.9),
                           optimizer=OptimizerConfig(lr=2e-2))
    samples = [Sample(group.group_id, t.sample_index, t, None, rewards_T=token_rewards(t, RewardWeights()))
               for t in group.trajectories]
    _, _, stats, _ = _train(config, 8, samples, value_head=True)
    assert stats[-1].kernel_stats["value_loss"] < 0.5 * stats[0].kernel_stats["value_loss"]


def test_top_k_layers_freeze_the_rest():
    group = make_group("g", [1.0, 0.0], turns=[(6, 3), (5, 0)], vocab_size=VOCAB)
    advs = compute_advantages([group], RewardWeights(), AdvantageConfig("grpo"))[0]
    config = TrainerConfig(precision="fp32", train_layers=1, train_embeddings=False,
                           optimizer=OptimizerConfig(lr=1e-2))
    before = tiny_llama(VOCAB).state_dict()
    model, _, _, _ = _train(config, 2, _samples([group], [advs]))
    after = model.state_dict()
    assert torch.equal(before["model.layers.0.mlp.up_proj.weight"], after["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])
    assert not torch.equal(before["model.layers.1.mlp.up_proj.weight"], after["model.layers.1.mlp.up_proj.weight"])


def test_nonfinite_gradient_skips_the_step_and_counts_it():
    """An infinite advantage makes the gradient norm non-finite: nothing is applied (weights, AdamW
    state and LR schedule untouched, gradients zeroed), the stats say so, and the next finite step
    trains as usual."""
    group = make_group("g", [1.0, 0.0], turns=[(6, 3), (5, 0)], vocab_size=VOCAB)
    advs = compute_advantages([group], RewardWeights(), AdvantageConfig("grpo"))[0]
    poisoned = [np.where(t.is_action, np.inf, 0.0).astype(np.float32) for t in group.trajectories]
    config = TrainerConfig(precision="fp32", kernels="reference", optimizer=OptimizerConfig(lr=1e-2))
    model, trainer, _, [bad_mb] = _train(config, 0, _samples([group], [poisoned]))
    [good_mb] = build_micro_batches(_samples([group], [advs]), config.max_row_tokens)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    skipped = trainer.rl_step([bad_mb])
    assert skipped.skipped and not np.isfinite(skipped.grad_norm) and trainer.num_skipped_steps == 1
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) and p.grad is None, name
    assert not trainer.optimizer.state and trainer.scheduler.last_epoch == 0
    applied = trainer.rl_step([good_mb])
    assert not applied.skipped and np.isfinite(applied.grad_norm) and trainer.num_skipped_steps == 1
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert trainer.scheduler.last_epoch == 1
