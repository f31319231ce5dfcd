"""Held-out evaluation through the orchestrator, and the environment's baselines.

`evaluate(conn, tasks, label)` runs every task once, greedy, with the tools, after dropping the
servers' KV and prefix caches (pushes may keep KV computed under earlier weights, learner
`publish.kv_refresh_every` > 1; an evaluation starts from none). During RL the learner goes on pushing
while it runs, so an RL-phase evaluation is a mixture of versions; its summary records the version
served at its start.

A summary holds `score` (the mean of the environment's `score_metric`), the mean of every episode
metric the environment reports (QA: em, f1), counts, turns and tool calls per episode, and, for
each metadata key in the environment's `report_by`, the same broken down by its values
(`by_<key>`: {value: {"score", "n", "calls_per_episode", and each reported metric}}; QA also keeps
`em_<n>hop`, and its failure labels give the share of each kind of failure by hop count).

With `episodes` (an `[agent]` run's runner, agentrl.gateway.agents, whose gateway samples
greedily), the held-out tasks are the agent program's episodes instead of native ones, so the score
is the agent's; the summary says which (`harness`: "agent" or "native").

`evaluate_baselines(conn, tasks)`: the environment's `baselines(tasks)` (QA: Naive RAG), each
evaluated once on the same tasks.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

from agentrl.engine.episode import SamplingConfig
from agentrl.engine.orchestrator import Orchestrator, OrchestratorConfig
from agentrl.engine.task import Task

GREEDY = OrchestratorConfig(group_size=1, max_concurrent_episodes=256, sampling=SamplingConfig(temperature=0.0),
                            max_failure_rate=1.0)
"""Evaluation reports failed episodes (num_failed) instead of stopping on them."""


async def run_tasks(env, pool, tasks: list[Task], config: OrchestratorConfig = GREEDY, *, run_id: str, sink=None,
                    episodes=None) -> list:
    """Every task through the orchestrator; the trajectories (in completion order)."""
    trajectories = []

    async def collect(group):
        trajectories.extend(group.trajectories)
        if sink is not None:
            await sink(group)

    orch = Orchestrator(env, pool.generate, collect, config, run_id=run_id, episodes=episodes)
    stats = await orch.run(tasks)
    if stats.num_episodes_started != stats.num_episodes_finished:
        raise RuntimeError(f"{stats.num_episodes_started} episodes started but {stats.num_episodes_finished} finished")
    return trajectories


def _mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)


def summarize(label: str, env, tasks: list[Task], trajectories: list, **extra) -> dict:
    metric = env.score_metric
    n = len(trajectories)
    summary = {
        "label": label,
        "time": time.time(),
        "score": _mean([t.metrics.get(metric, 0.0) for t in trajectories]),
        "score_metric": metric,
        "n": n,
        "num_failed": sum(t.status == "failed" for t in trajectories),
        "valid_call_rate": _mean([float(t.metrics.get("process/valid_call", 0.0) > 0) for t in trajectories]),
        "mean_turns": _mean([len(t.turns) for t in trajectories]),
        "calls_per_episode": _mean([t.metrics.get("num_tool_calls", 0.0) for t in trajectories]),
        **extra,
    }
    reported = sorted({k for t in trajectories for k in t.metrics if "/" not in k and k not in summary
                       and k not in ("num_turns", "num_tool_calls", "gold")})
    for key in reported:
        summary[key] = _mean([t.metrics.get(key, 0.0) for t in trajectories])
    by_id = {t.task_id: t for t in trajectories}
    for key in env.report_by:
        groups: dict[str, list] = defaultdict(list)
        for task in tasks:
            if key in task.metadata and task.task_id in by_id:
                groups[str(task.metadata[key])].append(by_id[task.task_id])
        if len(groups) < 2:
            continue
        summary[f"by_{key}"] = {value: {"score": _mean([t.metrics.get(metric, 0.0) for t in sel]), "n": len(sel),
                                        "calls_per_episode": _mean([t.metrics.get("num_tool_calls", 0.0) for t in sel]),
                                        **{k: _mean([t.metrics.get(k, 0.0) for t in sel]) for k in reported}}
                                for value, sel in sorted(groups.items())}
        for value, cell in summary[f"by_{key}"].items():  # flat, for the curves (TensorBoard: heldout/em_num_hops_2)
            summary[f"{metric}_{key}_{value}"] = cell["score"]
    return summary


async def evaluate(conn, tasks: list[Task], label: str, env=None, episodes=None, on_progress=None) -> tuple[dict, list]:
    """Greedy held-out evaluation (module docstring); returns (summary, trajectories).
    `on_progress(done, total)` is called as tasks finish (a status line's "37/96")."""
    from agentrl.common.weights import WeightPushError, reset_kv_cache

    env = env or conn.env
    versions_before = list((await conn.pool.weight_versions()).values())
    t0 = time.perf_counter()
    urls = conn.pool.live_servers
    for url, result in zip(urls, await asyncio.gather(*(reset_kv_cache(url) for url in urls), return_exceptions=True),
                           strict=True):
        if isinstance(result, WeightPushError):  # it died since: out of the pool, the others evaluate
            conn.pool.mark_dead(url, result)
        elif isinstance(result, BaseException):
            raise result
    done = 0

    async def count(group) -> None:
        nonlocal done
        done += 1
        on_progress(done, len(tasks))

    if on_progress is not None:
        on_progress(0, len(tasks))
    trajectories = await run_tasks(env, conn.pool, tasks, run_id=f"eval-{label}", episodes=episodes,
                                   sink=count if on_progress is not None else None)
    if episodes is not None:  # an agent episode may give several trajectories (segments): score its last
        trajectories = list({(t.group_id, t.sample_index): t for t in trajectories}.values())
    summary = summarize(label, env, tasks, trajectories, served_version=max(versions_before) if versions_before else -1,
                        eval_s=time.perf_counter() - t0, harness="native" if episodes is None else "agent")
    return summary, trajectories


async def evaluate_baselines(conn, tasks: list[Task]) -> dict[str, tuple[dict, list]]:
    """Each of the environment's baselines on `tasks`: name -> (summary, trajectories)."""
    out = {}
    for name, env in (await conn.env.baselines(tasks)).items():
        t0 = time.perf_counter()
        trajectories = await run_tasks(env, conn.pool, tasks, run_id=name)
        out[name] = (summarize(name, env, tasks, trajectories, served_version=0, eval_s=time.perf_counter() - t0),
                     trajectories)
    return out
