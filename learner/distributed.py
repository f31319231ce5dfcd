"""Data-parallel training with FSDP2 (`torch.distributed.fsdp.fully_shard`) under torchrun.

Layout: every decoder layer is its own FSDP unit (its parameters are gathered just before its
forward/backward and freed after), and the `PackedPolicy` is the root unit, holding the tied
embedding / LM head, the final norm and the value head; because the root's forward runs both the
decoder and `linear_logprob`, the LM head weight is unsharded exactly while the kernel reads it.
The optimizer is built after sharding, so each rank keeps the AdamW state of its shard only.

Data: each rank trains on its own share of the batch (`shard_samples`, balanced by tokens, whole
sequences); `Trainer.rl_step` normalises by the global token count and scales by the world size so
that FSDP's gradient averaging gives the single-process update. Every rank must run the same number
of micro-batch forwards (FSDP's collectives are per forward); `shard_samples` + the same
`max_row_tokens` does not guarantee that, so `equalise_micro_batches` splits rows until the counts
match (an extra forward on a small row costs little; a mismatch would hang).

Backend: gloo on CPU (tests: 2 processes), nccl where CUDA exists.

`python -m agentrl.learner.distributed --out FILE` (under torchrun) is the equivalence check the
tests run: one optimizer step on a fixed batch of a tiny model, sharded over the ranks, and the
loss, gradient norm and a checksum of the updated parameters written as JSON by rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence

import torch

from agentrl.learner.batching import MicroBatch, PackedPolicy, Sample, build_micro_batches, pack_first_fit


def init_distributed() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment; initialises the process group."""
    if "RANK" not in os.environ:
        raise RuntimeError("not started by torchrun (RANK unset); run: torchrun --nproc_per_node N ...")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    torch.distributed.init_process_group(backend)
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def shard_policy(policy: PackedPolicy) -> PackedPolicy:
    from torch.distributed.fsdp import fully_shard

    for layer in policy.lm.model.layers:
        fully_shard(layer)
    fully_shard(policy)
    return policy


def shard_samples(samples: Sequence[Sample], rank: int, world: int) -> list[Sample]:
    """Whole sequences to ranks, longest first onto the least-loaded rank (deterministic)."""
    loads = [0] * world
    owner = {}
    for i in sorted(range(len(samples)), key=lambda i: (-samples[i].num_tokens, i)):
        r = min(range(world), key=lambda r: (loads[r], r))
        owner[i] = r
        loads[r] += samples[i].num_tokens
    return [s for i, s in enumerate(samples) if owner[i] == rank]


def equalise_micro_batches(samples: list[Sample], max_row_tokens: int) -> list[MicroBatch]:
    """This rank's micro-batches, with rows split until every rank has the same number of them."""
    rows = pack_first_fit([s.num_tokens for s in samples], max_row_tokens)
    count = torch.tensor([len(rows)])
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
    while len(rows) < int(count):
        splittable = [r for r in rows if len(r) > 1]
        if not splittable:
            raise ValueError(f"this rank has {len(samples)} sequences but must run {int(count)} micro-batches; "
                             "give every rank at least as many sequences as the busiest rank has rows")
        row = max(splittable, key=lambda r: sum(samples[i].num_tokens for i in r))
        rows.remove(row)
        rows += [row[: len(row) // 2], row[len(row) // 2 :]]
    return build_micro_batches(samples, max_row_tokens, rows=rows)


def _check_batch(vocab_size: int):
    from agentrl.learner.advantages import AdvantageConfig, RewardWeights, compute_advantages
    from agentrl.learner.synthetic import make_group

    groups = [make_group(f"g{i}", [1.0, 0.0, 0.5, 0.0], turns=[(6 + i, 3), (5, 0)], vocab_size=vocab_size, seed=i)
              for i in range(2)]
    advs = compute_advantages(groups, RewardWeights(), AdvantageConfig("grpo"))
    return [Sample(g.group_id, t.sample_index, t, a) for g, ga in zip(groups, advs, strict=True)
            for t, a in zip(g.trajectories, ga, strict=True)]


def run_check_step(rank: int, world: int) -> dict:
    """One optimizer step on the fixed check batch; identical results expected for any world size."""
    from agentrl.learner.synthetic import tiny_llama
    from agentrl.learner.trainer import OptimizerConfig, Trainer, TrainerConfig

    vocab = 128
    policy = PackedPolicy(tiny_llama(vocab, seed=0), kernels="fused")
    if world > 1:
        shard_policy(policy)
    config = TrainerConfig(precision="fp32", max_row_tokens=64, optimizer=OptimizerConfig(lr=1e-2, grad_clip=0.0))
    trainer = Trainer(policy, config)
    samples = _check_batch(vocab)
    if world > 1:
        mbs = equalise_micro_batches(shard_samples(samples, rank, world), config.max_row_tokens)
    else:
        mbs = build_micro_batches(samples, config.max_row_tokens)
    stats = trainer.rl_step(mbs)
    checksum = 0.0
    for name, p in sorted(policy.named_parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        checksum += float(full.detach().double().abs().sum()) * (1 + len(name) % 7)
    return {"loss": stats.loss, "grad_norm": stats.grad_norm, "num_action_tokens": stats.num_action_tokens,
            "param_checksum": checksum, "world": world}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="FSDP2 equivalence check (run under torchrun)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    rank, world = init_distributed()
    try:
        result = run_check_step(rank, world)
        if rank == 0:
            with open(args.out, "w") as f:
                json.dump(result, f)
    finally:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
