"""The learner process: receive groups, train, publish weights and versions, checkpoint.

One step of the loop (`Learner.run`), in order:
1. wait for data: take groups (replayed spool first, then the socket) until the step's token budget
   is reached; each new group is spooled and acknowledged at once (`ledger.py` for why that is
   exactly-once), duplicates are acknowledged and skipped;
2. off-policy control: drop trajectories whose oldest action token is more than `staleness_bound`
   versions behind the learner (counted and reported), record the staleness histogram;
3. advantages (reward schedule weights at this step), dynamic sampling, packing, one optimizer step
   on a worker thread (the event loop stays free for the background weight push and the sockets);
4. ledger update, metrics line;
5. every `publish_every` steps: snapshot the weights and push them to every vLLM server in the
   background (`publish.py`); publish (version, served_version) to the orchestrator;
6. every `checkpoint_every` steps, on SIGTERM and at the end: atomic checkpoint.

Versions: the learner's version is its optimizer step count (0 = the initial weights, which a
fresh server serves). A token sampled under version v is (version - v) steps stale at training time.

Shutdown: SIGTERM (or SIGINT) sets a flag that is checked between steps and interrupts a wait for
data; the learner then writes a checkpoint, waits for the push in flight (bounded) and exits 0.

Under torchrun (data parallel, FSDP2; `distributed.py`):

    torchrun --nproc_per_node 2 -m agentrl.cli learner --config learner.toml

(the same config file; `python -P -m torch.distributed.run ...` is the same launcher). Without
torchrun, or under torchrun with a world size of 1, the learner is the one process above.
- Rank 0 alone talks to the outside world: the GroupReceiver (spool, acks, dedup), the ledger, the
  version publisher, the pushes to vLLM, metrics and the checkpoint files. It forms each batch
  exactly as one process does (same budget, staleness filter, advantages), then sends every rank
  its share (`shard_samples`: whole sequences, balanced by tokens) with a "step" command; all ranks
  run `Trainer.rl_step` / `sft_step` on their share with equal micro-batch counts, and the
  gradients average to the one-process update (`tests/test_learner_distributed_service.py`
  compares every step's loss with a one-process run of the same groups).
- The other ranks run `Learner.follow`: they build the same sharded trainer and execute rank 0's
  commands (step, snapshot, checkpoint, heartbeat, stop) in the order it sends them, so every
  collective is entered in the same order everywhere.
- Publishing: rank 0 announces a snapshot, every rank takes part in gathering the full state dict
  (`get_model_state_dict(full_state_dict=True, cpu_offload=True)`), rank 0 casts it to bf16 and
  pushes it in the background as in one process.
- Checkpoints are full, written by rank 0 (see `_checkpoint_sharded` for why not sharded): model,
  optimizer (gathered by parameter name), scheduler, every rank's RNG, step, version, ledger. They
  resume under the same world size; another world size is refused with the fix in the message
  (the weights carry over to any world size through `init_checkpoint`).
- Shutdown: a SIGTERM to the launcher reaches every rank; ranks other than 0 ignore it and keep
  serving rank 0, which checkpoints (a collective) and then sends "stop", so all exit 0 within
  torchrun's `--shutdown-timeout` (30 s by default; beyond it torchrun kills them and the last
  checkpoint plus the spool still give exactly-once). A SIGTERM to rank 0 alone does the same.
- A dead or hung rank: the process group has a timeout (`dist_timeout_s`); rank 0 sends a
  heartbeat every quarter of it while it waits for data or for a push, so the other ranks' wait
  for the next command never trips it while rank 0 lives. If a peer dies, the next collective
  fails (at once when the connection closes, else after `dist_timeout_s`) and the rank exits
  non-zero; torchrun stops the rest. Nothing acknowledged is lost: it is in rank 0's spool.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from agentrl.common.config import from_dict
from agentrl.common.trajectory import TrajectoryGroup
from agentrl.engine.rewards import RewardSchedule
from agentrl.learner.advantages import RewardWeights, compute_advantages, filter_groups
from agentrl.learner.batching import PackedPolicy, Sample, build_micro_batches
from agentrl.learner.distributed import (
    RankGroup,
    equalise_micro_batches,
    full_state,
    init_distributed,
    launched_world_size,
    load_full_state,
    num_padding_rows,
    shard_policy,
    shard_samples,
)
from agentrl.learner.ledger import (
    Ledger,
    Spool,
    load_latest_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from agentrl.learner.metrics import MetricsWriter
from agentrl.learner.publish import WeightPublisher, snapshot_from_policy_state, snapshot_weights
from agentrl.learner.trainer import StepStats, Trainer, TrainerConfig, on_device, set_trainable


@dataclass
class LearnerConfig:
    output_dir: str
    """Folder for metrics.jsonl, tensorboard/, checkpoints/ and spool/ (created)."""
    model_dir: str | None = None
    """Hugging Face model folder; None = the prepared SmolLM2-135M-Instruct (agentrl.common.model)."""
    mode: Literal["rl", "sft"] = "rl"
    """"rl": the policy-gradient loss; "sft": masked NLL on the action tokens of (gold) trajectories."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tokens_per_step: int = 8192
    """Token budget of one optimizer step (prompt + observation + action tokens of whole groups)."""
    max_steps: int = 100
    """Stop after this many optimizer steps (counted across restarts)."""
    staleness_bound: int | None = 4
    """Drop trajectories with an action token more than this many versions behind; None = keep all."""
    publish_every: int = 1
    """Push weights to the servers every this many optimizer steps (0 = never)."""
    kv_refresh_every: int = 1
    """Every this many pushes the servers drop their KV and prefix caches, so running requests
    recompute their contexts under the new weights; the pushes in between keep the keys and values
    computed so far (far less work for a CPU server; the behavior log-probs still describe what
    sampled, but reused keys may be up to kv_refresh_every - 1 versions older than the version
    labels say). 1 = every push (exact). agentrl/common/weights.py, step 3."""
    checkpoint_every: int = 10
    """Checkpoint every this many optimizer steps (also on SIGTERM and at the end)."""
    keep_checkpoints: int = 2
    """Number of newest checkpoints kept on disk."""
    group_endpoint: str = "tcp://127.0.0.1:5555"
    """ZeroMQ endpoint the learner binds to receive trajectory groups."""
    version_endpoint: str | None = "tcp://127.0.0.1:5556"
    """ZeroMQ endpoint the learner binds to publish its version (None = do not publish)."""
    server_urls: list[str] = field(default_factory=list)
    """vLLM server base URLs to push weights to."""
    reward_schedule: RewardSchedule = field(default_factory=RewardSchedule)
    """Process/task reward weights by optimizer step."""
    init_checkpoint: str | None = None
    """A checkpoints folder (another learner's `output_dir/checkpoints`) whose latest policy weights
    and version this learner starts from when its own output_dir holds no checkpoint yet: the RL
    phase starting from the SFT cold start. Optimizer, scheduler and ledger start fresh."""
    kl_reference: bool = False
    """Load a frozen copy of the initial weights as KL reference (needs trainer.loss.kl_coef > 0)."""
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the policy (and value head, KL reference) trains: "auto" = "cuda" when torch sees a
    GPU, else "cpu". On CUDA each torchrun rank uses cuda:{LOCAL_RANK} (one process per GPU), one
    process cuda:0 of what CUDA_VISIBLE_DEVICES shows. Checkpoints and published weights are CPU
    tensors either way. "cuda" without a GPU fails at start (`resolve_device`)."""
    dist_timeout_s: float = 600.0
    """Under torchrun: the longest any collective may wait for another rank (s); a rank whose peer
    died or hangs fails after at most this. Rank 0 sends a heartbeat every quarter of it while it
    waits for data, so an idle learner does not trip it."""
    tensorboard: bool = True
    progress_bar: bool = True

    def __post_init__(self) -> None:
        if self.tokens_per_step <= 0:
            raise ValueError(f"tokens_per_step={self.tokens_per_step} must be > 0")
        if self.checkpoint_every <= 0:
            raise ValueError(f"checkpoint_every={self.checkpoint_every} must be > 0")
        if self.publish_every < 0:
            raise ValueError(f"publish_every={self.publish_every} must be >= 0")
        if self.kv_refresh_every < 1:
            raise ValueError(f"kv_refresh_every={self.kv_refresh_every} must be >= 1 (1 = drop the servers' KV on every push)")
        if self.publish_every and not self.server_urls:
            raise ValueError("publish_every > 0 needs server_urls (the vLLM servers to push to); or set publish_every = 0")
        if self.mode not in ("rl", "sft"):
            raise ValueError(f"mode={self.mode!r}: choose 'rl' or 'sft'")
        if self.trainer.loss.kl_coef > 0 and not self.kl_reference:
            raise ValueError("trainer.loss.kl_coef > 0 needs kl_reference = true")
        if not self.dist_timeout_s > 0:
            raise ValueError(f"dist_timeout_s={self.dist_timeout_s} must be > 0")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device={self.device!r}: choose 'auto', 'cpu' or 'cuda' (under torchrun each rank "
                             "takes cuda:{LOCAL_RANK}; pick GPUs with CUDA_VISIBLE_DEVICES)")


def pick_device(name: str, num_cuda_devices: int, local_rank: int | None) -> torch.device:
    """The device for `LearnerConfig.device` on a host with `num_cuda_devices` visible GPUs;
    `local_rank` is torchrun's LOCAL_RANK (None for one process). Pure: `resolve_device` feeds it."""
    if name == "cpu" or (name == "auto" and num_cuda_devices == 0):
        return torch.device("cpu")
    if name not in ("auto", "cuda"):
        raise ValueError(f"device={name!r}: choose 'auto', 'cpu' or 'cuda'")
    if num_cuda_devices == 0:
        raise RuntimeError(
            f"device = 'cuda' but torch sees no CUDA device (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): set "
            "device = 'cpu' (or 'auto') in the learner config, or run on a GPU host with a CUDA build of torch")
    index = local_rank or 0
    if index >= num_cuda_devices:
        raise RuntimeError(
            f"torchrun LOCAL_RANK={index} but only {num_cuda_devices} CUDA device(s) are visible: one learner "
            f"rank per GPU, so start at most --nproc_per_node {num_cuda_devices} (or set device = 'cpu')")
    return torch.device("cuda", index)


