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
"""

from __future__ import annotations

import argparse
import asyncio
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

from agentrl.config import from_dict
from agentrl.engine.rewards import RewardSchedule
from agentrl.engine.trajectory import TrajectoryGroup
from agentrl.learner.advantages import RewardWeights, compute_advantages, filter_groups
from agentrl.learner.batching import PackedPolicy, Sample, build_micro_batches
from agentrl.learner.ledger import (
    Ledger,
    Spool,
    load_latest_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from agentrl.learner.metrics import MetricsWriter
from agentrl.learner.publish import WeightPublisher, snapshot_weights
from agentrl.learner.trainer import Trainer, TrainerConfig, set_trainable


@dataclass
class LearnerConfig:
    output_dir: str
    """Folder for metrics.jsonl, tensorboard/, checkpoints/ and spool/ (created)."""
    model_dir: str | None = None
    """Hugging Face model folder; None = the prepared SmolLM2-135M-Instruct (agentrl.model)."""
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
    tensorboard: bool = True
    progress_bar: bool = True

    def __post_init__(self) -> None:
        if self.tokens_per_step <= 0:
            raise ValueError(f"tokens_per_step={self.tokens_per_step} must be > 0")
        if self.checkpoint_every <= 0:
            raise ValueError(f"checkpoint_every={self.checkpoint_every} must be > 0")
        if self.publish_every < 0:
            raise ValueError(f"publish_every={self.publish_every} must be >= 0")
        if self.publish_every and not self.server_urls:
            raise ValueError("publish_every > 0 needs server_urls (the vLLM servers to push to); or set publish_every = 0")
        if self.mode not in ("rl", "sft"):
            raise ValueError(f"mode={self.mode!r}: choose 'rl' or 'sft'")
        if self.trainer.loss.kl_coef > 0 and not self.kl_reference:
            raise ValueError("trainer.loss.kl_coef > 0 needs kl_reference = true")


def load_config(path: str | Path) -> LearnerConfig:
    """Read a TOML config file: top-level keys of LearnerConfig, tables for the nested configs."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    return from_dict(LearnerConfig, data, str(path))


def staleness_of(traj, version: int) -> np.ndarray:
    return version - traj.policy_versions[traj.is_action.astype(bool)].astype(np.int64)


class Learner:
    """Wires receiver, trainer, publisher, ledger and metrics; drives them from `run`."""

    def __init__(self, config: LearnerConfig):
        self.config = config
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

        from agentrl.model import resolve_model

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
        reference = None
        if cfg.kl_reference:
            ref_model = self._load_model().requires_grad_(False).eval()
            reference = PackedPolicy(ref_model, kernels=cfg.trainer.kernels, compute_dtype=cfg.trainer.compute_dtype)
        self.trainer = Trainer(policy, cfg.trainer, reference=reference)

    def _restore(self) -> None:
        state = load_latest_checkpoint(self.out / "checkpoints")
        if state is None:
            if self.config.init_checkpoint:
                self._init_from(Path(self.config.init_checkpoint))
            return
        self.trainer.policy.load_state_dict(state["policy"])
        self.trainer.optimizer.load_state_dict(state["optimizer"])
        self.trainer.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
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

    def checkpoint(self) -> Path:
        state = {
            "policy": self.trainer.policy.state_dict(),
            "optimizer": self.trainer.optimizer.state_dict(),
            "scheduler": self.trainer.scheduler.state_dict(),
            "rng": rng_state(),
            "step": self.step,
            "version": self.step,
            "ledger": self.ledger.to_dict(),
        }
        path = save_checkpoint(self.out / "checkpoints", self.step, state, keep=self.config.keep_checkpoints)
        self.spool.remove([gid for gid in self.spool.pending() if gid in self.ledger])
        return path

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
            done, _ = await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
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
            mbs = build_micro_batches(samples, cfg.trainer.max_row_tokens)
            step_fn = self.trainer.sft_step if cfg.mode == "sft" else self.trainer.rl_step
            args = (mbs,) if cfg.mode == "sft" else (mbs, weights)
            stats = await asyncio.to_thread(step_fn, *args)
            record.update({
                "loss": stats.loss, "grad_norm": stats.grad_norm, "lr": stats.lr,
                "tokens": stats.num_tokens, "action_tokens": stats.num_action_tokens, "sequences": stats.num_seqs,
                "micro_batches": len(mbs), "time/compute_s": stats.compute_s,
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
            snapshot = await asyncio.to_thread(snapshot_weights, self.model)
            record["time/publish_wait_prev_s"] = await self.publisher.publish(self.step, snapshot)
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

    async def _served_version(self) -> int:
        """The oldest version the servers serve now: after a restart or an init from another
        learner's checkpoint the servers are not at version 0, and the orchestrator's staleness
        gate must see what they really serve."""
        from agentrl.engine.inference import VLLMClient

        versions = []
        for url in self.config.server_urls:
            async with VLLMClient(url) as client:
                versions.append(await client.weight_version())
        return min(versions)

    # ---- the loop ------------------------------------------------------------------------------
    async def run(self) -> int:
        from agentrl.engine.transport import GroupReceiver, VersionPublisher

        cfg = self.config
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        self._build_trainer()
        self.spool = Spool(self.out / "spool")
        self._restore()
        self._replay = [gid for gid in self.spool.pending() if gid not in self.ledger]
        self.num_duplicates = 0
        self.publisher = WeightPublisher(cfg.server_urls) if cfg.publish_every else None
        self.receiver = GroupReceiver(cfg.group_endpoint)
        self.version_pub = VersionPublisher(cfg.version_endpoint) if cfg.version_endpoint else None
        self.metrics = MetricsWriter(self.out, tensorboard=cfg.tensorboard, progress_total=cfg.max_steps,
                                     progress_initial=self.step, progress_bar=cfg.progress_bar)
        await self.receiver.start()
        served = await self._served_version() if cfg.server_urls else 0
        if self.publisher is not None:
            self.publisher.served_version = served
            if served != self.step:
                # The servers hold weights this lineage does not own: pushed after the checkpoint we
                # resumed from (lost with a kill -9), or the weights before an init from SFT. Serve ours.
                await self.publisher.publish(self.step, await asyncio.to_thread(snapshot_weights, self.model))
                await self.publisher.wait()
                served = self.step
        if self.version_pub is not None:
            await self.version_pub.start()
            await self.version_pub.publish(self.step, served)
        print(f"READY learner step={self.step} replay={len(self._replay)} endpoint={cfg.group_endpoint}",
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
                await self.publisher.close()
        finally:
            self.metrics.close()
            await self.receiver.close()
            if self.version_pub is not None:
                await self.version_pub.close()
        print(f"learner: stopped at step {self.step}", file=sys.stderr, flush=True)
        return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl learner", description="Run the learner process.")
    parser.add_argument("--config", required=True, type=Path, help="TOML file with the LearnerConfig fields")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except (ValueError, TypeError, OSError, tomllib.TOMLDecodeError) as err:
        print(f"agentrl learner: bad config: {err}", file=sys.stderr)
        return 2
    return asyncio.run(Learner(config).run())
