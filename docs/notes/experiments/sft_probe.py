"""Issue 15 measurement: the SFT phase of a run config alone, with greedy held-out evaluations of the
SFT policy at intermediate steps (EM and searches by hop count), without the base evaluation or RL.

    .venv/bin/python -P docs/notes/experiments/sft_probe.py CONFIG OUT_DIR EVERY [KEY.PATH=VALUE ...]

It uses the same pieces as `agentrl train` (services, the demonstrations, the SFT learner, the
evaluation): the learner pushes its weights every EVERY steps (and at its last), and each pushed
version is evaluated on the held-out set while the learner goes on (so the learner's step times
are not those of a run). OUT_DIR holds the run folder (evals/, logs/, sft/); one JSON line per
evaluation, and the last line printed is one JSON object with all of them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path

from agentrl.common.config import layer
from agentrl.common.trajectory import TrajectoryGroup
from agentrl.common.transport import GroupSender
from agentrl.engine.episode import build_demonstration
from agentrl.engine.evaluation import evaluate
from agentrl.engine.services import Connections
from agentrl.runconfig import load_run_config
from agentrl.train import Supervisor, _agentrl


def _row(summary: dict) -> dict:
    by = summary.get("by_num_hops", {})
    return {"version": summary["served_version"], "em": round(summary["em"], 4), "eval_s": round(summary["eval_s"], 1),
            "em_by_hops": {h: round(v["em"], 4) for h, v in by.items()},
            "calls_by_hops": {h: round(v["calls_per_episode"], 3) for h, v in by.items()}}


async def main(config_file: str, out: Path, every: int, sets: list[str]) -> dict:
    config = load_run_config(config_file, sets).config
    out.mkdir(parents=True, exist_ok=False)
    sup = Supervisor(config, out)
    sup.prepare()
    rows: list[dict] = []
    try:
        await sup.start_services()
        async with Connections(sup.services.vllm_urls, sup.services.remote, sup.model_dir, config.env,
                               sup.services.local) as conn:
            sup.conn = conn
            env = conn.env
            gold = [g for t in sup.taskset.demonstration_tasks(config.sft.num_examples)
                    if (g := await build_demonstration(env, t)) is not None]
            steps = config.sft.steps
            overrides = layer(config.sft.learner, {"max_steps": steps, "publish_every": every, "checkpoint_every": steps})
            config_path, data = sup._learner_config("sft", overrides)
            learner = sup._start("learner-sft", _agentrl("learner", "--config", str(config_path)))
            sender = GroupSender(data["transport"]["group_endpoint"], max_unacked=8,
                                 max_frame_bytes=config.learner.transport.max_group_frame_bytes)
            await sender.start()
            t0 = time.monotonic()

            async def stream() -> None:
                epoch = 0
                while learner.poll() is None:
                    for i, traj in enumerate(gold):
                        if learner.poll() is not None:
                            return
                        gid = f"sft-{epoch}-{i}"
                        send = asyncio.ensure_future(sender.send(TrajectoryGroup(gid, traj.task_id, [dataclasses.replace(traj, group_id=gid)])))
                        while not send.done():
                            await asyncio.wait([send], timeout=1.0)
                            if learner.poll() is not None:
                                send.cancel()
                                return
                    epoch += 1

            streaming = asyncio.ensure_future(stream())
            evaluated = {0}
            while True:
                version = max((await conn.pool.weight_versions()).values())
                if version not in evaluated:
                    evaluated.add(version)
                    summary, trajs = await evaluate(conn, sup.heldout, "sft", episodes=None)
                    sup._log_eval(summary, trajs)
                    rows.append({**_row(summary), "at_s": round(time.monotonic() - t0, 1)})
                    print(json.dumps(rows[-1]), flush=True)
                    if version >= steps:
                        break
                elif learner.poll() is not None and learner.poll() != 0:
                    raise RuntimeError(f"SFT learner exited with {learner.poll()}; log {learner.log_path}")
                await asyncio.sleep(2.0)
            streaming.cancel()
            await sender.close(timeout_s=2.0)
    finally:
        sup.stop_all()
    return {"config": config_file, "sets": sets, "every": every, "evals": rows}


if __name__ == "__main__":
    result = asyncio.run(main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]))
    print(json.dumps(result))