def resolve_device(name: str) -> torch.device:
    """`pick_device` for this process (torchrun's LOCAL_RANK, the GPUs torch sees)."""
    local_rank = int(os.environ["LOCAL_RANK"]) if "RANK" in os.environ and "LOCAL_RANK" in os.environ else None
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pick_device(name, num_gpus, local_rank)


def load_config(path: str | Path) -> LearnerConfig:
    """Read a TOML config file: top-level keys of LearnerConfig, tables for the nested configs."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    return from_dict(LearnerConfig, data, str(path))


def world_size_mismatch(checkpoints: Path, written_by: int, world: int) -> str:
    how = "without torchrun" if written_by == 1 else f"under torchrun --nproc_per_node {written_by}"
    return (f"the latest checkpoint in {checkpoints} was written by {written_by} rank(s) and this learner runs "
            f"{world}: resume it {how} (the optimizer state is laid out per world size), or start a new "
            "output_dir with init_checkpoint pointing at that folder (weights and version carry over, the "
            "optimizer starts fresh)")


def staleness_of(traj, version: int) -> np.ndarray:
    return version - traj.policy_versions[traj.is_action.astype(bool)].astype(np.int64)


class Learner:
    """Wires receiver, trainer, publisher, ledger and metrics; drives them from `run`."""

    def __init__(self, config: LearnerConfig, group: RankGroup | None = None):
        self.config = config
        self.group = group
        """None: one process. Otherwise this rank's place under torchrun (rank 0 runs `run`, the
        others `follow`)."""
        self.rank = group.rank if group is not None else 0
        self.device = resolve_device(config.device)
        self._heartbeat_s = config.dist_timeout_s / 4 if group is not None else None
        self.out = Path(config.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self._stop = asyncio.Event()
        self._carry: list[TrajectoryGroup] = []
        self._replay: list[str] = []
        self.step = 0
        self.ledger = Ledger()
        self._unreported_rejected: list[str] = []

    # ---- construction -------------------------------------------------------------------------
    def _load_model(self):
        from transformers import AutoModelForCausalLM

        from agentrl.common.model import resolve_model

        path = resolve_model(self.config.model_dir)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.config._attn_implementation = "sdpa"
        return model

    def _build_trainer(self) -> None:
        cfg = self.config
        torch.manual_seed(cfg.seed)
        model = self._load_model()
        self.num_trainable = set_trainable(model, cfg.trainer.train_layers, cfg.trainer.train_embeddings)
        self.model = model
        value_head = cfg.trainer.advantage.estimator == "gae" and cfg.mode == "rl"
        policy = PackedPolicy(model, value_head=value_head, kernels=cfg.trainer.kernels,
                              compute_dtype=cfg.trainer.compute_dtype)
        # Onto the device before sharding (FSDP shards what is on the mesh's device) and before the
        # optimizer exists (AdamW's state follows its parameters). In place: self.model moves too.
        policy.to(self.device)
        if self.group is not None:
            # Before the optimizer exists, so that each rank's AdamW state covers its shard only.
            shard_policy(policy, self.device)
        reference = None
        if cfg.kl_reference:
            ref_model = self._load_model().requires_grad_(False).eval()
            reference = PackedPolicy(ref_model, kernels=cfg.trainer.kernels, compute_dtype=cfg.trainer.compute_dtype)
            reference.to(self.device)
        self.trainer = Trainer(policy, cfg.trainer, reference=reference)

    def _restore(self) -> None:
        if self.group is not None:
            self._restore_sharded()
            return
        state = load_latest_checkpoint(self.out / "checkpoints")
        if state is None:
            if self.config.init_checkpoint:
                self._init_from(Path(self.config.init_checkpoint))
            return
        written_by = int(state.get("world_size", 1))
        if written_by != 1:
            raise RuntimeError(world_size_mismatch(self.out / "checkpoints", written_by, 1))
        # The state is on the CPU (ledger.load_latest_checkpoint): load_state_dict copies it into the
        # parameters where they are, and the optimizer casts its moments to each parameter's device
        # (AdamW's `step` counters stay CPU tensors, where the non-fused AdamW keeps them).
        self.trainer.policy.load_state_dict(state["policy"])
        self.trainer.optimizer.load_state_dict(state["optimizer"])
        self.trainer.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"], self.device)
        self.step = int(state["step"])
        self.ledger = Ledger.from_dict(state["ledger"])
        print(f"learner: resumed from checkpoint at step {self.step} "
              f"({len(self.ledger.trained)} groups trained, {len(self.ledger.rejected)} rejected)", file=sys.stderr)

    def _init_from(self, checkpoints: Path) -> None:
        state = load_latest_checkpoint(checkpoints)
        if state is None:
            raise FileNotFoundError(f"init_checkpoint {checkpoints} holds no checkpoint")
        policy = {k: v for k, v in state["policy"].items() if not k.startswith("value_head.")}
        missing, unexpected = self.trainer.policy.load_state_dict(policy, strict=False)
        if unexpected or any(not k.startswith("value_head.") for k in missing):
            raise ValueError(f"init_checkpoint {checkpoints} does not fit this model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        self.step = int(state["step"])
        print(f"learner: initialised from {checkpoints} (version {self.step})", file=sys.stderr)

    def _restore_sharded(self) -> None:
        """`_restore` under torchrun (collective): rank 0 reads the checkpoint and broadcasts it.

        Checkpoints are full (rank 0 gathers model and optimizer state; `checkpoint`), so a
        resume must use the world size that wrote them: the optimizer state is stored by parameter
        name here and by index in one process. A different world size fails with the fix."""
        plan: dict[str, Any] = {"kind": "fresh"}
        state: dict[str, Any] | None = None
        if self.group.is_leader:
            state = load_latest_checkpoint(self.out / "checkpoints")
            if state is not None:
                written_by = int(state.get("world_size", 1))
                if written_by != self.group.world:
                    plan = {"kind": "error",
                            "message": world_size_mismatch(self.out / "checkpoints", written_by, self.group.world)}
                else:
                    plan = {"kind": "resume", "scheduler": state["scheduler"], "step": int(state["step"])}
            elif self.config.init_checkpoint:
                state = self._init_state(Path(self.config.init_checkpoint))
                plan = {"kind": "init", "step": int(state["step"])}
        plan = self.group.broadcast(plan)
        if plan["kind"] == "error":
            raise RuntimeError(plan["message"])
        if plan["kind"] == "fresh":
            return
        leader = self.group.is_leader
        if plan["kind"] == "init":
            load_full_state(self.trainer.policy, state["policy"] if leader else {}, strict=False)
        else:
            load_full_state(self.trainer.policy, state["policy"] if leader else {},
                            self.trainer.optimizer, state["optimizer"] if leader else {})
            self.trainer.scheduler.load_state_dict(plan["scheduler"])
            set_rng_state(self.group.scatter(state["rng_ranks"] if leader else None), self.device)
            if leader:
                self.ledger = Ledger.from_dict(state["ledger"])
        self.step = plan["step"]
        if leader:
            how = "resumed from checkpoint" if plan["kind"] == "resume" else "initialised from init_checkpoint"
            print(f"learner: {how} at step {self.step} on {self.group.world} ranks "
                  f"({len(self.ledger.trained)} groups trained, {len(self.ledger.rejected)} rejected)", file=sys.stderr)

    def _init_state(self, checkpoints: Path) -> dict[str, Any]:
        """The policy weights (value head dropped) and version of another learner's latest checkpoint."""
        state = load_latest_checkpoint(checkpoints)
        if state is None:
            raise FileNotFoundError(f"init_checkpoint {checkpoints} holds no checkpoint")
        policy = {k: v for k, v in state["policy"].items() if not k.startswith("value_head.")}
        expected = {k for k in self.trainer.policy.state_dict() if not k.startswith("value_head.")}
        if set(policy) != expected:
            raise ValueError(f"init_checkpoint {checkpoints} does not fit this model: missing "
                             f"{sorted(expected - set(policy))[:5]}, unexpected {sorted(set(policy) - expected)[:5]}")
        return {"policy": policy, "step": int(state["step"])}

    def _lead(self, op: str, payload: Any = None) -> None:
        """Rank 0: tell the other ranks to enter the collective `op` with it. No-op elsewhere."""
        if self.group is not None and self.group.is_leader:
            self.group.send(op, payload)

    @on_device  # runs on a worker thread (on_device's docstring)
    def _snapshot(self) -> dict[str, torch.Tensor] | None:
        """The weights to publish (bf16, checkpoint names); collective under torchrun, None off rank 0."""
        if self.group is None:
            return snapshot_weights(self.model)
        self._lead("snapshot")
        policy_state, _ = full_state(self.trainer.policy)
        if not self.group.is_leader:
            return None
        return snapshot_from_policy_state(policy_state, tied=bool(getattr(self.model.config, "tie_word_embeddings", False)))

    def checkpoint(self) -> Path | None:
        if self.group is not None:
            return self._checkpoint_sharded()
        return self._save_checkpoint({"policy": self.trainer.policy.state_dict(), "optimizer": self.trainer.optimizer.state_dict(),
                                      "rng": rng_state(self.device)})

    def _save_checkpoint(self, state: dict) -> Path:
        """Write `state` plus scheduler, step, version and ledger atomically; then drop the spooled
        groups the ledger now accounts for."""
        state = {**state, "scheduler": self.trainer.scheduler.state_dict(), "step": self.step, "version": self.step,
                 "ledger": self.ledger.to_dict()}
        path = save_checkpoint(self.out / "checkpoints", self.step, state, keep=self.config.keep_checkpoints)
        self.spool.remove([gid for gid in self.spool.pending() if gid in self.ledger])
        return path

    def _checkpoint_sharded(self) -> Path | None:
        """Full checkpoint under torchrun (collective), written by rank 0 in the one-process layout
        plus `world_size` and every rank's RNG state. Full rather than sharded (one file per rank):
        the policies trained here (135M parameters: 0.5 GB of weights, 1 GB of AdamW state in fp32)
        fit one host's memory, the checkpoint stays one atomic folder with the ledger beside the
        weights, and the policy state keeps the one-process keys (an init_checkpoint works across
        world sizes). A sharded save would only pay off for models that do not fit rank 0's RAM."""
        self._lead("checkpoint")
        policy_state, optim_state = full_state(self.trainer.policy, self.trainer.optimizer)
        rngs = self.group.gather(rng_state(self.device))
        if not self.group.is_leader:
            return None
        return self._save_checkpoint({"policy": policy_state, "optimizer": optim_state, "rng": rngs[0], "rng_ranks": rngs,
                                      "world_size": self.group.world})

    # ---- data ----------------------------------------------------------------------------------
    async def _next_group(self) -> TrajectoryGroup:
        while True:
            if self._carry:
                return self._carry.pop(0)
            if self._replay:
                return self.spool.load(self._replay.pop(0))
            received = await self.receiver.recv()
            gid = received.group.group_id
            if gid in self.ledger or gid in self.spool:
                await self.receiver.ack(received)  # the sender may stop resending; nothing to train
                self.num_duplicates += 1
                continue
            self.spool.put(received.group)
            await self.receiver.ack(received)
            return received.group

    async def _collect(self) -> list[TrajectoryGroup] | None:
        """Whole groups up to the token budget (at least one); None if asked to stop meanwhile."""
        groups: list[TrajectoryGroup] = []
        num_tokens = 0
        while num_tokens < self.config.tokens_per_step:
            getter = asyncio.ensure_future(self._next_group())
            stopper = asyncio.ensure_future(self._stop.wait())
            done, _ = await asyncio.wait({getter, stopper}, timeout=self._heartbeat_s, return_when=asyncio.FIRST_COMPLETED)
            while not done:  # only under torchrun: the other ranks wait in a collective with a timeout
                self._lead("heartbeat")
                done, _ = await asyncio.wait({getter, stopper}, timeout=self._heartbeat_s,
                                             return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if getter not in done:
                getter.cancel()
                # A group already taken stays spooled (and unlisted in the ledger): it is replayed on restart.
                return None
            group = getter.result()
            group_tokens = sum(t.num_tokens for t in group.trajectories)
            if groups and num_tokens + group_tokens > self.config.tokens_per_step:
                self._carry.append(group)
                break
            groups.append(group)
            num_tokens += group_tokens
        return groups

    # ---- one step ------------------------------------------------------------------------------
    def _prepare(self, groups: list[TrajectoryGroup], weights: RewardWeights) -> tuple[list[Sample], dict[str, Any]]:
        cfg = self.config
        report: dict[str, Any] = {}
        staleness_all = np.concatenate([staleness_of(t, self.step) for g in groups for t in g.trajectories] or [np.zeros(0)])
        fresh_groups = []
        num_stale = 0
        for g in groups:
            # SFT data (gold trajectories) was sampled by no policy (version -1): staleness does not apply.
            keep = [t for t in g.trajectories
                    if cfg.mode == "sft" or cfg.staleness_bound is None or not t.is_action.any()
                    or int(staleness_of(t, self.step).max()) <= cfg.staleness_bound]
            num_stale += len(g.trajectories) - len(keep)
            fresh_groups.append(TrajectoryGroup(g.group_id, g.task_id, keep))
        report["staleness/rejected_samples"] = num_stale
        if staleness_all.size:
            report["staleness/mean"] = float(staleness_all.mean())
            report["staleness/max"] = int(staleness_all.max())
            report["staleness/hist"] = {str(k): int(v) for k, v in sorted(Counter(staleness_all.tolist()).items())}
        if cfg.mode == "sft":
            kept = [g for g in fresh_groups if g.trajectories]
            report["rejected"] = {g.group_id: "stale" for g in fresh_groups if not g.trajectories}
            samples = [Sample(g.group_id, t.sample_index, t, np.zeros(t.num_tokens, np.float32)) for g in kept for t in g.trajectories]
            report["kept_group_ids"] = [g.group_id for g in kept]
            return samples, report
        filtered = filter_groups(fresh_groups, weights, cfg.trainer.advantage)
        rejected = {gid: "equal_rewards" for gid in filtered.dropped_equal_rewards}
        for g in fresh_groups:
            if g.group_id in filtered.dropped_too_small:
                rejected[g.group_id] = "stale" if not g.trajectories else "too_few_samples"
        report["rejected"] = rejected
        report["groups/dropped_equal_rewards"] = len(filtered.dropped_equal_rewards)
        report["groups/dropped_too_small"] = len(filtered.dropped_too_small)
        report["samples/failed"] = filtered.num_failed_samples
        if cfg.trainer.advantage.estimator == "gae":
            advs = [[np.zeros(t.num_tokens, np.float32) for t in g.trajectories] for g in filtered.groups]
        else:
            advs = compute_advantages(filtered.groups, weights, cfg.trainer.advantage)
        samples = [Sample(g.group_id, t.sample_index, t, a)
                   for g, ga in zip(filtered.groups, advs, strict=True) for t, a in zip(g.trajectories, ga, strict=True)]
        report["kept_group_ids"] = [g.group_id for g in filtered.groups]
        return samples, report

    @staticmethod
    def _reward_metrics(groups: list[TrajectoryGroup], weights: RewardWeights) -> dict[str, float]:
        trajs = [t for g in groups for t in g.trajectories if t.status != "failed"]
        if not trajs:
            return {}
        terms: Counter[str] = Counter()
        for t in trajs:
            for turn in t.turns:
                terms.update(turn.process_rewards)
        out = {f"reward/{k}": v / len(trajs) for k, v in terms.items()}
        out["reward/task"] = float(np.mean([t.task_reward for t in trajs]))
        out["reward/total"] = float(np.mean([weights.process * sum(sum(u.process_rewards.values()) for u in t.turns)
                                             + weights.task * t.task_reward for t in trajs]))
        out["reward/weight_process"], out["reward/weight_task"] = weights.process, weights.task
        for key in sorted({k for t in trajs for k in t.metrics}):
            vals = [t.metrics[key] for t in trajs if key in t.metrics]
            out[f"episode/{key}"] = float(np.mean(vals))
        return out

    async def _train_step(self, groups: list[TrajectoryGroup], wait_s: float) -> None:
        cfg = self.config
        weights = RewardWeights(*cfg.reward_schedule.weights(self.step))
        samples, report = self._prepare(groups, weights)
        kept_ids = report.pop("kept_group_ids")
        rejected = report.pop("rejected")
        record: dict[str, Any] = {"version": self.step + 1, "time/wait_s": wait_s, **report,
                                  **self._reward_metrics(groups, weights)}
        if samples:
            stats, num_micro_batches = await asyncio.to_thread(self._run_step, samples, weights)
            # From the samples rather than the stats: under torchrun those count padding rows too.
            num_tokens, num_seqs = sum(s.num_tokens for s in samples), len(samples)
            record.update({
                "loss": stats.loss, "grad_norm": stats.grad_norm, "lr": stats.lr,
                "tokens": num_tokens, "action_tokens": stats.num_action_tokens, "sequences": num_seqs,
                "micro_batches": num_micro_batches, "time/compute_s": stats.compute_s,
                "tokens_per_s": stats.num_tokens / stats.compute_s,
                **{f"loss/{k}": v for k, v in stats.kernel_stats.items()},
            })
            self.step += 1
            self.ledger.trained.update({gid: self.step for gid in kept_ids})
        else:
            rejected.update({gid: "nothing_to_train" for gid in kept_ids})
        self.ledger.rejected.update(rejected)
        self._unreported_rejected.extend(sorted(rejected))
        if not samples:
            # Nothing survived filtering: the groups are consumed (rejected) but no update happens and the
            # step counter stays, so a version keeps meaning "optimizer steps applied". Reported next step.
            return
        record["group_ids"] = kept_ids
        record["rejected_group_ids"], self._unreported_rejected = self._unreported_rejected, []
        t0 = time.perf_counter()
        if cfg.publish_every and self.step % cfg.publish_every == 0:
            snapshot = await asyncio.to_thread(self._snapshot)
            record["time/publish_wait_prev_s"] = await self._keepalive(self.publisher.publish(self.step, snapshot))
            record["time/publish_stall_s"] = time.perf_counter() - t0  # snapshot + wait for the previous push
            if self.publisher.reports:
                last = self.publisher.reports[-1]
                record["publish/last_total_s"] = last.total_s
                record["publish/last_version"] = last.version
        if self.version_pub is not None:
            await self.version_pub.publish(self.step, self.publisher.served_version if self.publisher else 0)
        record["served_version"] = self.publisher.served_version if self.publisher else 0
        if self.step % cfg.checkpoint_every == 0:
            t1 = time.perf_counter()
            self.checkpoint()
            record["time/checkpoint_s"] = time.perf_counter() - t1
        self.metrics.write(self.step, record)

    @on_device  # runs on a worker thread (on_device's docstring)
    def _run_step(self, samples: list[Sample] | None, weights: RewardWeights) -> tuple[StepStats, int]:
        """One optimizer step; (stats, micro-batches per rank). Collective under torchrun: rank 0
        passes the whole batch and sends each rank its share, the others pass None."""
        cfg = self.config
        max_row_tokens = cfg.trainer.max_row_tokens
        if self.group is None:
            mbs = build_micro_batches(samples, max_row_tokens)
        else:
            shares = None
            if self.group.is_leader:
                shares = [shard_samples(samples, r, self.group.world) for r in range(self.group.world)]
                self._check_padding(shares)
                self._lead("step", weights)
            mbs = equalise_micro_batches(self.group.scatter(shares), max_row_tokens)
        stats = self.trainer.sft_step(mbs) if cfg.mode == "sft" else self.trainer.rl_step(mbs, weights)
        return stats, len(mbs)

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

    async def _keepalive(self, awaitable):
        """Await something slow on rank 0 (a push, a server query) while the other ranks wait in a
        collective: a heartbeat every `dist_timeout_s / 4` keeps them within their timeout."""
        task = asyncio.ensure_future(awaitable)
        if self.group is None:
            return await task
        while True:
            done, _ = await asyncio.wait({task}, timeout=self._heartbeat_s)
            if done:
                return task.result()
            self._lead("heartbeat")

    async def _served_version(self) -> int:
        """The oldest version the servers serve now: after a restart or an init from another
        learner's checkpoint the servers are not at version 0, and the orchestrator's staleness
        gate must see what they really serve."""
        from agentrl.common.inference import VLLMClient

        versions = []
        for url in self.config.server_urls:
            async with VLLMClient(url) as client:
                versions.append(await client.weight_version())
        return min(versions)

    # ---- the loop ------------------------------------------------------------------------------
    async def run(self) -> int:
        from agentrl.common.transport import GroupReceiver, VersionPublisher

        cfg = self.config
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        self._build_trainer()
        self.spool = Spool(self.out / "spool")
        self._restore()
        self._replay = [gid for gid in self.spool.pending() if gid not in self.ledger]
        self.num_duplicates = 0
        self.publisher = WeightPublisher(cfg.server_urls, kv_refresh_every=cfg.kv_refresh_every) if cfg.publish_every else None
        self.receiver = GroupReceiver(cfg.group_endpoint)
        self.version_pub = VersionPublisher(cfg.version_endpoint) if cfg.version_endpoint else None
        self.metrics = MetricsWriter(self.out, tensorboard=cfg.tensorboard, progress_total=cfg.max_steps,
                                     progress_initial=self.step, progress_bar=cfg.progress_bar)
        await self.receiver.start()
        served = await self._keepalive(self._served_version()) if cfg.server_urls else 0
        if self.publisher is not None:
            self.publisher.served_version = served
            if served != self.step:
                # The servers hold weights this lineage does not own: pushed after the checkpoint we
                # resumed from (lost with a kill -9), or the weights before an init from SFT. Serve ours.
                await self.publisher.publish(self.step, await asyncio.to_thread(self._snapshot))
                await self._keepalive(self.publisher.wait())
                served = self.step
        if self.version_pub is not None:
            await self.version_pub.start()
            await self.version_pub.publish(self.step, served)
        ranks = f" ranks={self.group.world}" if self.group is not None else ""
        print(f"READY learner step={self.step} replay={len(self._replay)} endpoint={cfg.group_endpoint}{ranks} "
              f"device={self.device}",
              file=sys.stderr, flush=True)
        try:
            while self.step < cfg.max_steps and not self._stop.is_set():
                t_wait = time.perf_counter()
                groups = await self._collect()
                if groups is None:
                    break
                await self._train_step(groups, time.perf_counter() - t_wait)
            self.checkpoint()
            if self.publisher is not None:
                await self._keepalive(self.publisher.close())
            self._lead("stop")  # last: a heartbeat after it would wait for ranks that have left
        finally:
            self.metrics.close()
            await self.receiver.close()
            if self.version_pub is not None:
                await self.version_pub.close()
        print(f"learner: stopped at step {self.step}", file=sys.stderr, flush=True)
        return 0

    def follow(self) -> int:
        """The loop of a rank other than 0 under torchrun: build the same sharded trainer, restore
        with rank 0, then run the collectives rank 0 announces until it sends "stop".

        SIGTERM/SIGINT are deferred to rank 0: torchrun forwards a SIGTERM to every rank at once,
        and rank 0 needs the others alive to gather the checkpoint it writes before stopping. If
        rank 0 is gone instead, the next collective fails (connection closed, or `dist_timeout_s`)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._defer_signal)
        self._build_trainer()
        self._restore()
        commands = {
            "heartbeat": lambda payload: None,
            "step": lambda weights: self._run_step(None, weights),
            "snapshot": lambda payload: self._snapshot(),
            "checkpoint": lambda payload: self.checkpoint(),
        }
        while True:
            op, payload = self.group.recv()
            if op == "stop":
                break
            if op not in commands:
                raise RuntimeError(f"rank {self.rank}: unknown command {op!r} from rank 0")
            commands[op](payload)
        print(f"learner rank {self.rank}: stopped at rank 0's request", file=sys.stderr, flush=True)
        return 0

    def _defer_signal(self, signum: int, frame: Any) -> None:
        print(f"learner rank {self.rank}: {signal.Signals(signum).name} received; rank 0 decides when to stop",
              file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl learner", description="Run the learner process.")
    parser.add_argument("--config", required=True, type=Path, help="TOML file with the LearnerConfig fields")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except (ValueError, TypeError, OSError, tomllib.TOMLDecodeError) as err:
        print(f"agentrl learner: bad config: {err}", file=sys.stderr)
        return 2
    try:
        device = resolve_device(config.device)
    except RuntimeError as err:
        print(f"agentrl learner: bad config: {err}", file=sys.stderr)
        return 2
    if launched_world_size() == 1:
        return asyncio.run(Learner(config).run())
    rank, world = init_distributed(config.dist_timeout_s, device)
    print(f"learner rank {rank}/{world} pid {os.getpid()}", file=sys.stderr, flush=True)
    learner = Learner(config, RankGroup(rank, world))
    try:
        return asyncio.run(learner.run()) if rank == 0 else learner.follow()
    finally:
        torch.distributed.destroy_process_group()
