"""Phase 3 of `agentrl train`: the SFT cold start. The demonstrations (the `[sft] demonstrations`
file's, else the environment's) are streamed as one-trajectory groups to a learner process in `sft`
mode, epoch after epoch, until it has made its steps or the phase's time is up (it then checkpoints
and pushes the step it reached); then the held-out evaluation. Also the demonstration anchor's spool
(RUN_DIR/rl-anchor) the RL learner trains on when `learner.anchor.coef` > 0."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from agentrl.budget import MIN_SFT_PHASE_S, sft_stop_at
from agentrl.common.trajectory import single_group
from agentrl.engine.roles import agentrl_argv
from agentrl.runconfig import sft_learner_overrides
from agentrl.summary import last_metrics

ANCHOR_DIR = "rl-anchor"
"""Run folder of the SFT demonstrations the RL learner's anchor trains on (learner.anchor.coef > 0)."""


async def sft_phase(sup) -> None:
    cfg = sup.config
    gold, source = await demonstrations(sup)
    if not gold:
        sup.say(f"SFT cold start skipped: no demonstrations ({source})")
        if cfg.learner.anchor.coef > 0:  # refused now rather than at the RL phase's start
            await write_anchor(sup, gold, source)
        sup.phase_done("sft", {"skipped": "no demonstrations"})
        return
    sup.set_phase("sft")
    sup.say(f"SFT cold start on {len(gold)} demonstrations from {source}")
    if cfg.learner.anchor.coef > 0:
        await write_anchor(sup, gold, source)
    # After SFT come its evaluation, the RL phase's share and the final evaluation.
    reserve_s = 2 * sup.final_eval_reserve_s() + sup.rl_min_s()
    stop_at = sft_stop_at(time.monotonic(), cfg.sft.max_minutes, sup.deadline, reserve_s)
    if stop_at - time.monotonic() < MIN_SFT_PHASE_S:
        sup.say(f"SFT cold start skipped: {max(stop_at - time.monotonic(), 0):.0f} s of the budget are left for it "
                f"(after the SFT and final evaluations and rl_min_share = {cfg.rl_min_share}), less than the "
                f"{MIN_SFT_PHASE_S:.0f} s a learner needs to start and make a step; a longer --minutes gives it time")
        sup.phase_done("sft", {"skipped": "no time left"})
        return
    sup.say(f"SFT cold start: up to {cfg.sft.steps} steps, stopped after {(stop_at - time.monotonic()) / 60:.1f} "
            f"minutes at the latest (the SFT and final evaluations and rl_min_share = {cfg.rl_min_share} of the "
            "budget come after it)")
    slot, config_path, data = sup.learner_config("sft", sft_learner_overrides(cfg.sft))
    learner = sup.start(slot, agentrl_argv("learner", "--config", str(config_path.resolve())), control=True)
    t0 = time.perf_counter()
    epoch, time_limited = await _stream(sup, learner, gold, data, stop_at)
    # Stopped (time-limited) or finished: its place goes back either way (a Ray host, a placement
    # group of ranks), for the RL learner to take.
    rc = await asyncio.to_thread(learner.stop, 300 if time_limited else 60)
    # torchrun's own exit status after a forwarded SIGTERM is not the learner's: rank 0 says how it ended.
    stopped = time_limited and "learner: stopped at step" in learner.log_tail(200)
    if rc != 0 and not stopped:
        raise RuntimeError(f"SFT learner exited with {rc}; log {learner.log_path}:\n{learner.log_tail()}")
    steps_done = last_metrics(sup.out / "sft" / "metrics.jsonl").get("step", 0)
    sft_s = time.perf_counter() - t0
    summary, trajs = await sup.evaluations.of_policy("sft")
    sup.log_eval(summary, trajs)
    sup.phase_done("sft", {**summary, "sft_s": sft_s, "steps": cfg.sft.steps,
                           "steps_done": steps_done, "time_limited": time_limited, "epochs_streamed": epoch})


