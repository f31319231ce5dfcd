"""The FSDP2 equivalence check, run under torchrun by tests/test_learner_fsdp.py:

    torchrun --nproc_per_node 2 tests/support/fsdp_check.py --out FILE

One optimizer step on each fixed batch (`CHECK_BATCHES`) of a tiny model, sharded over the ranks;
rank 0 writes the loss, gradient norm, a checksum of the updated parameters and of the weights the
service would publish as JSON, to compare with `run_check_step(rank=0, world=1)` in one process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a script by torchrun (with -P: the tests folder is not on sys.path)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentrl.learner.batching import PackedPolicy, Sample, build_micro_batches  # noqa: E402
from agentrl.learner.distributed import (  # noqa: E402
    close_distributed,
    end_rank,
    equalise_micro_batches,
    full_state,
    init_distributed,
    shard_policy,
    shard_samples,
)
from agentrl.learner.trainer_config import LoraConfig  # noqa: E402

CHECK_BATCHES = ("groups", "uneven")
"""The check batches: "groups" = 2 GRPO groups of 4 short sequences (each rank gets 4, rows split
to match); "uneven" = 3 sequences of 60, 50 and 40 tokens with rows of 64: rank 0 gets the 60 (one
row, not splittable) and rank 1 the other two (two rows), so rank 0 runs a padding row."""


def _check_batch(vocab_size: int, kind: str) -> list[Sample]:
    import numpy as np

    from agentrl.learner.advantages import AdvantageConfig, compute_advantages
    from agentrl.learner.rewards import RewardWeights
    from support.synthetic import make_group, make_trajectory

    if kind == "uneven":
        rng = np.random.default_rng(0)
        layouts = [((30, 10), 1.0), ((25, 5), -1.0), ((16, 4), 0.5)]
        trajs = [make_trajectory(prompt_len=8, turns=[first, (12, 0)], task_reward=r, group_id=f"u{i}",
                                 vocab_size=vocab_size, rng=rng) for i, (first, r) in enumerate(layouts)]
        return [Sample(t.group_id, 0, t, t.is_action.astype(np.float32) * t.task_reward) for t in trajs]
    groups = [make_group(f"g{i}", [1.0, 0.0, 0.5, 0.0], turns=[(6 + i, 3), (5, 0)], vocab_size=vocab_size, seed=i)
              for i in range(2)]
    advs = compute_advantages(groups, RewardWeights(), AdvantageConfig("grpo"))
    return [Sample(g.group_id, t.sample_index, t, a) for g, ga in zip(groups, advs, strict=True)
            for t, a in zip(g.trajectories, ga, strict=True)]


CHECK_LORA = LoraConfig(rank=4, alpha=8.0)
"""The LoRA check ("lora-groups"): peft adapters on both layers, every weight frozen."""


def run_check_step(rank: int, world: int, batch: str = "groups", *, lora: bool = False) -> dict:
    """One optimizer step on a fixed check batch; identical results expected for any world size.
    `lora`: the adapters train (learner/lora.py), their B initialised non-zero so A gets a gradient too."""
    from agentrl.learner.lora import apply_lora
    from agentrl.learner.trainer import Trainer
    from agentrl.learner.trainer_config import OptimizerConfig, TrainerConfig
    from support.synthetic import tiny_llama

    vocab = 128
    model = tiny_llama(vocab, seed=0)
    if lora:
        torch.manual_seed(0)
        apply_lora(model, CHECK_LORA, "all")
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    policy = PackedPolicy(model, kernels="fused")
    if world > 1:
        shard_policy(policy, torch.device("cpu"))  # a CPU check on any host (torch's default mesh is CUDA where CUDA exists)
    config = TrainerConfig(precision="fp32", max_row_tokens=64, optimizer=OptimizerConfig(lr=1e-2, grad_clip=0.0),
                           lora=CHECK_LORA if lora else LoraConfig(), train_embeddings=not lora)
    trainer = Trainer(policy, config)
    samples = _check_batch(vocab, batch)
    if world > 1:
        mbs = equalise_micro_batches(shard_samples(samples, rank, world), config.max_row_tokens)
    else:
        mbs = build_micro_batches(samples, config.max_row_tokens)
    stats = trainer.rl_step(mbs)
    checksum = 0.0
    for name, p in sorted(policy.named_parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        checksum += float(full.detach().double().abs().sum()) * (1 + len(name) % 7)
    # What the service would publish: the gathered full state, renamed, against the unsharded snapshot.
    from agentrl.learner.lora import adapter_tensors, snapshot_adapter
    from agentrl.learner.publish import snapshot_from_policy_state, snapshot_weights

    if world > 1:
        policy_state, _ = full_state(policy)  # collective: every rank gathers, rank 0 keeps the tensors
        snapshot = (adapter_tensors(policy_state, prefix="lm.", dtype=torch.float32) if lora
                    else snapshot_from_policy_state(policy_state, tied=True))
    else:
        snapshot = snapshot_adapter(policy.lm, torch.float32) if lora else snapshot_weights(policy.lm)
    snapshot_checksum = sum(float(t.double().abs().sum()) * (1 + len(k) % 7) for k, t in snapshot.items())
    num_padding = torch.tensor([sum(1 for mb in mbs if not mb.samples)])
    if world > 1:
        torch.distributed.all_reduce(num_padding)
    return {"loss": stats.loss, "grad_norm": stats.grad_norm, "num_action_tokens": stats.num_action_tokens,
            "param_checksum": checksum, "world": world, "num_padding_rows": int(num_padding),
            "snapshot_keys": sorted(snapshot), "snapshot_checksum": snapshot_checksum}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="FSDP2 equivalence check (run under torchrun)")
    parser.add_argument("--out", required=True, help="JSON file: {batch name: result} for every check batch")
    args = parser.parse_args(argv)
    rank, world = init_distributed(timeout_s=120.0)  # a check that hangs fails in 2 minutes
    completed = False
    try:
        result = {batch: run_check_step(rank, world, batch) for batch in CHECK_BATCHES}
        result["lora-groups"] = run_check_step(rank, world, "groups", lora=True)
        if rank == 0:
            with open(args.out, "w") as f:
                json.dump(result, f)
        completed = True
    finally:
        close_distributed(completed)
    end_rank(0)


if __name__ == "__main__":
    raise SystemExit(main())
