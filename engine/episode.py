"""One episode: the loop between a generator (vLLM through the server pool) and a ToolEnv.

`run_episode` always returns a Trajectory; it never loses an episode to an exception it can name:
- the policy misbehaving (malformed calls, no answer, limits) is handled inside the env;
- inference unavailable on every server (`InferenceServerError` after the pool's retries) or a tool
  service gone (`ToolUnavailable`) ends the episode with `status="failed"` and the reason in
  `error`, keeping every token produced so far, so the learner and the report can see it.

`build_gold_trajectory` runs the same env with a scripted policy that issues the task's gold search
queries and then the gold answer, so the tool results are the real corpus results and the token
layout (boundaries, masks) is exactly what a sampled episode has. The learner's SFT cold start
trains on its action tokens; their behavior log-probs are 0.0 and their policy version -1 (no policy
sampled them).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from agentrl.common.config import config_dataclass
from agentrl.common.inference import Generation, InferenceServerError, SamplingParams
from agentrl.common.trajectory import Trajectory
from agentrl.engine.env import ToolEnv
from agentrl.engine.tasks import QATask
from agentrl.engine.tools import ToolUnavailable

GenerateFn = Callable[[list[int], SamplingParams], Awaitable[Generation]]


@config_dataclass
class SamplingConfig:
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    seed: int | None = None
    """Base seed; turn t of sample i uses seed + 1000 * i + t, so reruns reproduce (None: unseeded)."""


async def run_episode(env: ToolEnv, task: QATask, generate: GenerateFn, sampling: SamplingConfig, *,
                      group_id: str, sample_index: int = 0, user_content: str | None = None) -> Trajectory:
    state = env.reset(task, user_content=user_content)
    while not state.done:
        max_tokens = env.max_new_tokens(state)
        seed = None if sampling.seed is None else sampling.seed + 1000 * sample_index + len(state.turns)
        params = SamplingParams(max_tokens=max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                                stop_token_ids=env.chat.stop_token_ids, seed=seed)
        start = time.perf_counter()
        try:
            generation = await generate(state.token_ids, params)
        except InferenceServerError as err:
            state.fail(f"inference failed: {err}")
            break
        finally:
            state.generate_s += time.perf_counter() - start
        try:
            await env.step(state, generation)
        except ToolUnavailable as err:
            state.fail(f"tool unavailable: {err}")
    return state.to_trajectory(group_id, sample_index)


class ScriptedPolicy:
    """Answers each generate() with the next scripted action text, as ids ending in <|im_end|>."""

    def __init__(self, env: ToolEnv, actions: list[str]):
        self._env, self._actions = env, list(actions)

    async def __call__(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if not self._actions:
            raise RuntimeError("the scripted policy ran out of actions before the episode ended")
        ids = [*self._env.chat.encode(self._actions.pop(0)), self._env.chat.im_end_id]
        return Generation(ids, [0.0] * len(ids), "stop", [-1] * len(ids), "scripted")


async def build_gold_trajectory(env: ToolEnv, task: QATask, *, group_id: str | None = None, search_tool: str = "search") -> Trajectory:
    """A correct episode for `task`: one search per gold query (real results from the env's search
    tool), then `<answer>gold</answer>`. Needs `task.gold_queries` (synthetic tasks have them).

    The env must allow len(gold_queries) + 1 turns."""
    if not task.gold_queries:
        raise ValueError(f"task {task.task_id} has no gold queries (only synthetic tasks do); cannot build a gold episode")
    if env.config.max_turns < len(task.gold_queries) + 1:
        raise ValueError(f"env.max_turns={env.config.max_turns} < {len(task.gold_queries) + 1} turns this gold episode needs")
    actions = [env.parser.format_call(search_tool, {"query": q}) for q in task.gold_queries]
    actions.append(env.parser.format_answer(task.answers[0]))
    traj = await run_episode(env, task, ScriptedPolicy(env, actions), SamplingConfig(temperature=0.0),
                             group_id=group_id or f"gold-{task.task_id}")
    traj.metrics["gold"] = 1.0
    return traj