async def _stream(sup, learner, gold: list, data: dict, stop_at: float) -> tuple[int, bool]:
    """Send the demonstrations to the SFT learner, epoch after epoch, until it exits (its steps
    made) or `stop_at` (it is told to checkpoint and push the step it reached): (epochs, time-limited)."""
    from agentrl.common.curve import load_client_keys
    from agentrl.common.transport import GroupSender

    client = sup.credentials.learner()[1]
    sender = GroupSender(data["transport"]["group_endpoint"], max_unacked=8,
                         max_frame_bytes=sup.config.learner.transport.max_group_frame_bytes,
                         curve=load_client_keys(client.get("curve_server_key"), client.get("curve_client_key")))
    await sender.start()
    t0 = time.perf_counter()
    time_limited = False
    epoch = 0
    try:
        while learner.poll() is None and not time_limited:
            for i, traj in enumerate(gold):
                if learner.poll() is not None or time_limited:
                    break
                send = asyncio.ensure_future(sender.send(single_group(f"sft-{epoch}-{i}", traj)))
                while not send.done():
                    await asyncio.wait([send], timeout=1.0)
                    if learner.poll() is not None:
                        send.cancel()
                        break
                    if time.monotonic() >= stop_at:  # the learner checkpoints and pushes the step it reached
                        sup.say(f"SFT stopped by its time limit after {(time.perf_counter() - t0) / 60:.1f} minutes")
                        learner.signal(signal.SIGTERM)
                        time_limited = True
                        send.cancel()
                        break
                    if sender.num_handshakes_refused:  # not retried by ZeroMQ: nothing would ever go through
                        send.cancel()
                        raise RuntimeError(f"the SFT learner refused this run's CurveZMQ key ({sup.out / 'curve'}); "
                                           f"its log: {learner.log_path}")
            epoch += 1
    finally:
        await sender.close(timeout_s=2.0)
    return epoch, time_limited


async def demonstrations(sup) -> tuple[list, str]:
    """The SFT demonstrations (the `[sft] demonstrations` file's, else the environment's for
    `sft.num_examples` tasks; deterministic) and where they come from."""
    from agentrl.engine.demonstrations import read_demonstrations
    from agentrl.engine.episode import build_demonstration

    cfg, env = sup.config, sup.conn.env
    if cfg.sft.demonstrations:
        return await read_demonstrations(env, cfg.sft.demonstrations), cfg.sft.demonstrations
    gold = [g for t in sup.taskset.demonstration_tasks(cfg.sft.num_examples)
            if (g := await build_demonstration(env, t)) is not None]
    return gold, (f"{type(env).__name__}.demonstration" if gold else
                  f"no [sft] demonstrations file, and {type(env).__name__}.demonstration gives none for these tasks")


async def write_anchor(sup, gold: list | None = None, source: str = "") -> Path:
    """RUN/rl-anchor: the SFT demonstrations (`gold`, as the SFT phase built them) as a spool of
    one-trajectory groups, for the RL learner's demonstration anchor (learner/anchor.py).
    Written once, by the SFT phase; an RL phase that finds none (a run resumed after its SFT,
    or started from another run's SFT checkpoint: scripts/rl_from_sft.sh) builds them then."""
    from agentrl.learner.ledger import Spool

    path = sup.out / ANCHOR_DIR
    if path.is_dir() and any(path.glob("*.grp")):
        return path
    if gold is None:
        gold, source = await demonstrations(sup)
    if not gold:
        raise RuntimeError(f"learner.anchor.coef = {sup.config.learner.anchor.coef}: the demonstration anchor trains "
                           f"on the SFT demonstrations, and this run has none ({source}); set learner.anchor.coef = 0")
    return Spool.write_whole(path, (single_group(f"anchor-{i}", traj) for i, traj in enumerate(gold)))
