"""The learner process: receive groups, train, publish weights and versions, checkpoint.

One step of the loop (`Learner.run`), in order:
1. wait for data: take groups (replayed spool first, then the socket) until the step's token budget
   is reached; each new group is checked as it is decoded (a refused one is nacked and kept in
   rejected/: `intake.py`), spooled and acknowledged at once (`ledger.py` for why that is
   exactly-once), duplicates are acknowledged and skipped;
2. off-policy control: drop trajectories whose oldest action token is more than `staleness_bound`
   versions behind the learner (counted and reported), record the staleness histogram;
3. advantages (reward schedule weights at this step), dynamic sampling, packing, one optimizer step
   on a worker thread (the event loop stays free for the background weight push and the sockets);
   a step whose gradient norm is not finite is skipped (nothing applied, the version stays, its
   groups are recorded as "nonfinite_gradient", counted in `steps/skipped_nonfinite_grad`);
4. ledger update, metrics line;
5. every `publish.every` steps: snapshot the weights and push them to every vLLM server in the
   background (`publish.py`; a server that fails is marked down and re-pushed the latest weights
   when it answers again, the others are not held up); publish (version, served_version) to the
   orchestrator;
6. every `checkpoint.every` steps, on SIGTERM and at the end: atomic checkpoint; and when it stops
   (SIGTERM or `max_steps`) with steps it has not pushed yet (`publish.every` > 1), a last push, so
   the servers serve what its checkpoint holds (an SFT learner stopped by the run's time limit).

Versions: the learner's version is its optimizer step count (0 = the initial weights, which a
fresh server serves). A token sampled under version v is (version - v) steps stale at training time.

Shutdown: SIGTERM (or SIGINT) sets a flag that is checked between steps and interrupts a wait for
data; the learner then writes a checkpoint, pushes its last step's weights if they were not pushed
yet, waits for the push in flight (bounded) and exits 0.

Under torchrun (data parallel, FSDP2; `distributed.py`, `ranks.py`):

    torchrun --nproc_per_node 2 -m agentrl.cli learner --config learner.toml

(the same config file). Rank 0 runs this loop with a `ranks.Leader`, the others `ranks.follow`;
without torchrun, or under torchrun with a world size of 1, the loop runs with a `ranks.Solo`.
Rank 0 alone talks to the outside world (receiver, spool, ledger, version publisher, pushes,
metrics, checkpoint files). Checkpoints are full (gathered to rank 0) and resume under the world
size that wrote them (another world size is refused with the fix; the weights carry over to any
world size through `init_checkpoint`). Shutdown: a SIGTERM to the launcher reaches every rank;
ranks other than 0 defer to rank 0, which checkpoints (a collective) and then sends "stop", so all
exit 0 within torchrun's `--shutdown-timeout`. A dead or hung rank: the process group has a
timeout (`dist_timeout_s`); if a peer dies, the next collective fails and the rank exits non-zero;
torchrun stops the rest. Nothing acknowledged is lost: it is in rank 0's spool.

Module map: `intake.py` (receiver + spool + ledger), `prepare.py` (batch preparation, pure),
`ranks.py` (build, restore, step, snapshot, checkpoint state: one process or rank 0),
`checkpoint.py` (atomic checkpoint I/O), `publish.py` (background weight pushes), `metrics.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from agentrl.common.adapters import adapter_metadata
from agentrl.common.config import ConfigError, build, read_toml
from agentrl.common.directory import INFERENCE, DirectoryFollower
from agentrl.common.trajectory import TrajectoryGroup
from agentrl.common.transport import GroupReceiver, VersionPublisher
from agentrl.learner.checkpoint import save_checkpoint
from agentrl.learner.config import LearnerConfig
from agentrl.learner.devices import resolve_device
from agentrl.learner.distributed import (
    RankGroup,
    close_distributed,
    die_with_launcher,
    end_rank,
    init_distributed,
    launched_world_size,
)
from agentrl.learner.intake import Intake
from agentrl.learner.ledger import Ledger, Spool
from agentrl.learner.metrics import MetricsWriter
from agentrl.learner.prepare import Batch, prepare_batch
from agentrl.learner.publish import WeightPublisher
from agentrl.learner.ranks import Leader, Solo, follow
from agentrl.learner.rejected import RejectedStore
from agentrl.learner.rewards import RewardWeights, reward_metrics
from agentrl.learner.trainer import StepStats


def load_config(path: str | Path) -> LearnerConfig:
    """The learner config in a TOML file: top-level keys of LearnerConfig, tables for the nested configs."""
    return build(LearnerConfig, read_toml(path), default_source=str(path))


def check_runnable(config: LearnerConfig, where: str = "learner config") -> None:
    """What a config must hold to run a learner, beyond what the type checks: the fields a
    supervisor fills in (`agentrl train` does; a hand-written config must)."""
    if not config.output_dir:
        raise ConfigError(f"{where}: output_dir: required (the folder for checkpoints, spool and metrics)")
    if config.anchor.coef > 0 and not config.anchor_dir:
        raise ConfigError(f"{where}: anchor.coef > 0 needs anchor_dir (a spool folder of demonstration groups; "
                          "agentrl train fills it from the SFT cold start)")
    if config.publish.every and not config.server_urls:
        raise ConfigError(f"{where}: publish.every > 0 needs server_urls (the vLLM servers to push to); "
                          "or set publish.every = 0")
    check_lora(config, where)


def check_lora(config: LearnerConfig, where: str = "learner config", key: str = "trainer") -> None:
    """LoRA's targets against the model folder's layers (read from its safetensors headers, no torch)."""
    if not config.trainer.lora.enabled:
        return
    from agentrl.common.model import resolve_model
    from agentrl.learner.lora import check_lora_targets

    try:
        check_lora_targets(resolve_model(config.model_dir or None), config.trainer.lora, config.trainer.train_layers, key=key)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from None


CARRIED_COUNTS = ("groups/dropped_equal_rewards", "groups/dropped_too_small", "samples/failed",
                  "staleness/rejected_samples")
"""Counters of a batch that trained nothing, summed into the next step's line (so that the lines'
sums are the run's totals)."""


