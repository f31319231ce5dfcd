"""Phase 4 of `agentrl train`: asynchronous RL. A learner process (`rl` mode, initialised from the
SFT checkpoint when there is one) and an actor process (engine/actor.py) run side by side; the
learner pushes weights every step while rollouts continue. Every 2 s the supervisor checks them
and the services (a dead vLLM server or tool service is started again: agentrl/launch/keeper.py;
a dead learner too, up to `services.max_learner_restarts`, resuming from its checkpoint and spool,
so that no group is lost or trained twice), evaluates on the held-out set every `eval.every_s`
while evaluations stay within `eval.max_share` of the budget, and stops both early enough that
the final evaluation still fits in the budget. With less than a minute left for it, the phase is
skipped and the report says that RL did not run."""

from __future__ import annotations

import asyncio
import math
import time

from agentrl.budget import MIN_RL_PHASE_S, rl_eval_fits, rl_shortfall_message
from agentrl.engine.roles import agentrl_argv
from agentrl.phases.sft import write_anchor


async def rl_phase(sup) -> None:
    cfg = sup.config
    rl_s = sup.deadline - sup.final_eval_reserve_s() - time.monotonic()
    if rl_s < sup.rl_min_s():
        sup.say(rl_shortfall_message(rl_s, cfg.rl_min_share, cfg.minutes))
    if rl_s < MIN_RL_PHASE_S and not sup.resume:  # resumed: its learner pushes the run's checkpoint to the new server
        sup.say(f"RL phase skipped: {max(rl_s, 0):.0f} s of the budget are left before the final evaluation, "
                f"less than the {MIN_RL_PHASE_S:.0f} s a learner and an actor need to make a step")
        sup.phase_done("rl", {"skipped": "no time left", "rl_s": 0.0, "rl_steps": 0})
        return
    overrides: dict = {}
    if cfg.sft.enabled and not sup.phases.get("sft", {}).get("skipped"):
        overrides["init_checkpoint"] = str(sup.out / "sft" / "checkpoints")
    if cfg.learner.anchor.coef > 0 and cfg.sft.enabled:
        overrides["anchor_dir"] = str(await write_anchor(sup))
    elif cfg.learner.anchor.coef > 0:  # the anchor follows the demonstrations: none are read without SFT
        overrides["anchor"] = {"coef": 0.0}
        sup.say(f"demonstration anchor off (learner.anchor.coef = {cfg.learner.anchor.coef}): sft.enabled = false, "
                "so no demonstration is read; RL learns from the rewards alone")
    learner_slot, config_path, data = sup.learner_config("rl", overrides)
    actor_path = sup.actor_config(data)
    sup.keeper.write_directory(data["transport"])
    learner_argv = agentrl_argv("learner", "--config", str(config_path.resolve()))
    sup.set_phase("rl")
    rl_start = time.monotonic()
    rl_eval_s = 0.0  # the RL-phase evaluations' time, counted with the evaluations
    learner = sup.start(learner_slot, learner_argv, control=True)
    actor = sup.start(sup.launcher.place("actor", "actor"), agentrl_argv("actor", "--config", str(actor_path.resolve())))
    next_eval = time.monotonic() + cfg.eval.every_s
    started_wall = time.time()
    stopped_reason = "budget"

    def rl_end() -> float:  # an evaluation outside the budget moves the deadline
        return sup.deadline - sup.final_eval_reserve_s()

    try:
        sup.say(f"RL phase: {max(rl_end() - time.monotonic(), 0) / 60:.1f} minutes")
        while time.monotonic() < rl_end():
            await asyncio.sleep(2.0)
            if actor.poll() is not None:
                raise RuntimeError(f"actor exited with {actor.poll()}; log {actor.log_path}:\n{actor.log_tail()}")
            await sup.keeper.check()
            rc = learner.poll()
            if rc is not None:
                if rc == 0:
                    sup.say("learner finished its max_steps")
                    stopped_reason = "max_steps"
                    break
                if sup.learner_restarts >= cfg.services.max_learner_restarts:
                    raise RuntimeError(f"learner died {sup.learner_restarts + 1} times; log {learner.log_path}:\n{learner.log_tail()}")
                sup.learner_restarts += 1
                sup.say(f"learner exited with {rc}; restarting it (restart {sup.learner_restarts}), "
                        "it resumes from its checkpoint")
                sup.procs.remove(learner)
                # In a thread: stopping what is left of a lost gang takes a while, and the loop answers heartbeats.
                again = await asyncio.to_thread(sup.keeper.learner_slot_again, learner, config_path, data)
                learner = sup.start(again, learner_argv, control=True)
            max_eval_s = cfg.eval.max_share * cfg.minutes * 60 if cfg.eval.in_budget else math.inf
            if rl_eval_fits(time.monotonic(), sup.evaluations.of_this_process, next_eval_s=next_eval,
                            rl_end_s=rl_end(), in_budget=cfg.eval.in_budget, max_eval_s=max_eval_s):
                t_eval = time.monotonic()
                summary, trajs = await sup.evaluations.run(sup.heldout, "rl")
                sup.log_eval(summary, trajs)
                rl_eval_s += time.monotonic() - t_eval
                next_eval = time.monotonic() + cfg.eval.every_s
            why = no_signal(actor_stats(sup.out, since=started_wall), cfg.rl)
            if why is not None and cfg.rl.stop_when_no_signal:
                sup.say(f"RL stopped: no learning signal left ({why}; rl.stop_when_no_signal = true)")
                stopped_reason = "no_signal"
                break
    finally:
        # In threads: the event loop must keep answering the tool services' heartbeats.
        await asyncio.to_thread(actor.stop, 30)
        await asyncio.to_thread(learner.stop, 120)
    from agentrl.learner.checkpoint import checkpoint_dirs, checkpoint_step

    first_version = sup.phases.get("sft", {}).get("steps_done", 0) if "init_checkpoint" in overrides else 0
    # The latest checkpoint's step, not the last metrics line: a learner killed mid-run leaves
    # lines of steps its successor redoes or never reaches.
    checkpoints = checkpoint_dirs(sup.out / "rl" / "checkpoints")
    last_version = checkpoint_step(checkpoints[-1]) if checkpoints else first_version
    sup.phase_done("rl", {"learner_restarts": sup.learner_restarts, "server_restarts": sup.keeper.restarts["inference"],
                          "tool_restarts": sup.keeper.restarts["tools"],
                          "learner_rc": learner.poll(), "actor_rc": actor.poll(),
                          "rl_s": time.monotonic() - rl_start - rl_eval_s, "rl_steps": max(last_version - first_version, 0),
                          "stopped_reason": stopped_reason,
                          "first_version": first_version, "last_version": last_version})


def actor_stats(out, since: float) -> dict:
    """The actor's latest stats record written after `since` (unix seconds), or {}: a resumed run's
    first seconds must not read what the previous actor saw."""
    from agentrl.progress import tail_records

    latest = tail_records(out / "actor" / "stats.jsonl", 1)
    return latest[-1] if latest and latest[-1].get("time", 0.0) >= since else {}


def no_signal(stats: dict, rl) -> str | None:
    """Why the recent groups carry no learning signal (`rl.no_signal_groups`, `rl.no_signal_share`,
    runconfig.RLConfig), from the actor's stats (engine/curriculum.py `SignalMonitor`), or None."""
    recent, equal = stats.get("signal/recent_groups", 0), stats.get("signal/recent_equal", 0)
    if recent >= rl.no_signal_groups and equal >= rl.no_signal_share * recent:
        return f"{equal} of the last {recent} groups had the same rewards in every sample"
    return None
