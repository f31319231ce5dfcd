"""Held-out evaluation through the orchestrator, and the Naive RAG baseline.

`evaluate(conn, tasks, label)` runs every task once, greedy, with the tools, after dropping the
servers' KV and prefix caches (pushes may keep KV computed under earlier weights, learner
`kv_refresh_every` > 1; an evaluation starts from none). During RL the learner goes on pushing
while it runs, so an RL-phase evaluation is a mixture of versions; its summary records the version
served at its start. The summary holds EM, F1, counts and, when the tasks differ in hop count or
source, EM per hop count and per source.

`run_naive_rag(conn, tasks)`: retrieve once with the question (top 3 passages), put them in the
prompt, answer in one turn. It needs a `search` tool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from agentrl.engine.episode import SamplingConfig
from agentrl.engine.orchestrator import Orchestrator, OrchestratorConfig
from agentrl.engine.tasks import QATask

GREEDY = OrchestratorConfig(group_size=1, max_concurrent_episodes=256, sampling=SamplingConfig(temperature=0.0))


async def run_tasks(env, pool, tasks: list[QATask], config: OrchestratorConfig = GREEDY, *, run_id: str,
                    user_content=None, sink=None) -> list:
    """Every task through the orchestrator; the trajectories (in completion order)."""
    trajectories = []

    async def collect(group):
        trajectories.extend(group.trajectories)
        if sink is not None:
            await sink(group)

    orch = Orchestrator(env, pool.generate, collect, config, run_id=run_id, user_content=user_content)
    stats = await orch.run(tasks)
    if stats.num_episodes_started != stats.num_episodes_finished:
        raise RuntimeError(f"{stats.num_episodes_started} episodes started but {stats.num_episodes_finished} finished")
    return trajectories


def summarize(label: str, tasks: list[QATask], trajectories: list, **extra) -> dict:
    n = len(trajectories)
    summary = {
        "label": label,
        "time": time.time(),
        "em": sum(t.metrics.get("em", 0.0) for t in trajectories) / max(n, 1),
        "f1": sum(t.metrics.get("f1", 0.0) for t in trajectories) / max(n, 1),
        "n": n,
        "num_failed": sum(t.status == "failed" for t in trajectories),
        "valid_call_rate": sum(t.metrics.get("process/valid_call", 0.0) > 0 for t in trajectories) / max(n, 1),
        "mean_turns": sum(len(t.turns) for t in trajectories) / max(n, 1),
        **extra,
    }
    for key, name in (("num_hops", "em_{}hop"), ("source", "em_{}")):
        values = sorted({getattr(task, key) for task in tasks})
        if len(values) < 2:
            continue
        for value in values:
            ids = {task.task_id for task in tasks if getattr(task, key) == value}
            sel = [t for t in trajectories if t.task_id in ids]
            summary[name.format(value)] = sum(t.metrics.get("em", 0.0) for t in sel) / max(len(sel), 1)
    return summary


async def evaluate(conn, tasks: list[QATask], label: str) -> tuple[dict, list]:
    """Greedy held-out evaluation (module docstring); returns (summary, trajectories)."""
    from agentrl.common.weights import reset_kv_cache

    versions_before = [await s.client.weight_version() for s in conn.pool.servers if s.alive]
    t0 = time.perf_counter()
    await asyncio.gather(*(reset_kv_cache(url) for url in conn.pool.live_servers))
    trajectories = await run_tasks(conn.env, conn.pool, tasks, run_id=f"eval-{label}")
    summary = summarize(label, tasks, trajectories, served_version=max(versions_before) if versions_before else -1,
                        eval_s=time.perf_counter() - t0)
    return summary, trajectories


async def run_naive_rag(conn, tasks: list[QATask], top_k: int = 3) -> tuple[dict, list]:
    """Naive RAG (module docstring); returns (summary, trajectories)."""
    from agentrl.engine.chat import NAIVE_RAG_EXAMPLE_MESSAGES, NAIVE_RAG_SYSTEM_PROMPT
    from agentrl.engine.env import ToolEnv, format_content

    search = next((t for t in conn.tools if t.name == "search"), None)
    if search is None:
        raise RuntimeError("Naive RAG needs a 'search' tool; the tool services offer " + ", ".join(t.name for t in conn.tools))
    t0 = time.perf_counter()
    results = await asyncio.gather(*(search.execute({"query": t.question, "top_k": top_k}) for t in tasks))
    contexts = {}
    for task, result in zip(tasks, results, strict=True):
        if not result.success:
            raise RuntimeError(f"Naive RAG retrieval failed for {task.task_id}: {result.error}")
        contexts[task.task_id] = f"Passages:\n{format_content(result.content)}\n\nQuestion: {task.question}"
    env_cfg = dataclasses.replace(conn.env_config, max_turns=1, plain_text_is_answer=True)
    env = ToolEnv(conn.chat, env_cfg, system_prompt_text=NAIVE_RAG_SYSTEM_PROMPT, example_messages=NAIVE_RAG_EXAMPLE_MESSAGES)
    trajectories = await run_tasks(env, conn.pool, tasks, run_id="naive-rag", user_content=lambda t: contexts[t.task_id])
    return summarize("naive_rag", tasks, trajectories, served_version=0, eval_s=time.perf_counter() - t0), trajectories
