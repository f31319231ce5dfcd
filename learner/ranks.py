"""The rank protocol: what a learner step does in one process, and the same under torchrun.

The learner's loop (`service.Learner`) talks to one of two objects with the same methods and never
asks whether it is distributed:

- `Solo`: one process. It builds the trainer, restores, steps, snapshots and checkpoints here and
  now.
- `Leader`: rank 0 under torchrun (FSDP2, `distributed.py`). Each of the same methods first
  announces itself to the other ranks (`RankGroup.send`), then runs as a collective: every rank
  builds the same sharded trainer, rank 0 sends each rank its share of the batch
  (`shard_samples`: whole sequences, balanced by tokens) and all run the step on equal micro-batch
  counts; snapshots and checkpoints gather full state dicts to rank 0. While rank 0 waits on the
  outside world (data, a weight push) it sends a heartbeat every `dist_timeout_s / 4`, so the
  others' wait for the next command never trips the process group's timeout.
- `follow` is the loop of every other rank: build and restore with rank 0, then run rank 0's
  commands in the order it sends them, so every collective is entered in the same order everywhere.

Only rank 0 talks to the outside world (receiver, spool, ledger, pushes, metrics, checkpoint
files); see service.py for the shutdown and failure rules.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentrl.learner.anchor import Anchor
from agentrl.learner.batching import PackedPolicy, Sample, build_micro_batches
from agentrl.learner.checkpoint import (
    load_latest_checkpoint,
    policy_weights,
    rng_state,
    set_rng_state,
    world_size_mismatch,
)
from agentrl.learner.config import LearnerConfig
from agentrl.learner.distributed import (
    RankGroup,
    equalise_micro_batches,
    full_state,
    load_full_state,
    num_padding_rows,
    shard_policy,
    shard_samples,
)
from agentrl.learner.ledger import Ledger
from agentrl.learner.lora import adapter_tensors, apply_lora, snapshot_adapter
from agentrl.learner.publish import snapshot_from_policy_state, snapshot_weights
from agentrl.learner.trainer import StepStats, Trainer, compute_dtype, on_device, set_trainable


@dataclass
class Restored:
    """Where a learner starts: its version and, when resumed from its own checkpoint, its ledger."""

    step: int
    ledger: Ledger | None
    how: str
    """"fresh", "resumed" or "initialised" (from another learner's checkpoint)."""


def build_trainer(config: LearnerConfig, device: torch.device, *, shard: bool) -> tuple[Trainer, torch.nn.Module]:
    """(trainer, causal LM) on `device`, FSDP-sharded over the ranks when `shard`."""
    from transformers import AutoModelForCausalLM

    from agentrl.common.model import resolve_model

    def load():
        model = AutoModelForCausalLM.from_pretrained(resolve_model(config.model_dir), dtype=torch.float32)
        model.config._attn_implementation = "sdpa"
        return model

    tcfg = config.trainer
    torch.manual_seed(config.seed)
    model = load()
    if tcfg.lora.enabled:  # adapters train, every weight is frozen (learner/lora.py)
        apply_lora(model, tcfg.lora, tcfg.train_layers)
    else:
        set_trainable(model, tcfg.train_layers, tcfg.train_embeddings)
    value_head = tcfg.advantage.estimator == "gae" and config.mode == "rl"
    policy = PackedPolicy(model, value_head=value_head, kernels=tcfg.kernels, compute_dtype=compute_dtype(tcfg, device.type))
    # Onto the device before sharding (FSDP shards what is on the mesh's device) and before the
    # optimizer exists (AdamW's state follows its parameters; each rank's covers its shard only).
    policy.to(device)
    if shard:
        shard_policy(policy, device)
    reference = None
    if config.kl_reference:
        frozen = load()
        if tcfg.lora.enabled:  # the same modules as the policy, so that an SFT checkpoint's state loads
            apply_lora(frozen, tcfg.lora, tcfg.train_layers)
        reference = PackedPolicy(frozen.requires_grad_(False).eval(), kernels=tcfg.kernels,
                                 compute_dtype=compute_dtype(tcfg, device.type))
        if config.init_checkpoint:
            # The KL anchor is the policy RL starts from (the SFT checkpoint), not the base model;
            # every rank reads it (the reference is not sharded), also after a resume.
            start = _init_state(Path(config.init_checkpoint), set(reference.state_dict()))
            reference.load_state_dict(start["policy"])
        reference.to(device)
    return Trainer(policy, tcfg, reference=reference), model


def _init_state(checkpoints: Path, expected_keys: set[str]) -> dict[str, Any]:
    """Policy weights and version of another learner's latest checkpoint (`init_checkpoint`)."""
    state = load_latest_checkpoint(checkpoints)
    if state is None:
        raise FileNotFoundError(f"init_checkpoint {checkpoints} holds no checkpoint")
    weights = policy_weights(state)
    if set(weights) != expected_keys:
        raise ValueError(f"init_checkpoint {checkpoints} does not fit this model: missing "
                         f"{sorted(expected_keys - set(weights))[:5]}, unexpected {sorted(set(weights) - expected_keys)[:5]}")
    return {"policy": weights, "step": int(state["step"])}


class Solo:
    """One learner process."""

    world = 1
    heartbeat_s: float | None = None
    """How often the loop must call `heartbeat` while it waits (None: never)."""

    def __init__(self, config: LearnerConfig, device: torch.device):
        self.config = config
        self.device = device

    def build(self) -> None:
        self.trainer, self.model = build_trainer(self.config, self.device, shard=False)
        cfg = self.config
        self.anchor = (Anchor.from_dir(cfg.anchor_dir, vocab_size=self.vocab_size, tokens_per_step=cfg.anchor.tokens_per_step,
                                       seed=cfg.seed) if cfg.anchor.coef > 0 else None)

    @property
    def vocab_size(self) -> int:
        """Token ids the policy's embedding takes: [0, vocab_size) (the receiver refuses others)."""
        return int(self.model.config.vocab_size)

    def _policy_keys(self) -> set[str]:
        return {k for k in self.trainer.policy.state_dict() if not k.startswith("value_head.")}

    def restore(self, checkpoints: Path) -> Restored:
        restored = self._restore(checkpoints)
        if self.anchor is not None:  # a restarted learner takes a new order, not the first steps' again
            self.anchor.restart(restored.step)
        return restored

    def _restore(self, checkpoints: Path) -> Restored:
        state = load_latest_checkpoint(checkpoints)
        if state is None:
            init = self.config.init_checkpoint
            if not init:
                return Restored(0, None, "fresh")
            start = _init_state(Path(init), self._policy_keys())
            self.trainer.policy.load_state_dict(start["policy"], strict=False)
            return Restored(start["step"], None, "initialised")
        written_by = int(state.get("world_size", 1))
        if written_by != 1:
            raise RuntimeError(world_size_mismatch(checkpoints, written_by, 1))
        # The state is on the CPU: load_state_dict copies it into the parameters where they are,
        # and the optimizer casts its moments to each parameter's device.
        self.trainer.policy.load_state_dict(state["policy"])
        self.trainer.optimizer.load_state_dict(state["optimizer"])
        self.trainer.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"], self.device)
        return Restored(int(state["step"]), Ledger.from_dict(state["ledger"]), "resumed")

    @on_device  # runs on a worker thread (on_device's docstring)
    def step(self, samples: list[Sample]) -> tuple[StepStats, int]:
        """One optimizer step on `samples` (and the anchor's demonstrations); (stats, micro-batches)."""
        max_row_tokens = self.config.trainer.max_row_tokens
        anchor = build_micro_batches(self.anchor.next_samples(), max_row_tokens) if self.anchor is not None else []
        return self.train_micro_batches(build_micro_batches(samples, max_row_tokens), anchor)

    @on_device
    def train_micro_batches(self, micro_batches, anchor=()) -> tuple[StepStats, int]:
        """One optimizer step on this rank's micro-batches (collective under torchrun)."""
        trainer = self.trainer
        if self.config.mode == "sft":
            stats = trainer.sft_step(micro_batches)
        else:
            stats = trainer.rl_step(micro_batches, anchor=anchor, anchor_coef=self.config.anchor.coef)
        return stats, len(micro_batches)

    @on_device
    def snapshot(self) -> dict[str, torch.Tensor] | None:
        """The weights to publish (checkpoint names, in the dtype the learner computes in: bf16
        where the hardware runs it natively, else float32, which the server then serves); with
        LoRA, the adapter only (learner/lora.py)."""
        dtype = self.trainer.policy.compute_dtype
        if self.config.trainer.lora.enabled:
            return snapshot_adapter(self.model, dtype)
        return snapshot_weights(self.model, dtype=dtype)

    def checkpoint_state(self) -> dict[str, Any] | None:
        """Model, optimizer and RNG state for a checkpoint (None on ranks that do not write it)."""
        return {"policy": self.trainer.policy.state_dict(), "optimizer": self.trainer.optimizer.state_dict(),
                "rng": rng_state(self.device)}

    def heartbeat(self) -> None:
        """Nothing to keep alive in one process."""

    async def keepalive(self, awaitable):
        """Await something slow (a push, a server query)."""
        return await awaitable

    def stop(self) -> None:
        """Nothing to release in one process."""


class Leader(Solo):
    """Rank 0 under torchrun: every operation announced to the other ranks and run collectively."""

    def __init__(self, config: LearnerConfig, device: torch.device, group: RankGroup):
        super().__init__(config, device)
        self.group = group
        self.world = group.world
        self.heartbeat_s = config.dist_timeout_s / 4

    def build(self) -> None:
        self.trainer, self.model = build_trainer(self.config, self.device, shard=True)
        self.anchor = None  # service.main refuses anchor.coef > 0 under torchrun, before the ranks start

    def restore(self, checkpoints: Path) -> Restored:
        return restore_collective(self, checkpoints)

    @on_device
    def step(self, samples: list[Sample]) -> tuple[StepStats, int]:
        max_row_tokens = self.config.trainer.max_row_tokens
        shares = [shard_samples(samples, r, self.world) for r in range(self.world)]
        self._check_padding(shares)
        self.group.send("step", None)
        return self.train_micro_batches(equalise_micro_batches(self.group.scatter(shares), max_row_tokens))

    def _check_padding(self, shares: list[list[Sample]]) -> None:
        """Padding rows (a rank with fewer sequences than another rank's rows) are exact for the
        token-mean and constant aggregations and for SFT; 'seq_mean' would count each as a sequence
        and GAE's value loss is undefined on zero tokens, so those fail here, before any rank moves."""
        cfg = self.config.trainer
        if self.config.mode == "sft" or (cfg.loss.agg != "seq_mean" and cfg.advantage.estimator != "gae"):
            return
        num_padding = num_padding_rows(shares, cfg.max_row_tokens)
        if num_padding:
            raise ValueError(
                f"this batch leaves a rank with fewer sequences than another rank's micro-batches ({num_padding} "
                f"padding rows needed), which loss.agg={cfg.loss.agg!r} / advantage.estimator="
                f"{cfg.advantage.estimator!r} cannot take under torchrun: raise tokens_per_step or max_row_tokens, "
                "use fewer ranks, or loss.agg = 'token_mean'")

    @on_device
    def snapshot(self) -> dict[str, torch.Tensor] | None:
        self.group.send("snapshot")
        return gather_snapshot(self)

    def checkpoint_state(self) -> dict[str, Any] | None:
        self.group.send("checkpoint")
        return gather_checkpoint(self)

    def heartbeat(self) -> None:
        self.group.send("heartbeat")

    async def keepalive(self, awaitable):
        """Await on rank 0 while the other ranks wait in a collective: a heartbeat every `heartbeat_s`."""
        task = asyncio.ensure_future(awaitable)
        while True:
            done, _ = await asyncio.wait({task}, timeout=self.heartbeat_s)
            if done:
                return task.result()
            self.heartbeat()

    def stop(self) -> None:
        """Release the other ranks (last: a heartbeat after it would wait for ranks that have left)."""
        self.group.send("stop")


def restore_collective(node: Solo, checkpoints: Path, group: RankGroup | None = None) -> Restored:
    """`restore` under torchrun (collective, on every rank): rank 0 reads the checkpoint and
    broadcasts it. Checkpoints are full (gathered to rank 0), so a resume must use the world size
    that wrote them: the optimizer state is stored by parameter name here and by index in one
    process. A different world size fails with the fix in the message."""
    group = group or node.group
    leader = group.is_leader
    plan: dict[str, Any] = {"kind": "fresh"}
    state: dict[str, Any] | None = None
    if leader:
        state = load_latest_checkpoint(checkpoints)
        if state is not None:
            written_by = int(state.get("world_size", 1))
            if written_by != group.world:
                plan = {"kind": "error", "message": world_size_mismatch(checkpoints, written_by, group.world)}
            else:
                plan = {"kind": "resume", "scheduler": state["scheduler"], "step": int(state["step"])}
        elif node.config.init_checkpoint:
            state = _init_state(Path(node.config.init_checkpoint), node._policy_keys())
            plan = {"kind": "init", "step": int(state["step"])}
    plan = group.broadcast(plan)
    if plan["kind"] == "error":
        raise RuntimeError(plan["message"])
    if plan["kind"] == "fresh":
        return Restored(0, None, "fresh")
    trainer = node.trainer
    if plan["kind"] == "init":
        load_full_state(trainer.policy, state["policy"] if leader else {}, strict=False)
        return Restored(plan["step"], None, "initialised")
    load_full_state(trainer.policy, state["policy"] if leader else {}, trainer.optimizer, state["optimizer"] if leader else {})
    trainer.scheduler.load_state_dict(plan["scheduler"])
    set_rng_state(group.scatter(state["rng_ranks"] if leader else None), node.device)
    return Restored(plan["step"], Ledger.from_dict(state["ledger"]) if leader else None, "resumed")


def gather_snapshot(node: Solo, group: RankGroup | None = None) -> dict[str, torch.Tensor] | None:
    """Collective: every rank takes part in gathering the full state dict; rank 0 gets the bf16
    snapshot, the others None."""
    group = group or node.group
    policy_state, _ = full_state(node.trainer.policy)
    if not group.is_leader:
        return None
    if node.config.trainer.lora.enabled:
        return adapter_tensors(policy_state, prefix="lm.", dtype=node.trainer.policy.compute_dtype)
    return snapshot_from_policy_state(policy_state, tied=bool(getattr(node.model.config, "tie_word_embeddings", False)),
                                      dtype=node.trainer.policy.compute_dtype)


def gather_checkpoint(node: Solo, group: RankGroup | None = None) -> dict[str, Any] | None:
    """Collective: the full checkpoint state on rank 0 in the one-process layout, plus `world_size`
    and every rank's RNG state; None elsewhere. Full rather than sharded (one file per rank): the
    policies trained here (135M parameters: 0.5 GB of weights, 1 GB of AdamW state in fp32) fit one
    host's memory, the checkpoint stays one atomic folder with the ledger beside the weights, and
    the policy state keeps the one-process keys (an init_checkpoint works across world sizes)."""
    group = group or node.group
    policy_state, optim_state = full_state(node.trainer.policy, node.trainer.optimizer)
    rngs = group.gather(rng_state(node.device))
    if not group.is_leader:
        return None
    return {"policy": policy_state, "optimizer": optim_state, "rng": rngs[0], "rng_ranks": rngs, "world_size": group.world}


def follow(config: LearnerConfig, device: torch.device, group: RankGroup) -> int:
    """The loop of a rank other than 0 under torchrun: build the same sharded trainer, restore with
    rank 0, then run the collectives rank 0 announces until it sends "stop".

    SIGTERM/SIGINT are deferred to rank 0: torchrun forwards a SIGTERM to every rank at once, and
    rank 0 needs the others alive to gather the checkpoint it writes before stopping. If rank 0 is
    gone instead, the next collective fails (connection closed, or `dist_timeout_s`)."""
    def defer(signum: int, _frame: Any) -> None:
        print(f"learner rank {group.rank}: {signal.Signals(signum).name} received; rank 0 decides when to stop",
              file=sys.stderr, flush=True)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, defer)
    node = Solo(config, device)
    node.trainer, node.model = build_trainer(config, device, shard=True)
    restore_collective(node, Path(config.output_dir) / "checkpoints", group)
    max_row_tokens = config.trainer.max_row_tokens
    commands = {
        "heartbeat": lambda payload: None,
        "step": lambda payload: node.train_micro_batches(equalise_micro_batches(group.scatter(None), max_row_tokens)),
        "snapshot": lambda payload: gather_snapshot(node, group),
        "checkpoint": lambda payload: gather_checkpoint(node, group),
    }
    while True:
        op, payload = group.recv()
        if op == "stop":
            break
        if op not in commands:
            raise RuntimeError(f"rank {group.rank}: unknown command {op!r} from rank 0")
        commands[op](payload)
    print(f"learner rank {group.rank}: stopped at rank 0's request", file=sys.stderr, flush=True)
    return 0
