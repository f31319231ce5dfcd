"""Build valid `Trajectory` / `TrajectoryGroup` records from a turn layout, for tests and benchmarks.

The records pass `Trajectory.validate`; they are what the orchestrator would emit for the given
token layout (prompt, then per turn an action and an observation), with random token ids. They are
not a stand-in for the engine: the tests that need real episodes use the real orchestrator.
"""

from __future__ import annotations

import numpy as np

from agentrl.common.trajectory import Trajectory, TrajectoryGroup, Turn


def make_trajectory(
    *,
    prompt_len: int,
    turns: list[tuple[int, int]],
    task_reward: float,
    process_rewards: list[dict[str, float]] | None = None,
    group_id: str = "g0",
    sample_index: int = 0,
    vocab_size: int = 100,
    policy_version: int = 0,
    behavior_logprob: float = -1.0,
    status: str = "ok",
    rng: np.random.Generator | None = None,
) -> Trajectory:
    """`turns` is [(num_action_tokens, num_observation_tokens), ...] after the prompt."""
    rng = rng if rng is not None else np.random.default_rng(0)
    num_tokens = prompt_len + sum(a + o for a, o in turns)
    is_action_T = np.zeros(num_tokens, dtype=np.uint8)
    turn_records = []
    pos = prompt_len
    for i, (num_action, num_obs) in enumerate(turns):
        is_action_T[pos : pos + num_action] = 1
        rewards = process_rewards[i] if process_rewards is not None else {}
        turn_records.append(Turn(pos, pos + num_action, pos + num_action + num_obs, dict(rewards)))
        pos += num_action + num_obs
    action = is_action_T.astype(bool)
    traj = Trajectory(
        task_id="t-" + group_id,
        group_id=group_id,
        sample_index=sample_index,
        token_ids=rng.integers(0, vocab_size, num_tokens).astype(np.int32),
        is_action=is_action_T,
        behavior_logprobs=np.where(action, behavior_logprob, 0.0).astype(np.float32),
        policy_versions=np.where(action, policy_version, -1).astype(np.int32),
        prompt_len=prompt_len,
        turns=turn_records,
        task_reward=float(task_reward),
        status=status,  # type: ignore[arg-type]
    )
    traj.validate()
    return traj


def make_group(
    group_id: str,
    task_rewards: list[float],
    *,
    prompt_len: int = 8,
    turns: list[tuple[int, int]] | None = None,
    vocab_size: int = 100,
    policy_version: int = 0,
    seed: int = 0,
) -> TrajectoryGroup:
    """A group of len(task_rewards) samples with the same turn layout and random token ids."""
    rng = np.random.default_rng(seed)
    turns = turns if turns is not None else [(6, 4), (5, 0)]
    trajs = [
        make_trajectory(
            prompt_len=prompt_len, turns=turns, task_reward=r, group_id=group_id, sample_index=i,
            vocab_size=vocab_size, policy_version=policy_version, rng=rng,
        )
        for i, r in enumerate(task_rewards)
    ]
    return TrajectoryGroup(group_id=group_id, task_id="t-" + group_id, trajectories=trajs)


def tiny_llama(vocab_size: int = 128, num_layers: int = 2, hidden_size: int = 32, seed: int = 0):
    """A randomly initialised Llama causal LM with tied embeddings (SmolLM2's layout, tiny sizes)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)
