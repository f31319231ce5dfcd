"""One episode: the loop between a generator (vLLM through the server pool) and an environment.

`run_episode` always returns a Trajectory; it never loses an episode to an exception:
- the policy misbehaving (malformed calls, no answer, limits) is handled inside the environment;
- inference unavailable on every server (`InferenceServerError` after the pool's retries) or a tool
  service gone (`ToolUnavailable`) ends the episode with `status="failed"` and the reason in
  `error`, keeping every token produced so far;
- any other exception from the environment (a user environment's `step`, `reward`, `first_messages`
  raising: a bug in the environment, not the policy's doing) also fails the episode, with the
  traceback in `error`. A failed episode is reported and never trained on (the learner drops failed
  samples); the orchestrator stops the run when too many fail (OrchestratorConfig.max_failure_rate).

`build_demonstration` runs the same environment with a scripted policy that plays the environment's
`demonstration(task)` actions, so the tool results are the real tools' and the token layout
(boundaries, masks) is exactly what a sampled episode has. The SFT cold start trains on its action
tokens; their behavior log-probs are 0.0 and their policy version -1 (no policy sampled them).
`build_from_messages` does the same for a recorded conversation (a demonstration JSONL line).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Awaitable, Callable

from agentrl.common.config import config_dataclass
from agentrl.common.inference import Generation, InferenceServerError, SamplingParams
from agentrl.common.trajectory import Trajectory
from agentrl.engine.env import EpisodeState, ToolEnv
from agentrl.engine.task import Task
from agentrl.engine.tools import ToolUnavailable

GenerateFn = Callable[[list[int], SamplingParams], Awaitable[Generation]]


@config_dataclass
class SamplingConfig:
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    seed: int | None = None
    """Base seed; turn t of sample i uses seed + 1000 * i + t, so reruns reproduce (None: unseeded)."""


def _failed_start(task: Task, err: BaseException) -> EpisodeState:
    state = EpisodeState(task=task, token_ids=[], is_action=[], logprobs=[], versions=[], prompt_len=0, messages=[])
    state.fail(f"environment error at reset: {''.join(traceback.format_exception(err))}")
    return state


async def run_episode(env: ToolEnv, task: Task, generate: GenerateFn, sampling: SamplingConfig, *,
                      group_id: str, sample_index: int = 0) -> Trajectory:
    try:
        state = env.reset(task)
    except Exception as err:  # noqa: BLE001 - a user environment's bug fails this episode, with its traceback
        return _failed_start(task, err).to_trajectory(group_id, sample_index)
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
        except Exception as err:  # noqa: BLE001 - same: the environment's bug fails this episode, with its traceback
            state.fail(f"environment error: {''.join(traceback.format_exception(err))}")
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


class DemonstrationError(ValueError):
    """Scripted actions that do not make a complete, successful episode; `error` is the failed
    episode's own error text (an environment's traceback), or None."""

    def __init__(self, message: str, error: str | None = None):
        super().__init__(message)
        self.error = error


async def play(env: ToolEnv, task: Task, actions: list[str], *, group_id: str) -> Trajectory:
    """`actions` played through the environment and its real tools; DemonstrationError if they do
    not end the episode cleanly (a demonstration must be a complete, successful episode)."""
    if env.config.max_turns < len(actions):
        raise DemonstrationError(f"env.max_turns={env.config.max_turns} < {len(actions)} turns this demonstration needs")
    traj = await run_episode(env, task, ScriptedPolicy(env, actions), SamplingConfig(temperature=0.0), group_id=group_id)
    if traj.status != "ok":
        raise DemonstrationError(f"the demonstration of task {task.task_id} did not end with an answer "
                                 f"(status {traj.status}: {traj.error or 'turn or token limit'})", traj.error)
    traj.metrics["gold"] = 1.0
    return traj


async def build_demonstration(env: ToolEnv, task: Task, *, group_id: str | None = None) -> Trajectory | None:
    """The environment's demonstration of `task` as a trajectory, or None when it has none."""
    actions = env.demonstration(task)
    if actions is None:
        return None
    return await play(env, task, actions, group_id=group_id or f"gold-{task.task_id}")


async def build_from_messages(env: ToolEnv, task: Task, assistant_turns: list[str], *, group_id: str) -> Trajectory:
    """A recorded conversation's assistant turns (tool calls in the environment's format) replayed
    through the environment: the tool results are the tools' own, the tokens the environment's."""
    return await play(env, task, assistant_turns, group_id=group_id)