class Learner:
    """Wires intake, the rank protocol (trainer), publisher, version publisher and metrics; drives them from `run`."""

    def __init__(self, config: LearnerConfig, ranks: Solo | None = None):
        check_runnable(config)
        self.config = config
        self.ranks = ranks or Solo(config, resolve_device(config.device))
        self.out = Path(config.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self._stop = asyncio.Event()
        self.step = 0
        self._unreported_rejected: list[str] = []
        self.num_skipped_steps = 0
        """Updates skipped for a non-finite gradient norm (trainer.py), since this process started."""
        self.pushed_step = -1
        """The step whose weights were last handed to the publisher (-1: none yet)."""
        self._carried: dict[str, float] = {}
        """Waiting time and dropped-group counts of batches that trained nothing (every group dropped,
        e.g. equal rewards under dynamic sampling), added to the next step's metrics line (what a
        learner that stops before its next step carried is not written)."""

    def start_training(self) -> Intake:
        """Build the trainer and restore it; returns the intake (with the restored ledger) once a
        receiver is attached by the caller. Separated from `run` so tests can drive steps directly."""
        self.ranks.build()
        restored = self.ranks.restore(self.out / "checkpoints")
        self.step = restored.step
        cfg = self.config
        receiver = GroupReceiver(cfg.transport.group_endpoint, max_frame_bytes=cfg.transport.max_group_frame_bytes,
                                 vocab_size=self.ranks.vocab_size, curve=cfg.transport.curve_keys())
        self.intake = Intake(receiver, Spool(self.out / "spool"), restored.ledger or Ledger(),
                             RejectedStore(self.out / "rejected", max_bytes=cfg.max_rejected_bytes))
        if restored.how != "fresh":
            ledger = self.intake.ledger
            print(f"learner: {restored.how} at step {self.step} on {self.ranks.world} rank(s) "
                  f"({len(ledger.trained)} groups trained, {len(ledger.rejected)} rejected)", file=sys.stderr)
        return self.intake

    def checkpoint(self) -> Path | None:
        """Write a checkpoint (collective under torchrun; rank 0 writes), then prune the spool."""
        state = self.ranks.checkpoint_state()
        state = {**state, "scheduler": self.ranks.trainer.scheduler.state_dict(), "step": self.step,
                 "version": self.step, "ledger": self.intake.ledger.to_dict()}
        path = save_checkpoint(self.out / "checkpoints", self.step, state, keep=self.config.checkpoint.keep)
        self.intake.prune()
        return path

    # ---- one step ------------------------------------------------------------------------------
    def prepare(self, groups: list[TrajectoryGroup], weights: RewardWeights) -> Batch:
        cfg = self.config
        return prepare_batch(groups, version=self.step, mode=cfg.mode, staleness_bound=cfg.staleness_bound,
                             weights=weights, advantage=cfg.trainer.advantage)

    async def _train_step(self, groups: list[TrajectoryGroup], wait_s: float) -> None:
        """One learner step in three calls: prepare the batch, one optimizer step on the ranks, then
        everything that follows an applied (or refused) update."""
        weights = self.config.reward_schedule.weights(self.step)
        batch = self.prepare(groups, weights)
        stats, num_micro_batches = (await asyncio.to_thread(self.ranks.step, batch.samples)) if batch.samples else (None, 0)
        await self._after_step(groups, weights, batch, stats, num_micro_batches, wait_s)

    async def _after_step(self, groups: list[TrajectoryGroup], weights: RewardWeights, batch: Batch,
                          stats: StepStats | None, num_micro_batches: int, wait_s: float) -> None:
        """Settle the groups in the ledger; for an applied update also publish the weights, announce
        the version, checkpoint when due and write the step's metrics."""
        if not self._settle(batch, stats):
            self._carry({"time/wait_s": wait_s, **{k: batch.report.get(k, 0) for k in CARRIED_COUNTS}})
            return
        carried, self._carried = self._carried, {}
        report = {**batch.report, **{k: batch.report.get(k, 0) + carried.get(k, 0) for k in CARRIED_COUNTS}}
        record: dict[str, Any] = {"version": self.step, "time/wait_s": wait_s + carried.get("time/wait_s", 0.0), **report,
                                  **reward_metrics(groups, weights), **self._step_metrics(batch, stats, num_micro_batches)}
        record["steps/skipped_nonfinite_grad"] = self.num_skipped_steps
        record["groups/refused"] = self.intake.receiver.num_malformed + self.intake.num_replay_rejected
        record["group_ids"] = batch.kept_group_ids
        record["rejected_group_ids"], self._unreported_rejected = self._unreported_rejected, []
        if self.config.publish.every and self.step % self.config.publish.every == 0:
            record |= await self._publish()
        served = self.publisher.served_version if self.publisher else 0
        if self.version_pub is not None:
            await self.version_pub.publish(self.step, served)
        record["served_version"] = served
        if self.step % self.config.checkpoint.every == 0:
            t1 = time.perf_counter()
            self.checkpoint()
            record["time/checkpoint_s"] = time.perf_counter() - t1
        self.metrics.write(self.step, record)

    def _carry(self, values: dict[str, float]) -> None:
        for k, v in values.items():
            self._carried[k] = self._carried.get(k, 0) + v

    def _settle(self, batch: Batch, stats: StepStats | None) -> bool:
        """Record the batch's groups as trained at the new version, or rejected; True when the update
        was applied (the step counter moved)."""
        rejected = dict(batch.rejected)
        applied = stats is not None and not stats.skipped
        if applied:
            self.step += 1
            self.intake.settle({gid: self.step for gid in batch.kept_group_ids}, rejected)
        else:
            why = "nothing_to_train" if stats is None else "nonfinite_gradient"
            rejected.update({gid: why for gid in batch.kept_group_ids})
            self.intake.settle({}, rejected)
        self._unreported_rejected.extend(sorted(rejected))
        if stats is not None and stats.skipped:
            # The gradient was not finite (the trainer applied nothing): the groups are consumed
            # (rejected) but the step counter stays, so a version keeps meaning "optimizer steps
            # applied". Reported with the next step's line.
            self.num_skipped_steps += 1
            print(f"learner: update {self.step + 1} skipped: gradient norm {stats.grad_norm}; its "
                  f"{len(batch.kept_group_ids)} groups are recorded as 'nonfinite_gradient'", file=sys.stderr, flush=True)
        return applied

    @staticmethod
    def _step_metrics(batch: Batch, stats: StepStats, num_micro_batches: int) -> dict[str, Any]:
        # From the samples rather than the stats: under torchrun those count padding rows too.
        return {"loss": stats.loss, "grad_norm": stats.grad_norm, "lr": stats.lr,
                "tokens": sum(s.num_tokens for s in batch.samples), "action_tokens": stats.num_action_tokens,
                "sequences": len(batch.samples), "micro_batches": num_micro_batches, "time/compute_s": stats.compute_s,
                "tokens_per_s": stats.num_tokens / stats.compute_s,
                **{f"loss/{k}": v for k, v in stats.kernel_stats.items()}}

    async def _publish(self) -> dict[str, Any]:
        """Push this step's weights (after the previous push finished); the publishing metrics."""
        t0 = time.perf_counter()
        snapshot = await asyncio.to_thread(self.ranks.snapshot)
        record = {"time/publish_wait_prev_s": await self.ranks.keepalive(self.publisher.publish(self.step, snapshot))}
        self.pushed_step = self.step
        record["time/publish_stall_s"] = time.perf_counter() - t0  # snapshot + wait for the previous push
        if self.publisher.reports:
            last = self.publisher.reports[-1]
            record["publish/last_total_s"] = last.total_s
            record["publish/last_version"] = last.version
            record["publish/last_transports"] = sorted({str(s["transport"]) for s in last.per_server.values()})
            record["publish/last_bytes"] = sum(int(s["bytes"]) for s in last.per_server.values())
        record["publish/servers_down"] = len(self.publisher.down)
        record["publish/failures"] = sum(self.publisher.num_push_failures.values())
        record["publish/recoveries"] = self.publisher.num_recoveries
        return record

    async def _start_publishing(self) -> int:
        """Ask the servers what they serve (concurrently; one that does not answer is marked down,
        not fatal) and, unless every server serves this lineage's version, push ours: after a
        restart or an init from another learner's checkpoint the servers are not at version 0, and
        the orchestrator's staleness gate must see what they really serve. A server that is down
        gets these weights when it answers again (`WeightPublisher`). Returns the served version."""
        publisher = self.publisher
        publisher.served_version = self.step
        await self.ranks.keepalive(publisher.probe())
        self.pushed_step = self.step  # served already, or pushed just below
        if publisher.down or any(v != self.step for v in publisher.versions.values()):
            # The servers hold weights this lineage does not own: pushed after the checkpoint we
            # resumed from (lost with a kill -9), or the weights before an init from SFT. Serve ours.
            # (The snapshot is a collective under torchrun: never inside keepalive, whose heartbeats are too.)
            snapshot = await asyncio.to_thread(self.ranks.snapshot)
            await publisher.publish(self.step, snapshot)
            await self.ranks.keepalive(publisher.wait())
        if publisher.down:
            print(f"learner: servers down at start: {sorted(publisher.down)}; they are pushed version "
                  f"{self.step} when they answer", file=sys.stderr, flush=True)
        return publisher.served_version

    async def _start_announcing(self, served: int) -> None:
        """Announce (version, served version) to the actors: after every step, and whenever the
        servers catch up in between (a push that finished, a restarted server that took the latest
        weights). An actor held back by its staleness bound sends no groups, so no step would come
        to announce a catch-up: in a run whose only server was lost and came back while the learner
        trained ahead, the actor waited for its budget to run out."""
        if self.version_pub is None:
            return
        await self.version_pub.start()
        if self.publisher is not None:  # a push that finished meanwhile counts too
            served = self.publisher.served_version
            self.publisher.on_served = self.version_pub.set_served
        await self.version_pub.publish(self.step, served)

    async def _query_served_version(self) -> int:
        """Without pushes (publish.every = 0): the oldest version among the servers that answer."""
        probe = WeightPublisher(self.config.server_urls)
        probe.served_version = self.step
        await self.ranks.keepalive(probe.probe())
        await probe.close()
        return probe.served_version

    # ---- the loop ------------------------------------------------------------------------------
    async def run(self) -> int:
        cfg = self.config
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        intake = self.start_training()
        lora = cfg.trainer.lora
        directory = (DirectoryFollower(cfg.services_file, {INFERENCE: cfg.server_urls}) if cfg.services_file else None)
        self.publisher = (WeightPublisher(cfg.server_urls, kv_refresh_every=cfg.publish.kv_refresh_every, transport=cfg.publish.transport,
                                          metadata=adapter_metadata(lora.scaling) if lora.enabled else None,
                                          directory=directory)
                          if cfg.publish.every else None)
        self.version_pub = VersionPublisher(cfg.transport.version_endpoint, curve=cfg.transport.curve_keys()) if cfg.transport.version_endpoint else None
        self.metrics = MetricsWriter(self.out, tensorboard=cfg.tensorboard, progress_total=cfg.max_steps,
                                     progress_initial=self.step, progress_bar=cfg.progress_bar)
        await intake.receiver.start()
        if self.publisher is not None:
            served = await self._start_publishing()
        else:
            served = await self._query_served_version() if cfg.server_urls else 0
        await self._start_announcing(served)
        print(f"READY learner step={self.step} replay={intake.num_replayed} endpoint={cfg.transport.group_endpoint} "
              f"ranks={self.ranks.world} device={self.ranks.device}", file=sys.stderr, flush=True)
        try:
            while self.step < cfg.max_steps and not self._stop.is_set():
                t_wait = time.perf_counter()
                groups = await intake.collect(cfg.tokens_per_step, self._stop, heartbeat=self.ranks.heartbeat,
                                              heartbeat_s=self.ranks.heartbeat_s)
                if groups is None:
                    break
                await self._train_step(groups, time.perf_counter() - t_wait)
            self.checkpoint()
            if self.publisher is not None:
                if self.pushed_step != self.step:  # stopped between pushes: serve what the checkpoint holds
                    snapshot = await asyncio.to_thread(self.ranks.snapshot)
                    await self.ranks.keepalive(self.publisher.publish(self.step, snapshot))
                    self.pushed_step = self.step
                await self.ranks.keepalive(self.publisher.close())
            self.ranks.stop()
        finally:
            self.metrics.close()
            await intake.receiver.close()
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
        check_runnable(config, str(args.config))
        if launched_world_size() > 1 and config.anchor.coef > 0:
            raise ConfigError(f"{args.config}: anchor.coef > 0 runs in one learner process; under torchrun the ranks do "
                              "not share the anchor's demonstrations yet (set anchor.coef = 0)")
        device = resolve_device(config.device)
    except (ConfigError, RuntimeError) as err:
        print(f"agentrl learner: bad config: {err}", file=sys.stderr)
        return 2
    if launched_world_size() == 1:
        return asyncio.run(Learner(config, Solo(config, device)).run())
    die_with_launcher()
    faulthandler.enable()  # a native abort in a rank prints every thread's Python stack to its log
    rank, world = init_distributed(config.dist_timeout_s, device)
    print(f"learner rank {rank}/{world} pid {os.getpid()}", file=sys.stderr, flush=True)
    group = RankGroup(rank, world)
    completed = False
    try:
        if rank == 0:
            code = asyncio.run(Learner(config, Leader(config, device, group)).run())
        else:
            code = follow(config, device, group)
        completed = code == 0
    finally:
        close_distributed(completed)
    end_rank(code)
