"""Agent episodes: an `[agent]` program (engine/agent.py) run once per group member, through a gateway
served in-process on the actor's event loop over the run's own ServerPool.

    orchestrator ── AgentEpisodes(task, group, i) ── entry: await run(task, AsyncOpenAI(session URL))
                                                  └─ command: subprocess, OPENAI_BASE_URL, task on stdin
                        agent ──HTTP──> Gateway (127.0.0.1, free port) ──> ServerPool ──> vLLM
                              └─ POST .../agentrl/tools/{name} ──> AgentTools ──> the env's tools

One episode is one gateway session, named `{sample_index}-{random hex}` and used as the agent's
base URL (`/s/{session}/v1`), so the agent needs no header. When the agent returns (or fails), the
session is closed and its record becomes the member's trajectories, exactly as
`sessions.session_trajectories` makes them: token ids, action mask, behaviour log-probs and the
per-token policy versions the servers reported (so the learner's staleness rules see the versions
that really sampled). A session with several segments (the agent rewrote its history) gives one
trajectory per segment, all with the member's `sample_index` and the member's reward; each is a
sample of the group for the learner's baseline.

Reward, concretely:
- the agent returned a number (entry) or printed one on its last stdout line (command): that is
  the task reward; the environment's `reward` is not called (metrics: `agent_reward` = 1);
- it returned None / printed `null`: the environment's `reward(task, episode)` scores an
  `EpisodeState` rebuilt from the session's newest segment: its tokens and turns, `calls` = the
  tool calls the agent made through the gateway in this session (CallRecord, turn = the number of
  model turns before the call), and `answer` = the environment's `final_answer` of the final text
  (the last action of that segment decoded, stop token removed, parsed by the environment's
  parser: for the QA environment the text inside `<answer>...</answer>`; None when there is none).
  The reward's metrics go on every trajectory, its named terms on the last turn. Agent episodes
  carry no per-turn process terms of their own (the native loop's call terms are the native
  mechanics').

Failures (the episode is recorded with status "failed" and the reason, never trained, and the
orchestrator's failure-rate rule applies; the run goes on): the entry raised (its traceback); the
command exited non-zero (the exit status and the tail of its stderr); the reward was neither a
number nor None / the last stdout line was not JSON; `agent.timeout_s` passed (a command's process
group is killed); a tool service was unreachable during a call; the agent made no model request; the
environment's `reward` raised (its traceback). Tokens recorded before a failure are kept on the
failed trajectories.

Sampling: a request without `temperature` is sampled at the run's `orchestrator.sampling.temperature`,
the temperature the learner recomputes behaviour log-probs at; an agent that sets its own trains
off that assumption. Requests are bounded by `env.max_total_tokens` (the gateway's context limit),
so a session fits the learner's rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import time
import traceback
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from agentrl.common.proctable import signal_group
from agentrl.common.trajectory import Trajectory, Turn
from agentrl.engine.agent import AgentConfig, agent_entry
from agentrl.engine.env import CallRecord, EpisodeState, ToolEnv, format_content
from agentrl.engine.services import find_program
from agentrl.engine.task import Task
from agentrl.engine.tools import ToolUnavailable
from agentrl.gateway.config import GatewayConfig
from agentrl.gateway.protocol import GatewayError
from agentrl.gateway.server import Gateway
from agentrl.gateway.sessions import session_trajectories

API_KEY = "agentrl"
"""What OPENAI_API_KEY is set to: the gateway checks no key (it listens on loopback only)."""


class AgentError(RuntimeError):
    """The agent broke its contract (exit status, reward format); the message says how."""


@dataclass
class _SessionTools:
    calls: list[CallRecord] = field(default_factory=list)
    unavailable: str | None = None
    """The first 'tool service unreachable' of the session: it fails the episode (infrastructure)."""


class AgentTools:
    """The environment's tools, served to agents by the gateway (`Gateway(tools=...)`); each call made
    in a session this runner opened is recorded for that episode's reward."""

    def __init__(self, env: ToolEnv):
        self.env = env
        self.gateway: Gateway | None = None
        self._schemas = [tool.schema() for tool in env.tools.values()]
        self._sessions: dict[str, _SessionTools] = {}

    def schemas(self) -> list[dict]:
        return self._schemas

    def open(self, session_id: str) -> None:
        self._sessions[session_id] = _SessionTools()

    def pop(self, session_id: str) -> _SessionTools:
        return self._sessions.pop(session_id)

    async def call(self, session_id: str | None, name: str, arguments: dict) -> dict:
        if name not in self.env.tools:
            raise GatewayError(404, f"no tool {name!r}; this run's tools: {', '.join(sorted(self.env.tools))}",
                               param="name", code="tool_not_found")
        book = self._sessions.get(session_id) if session_id is not None else None
        turn = self.gateway.sessions.get(session_id).counters.num_turns - 1 if book is not None else -1
        try:
            result = await self.env.call_tool(name, arguments)
        except ToolUnavailable as err:
            if book is not None and book.unavailable is None:
                book.unavailable = f"tool unavailable: {err}"
            raise GatewayError(503, f"tool {name!r} is unavailable: {err}", code="tool_unavailable") from err
        if book is not None:
            book.calls.append(CallRecord(turn, name, arguments, result.success, result.content, result.error))
        content = format_content(result.content) if result.success else None
        return {"content": content, "success": result.success, "error": result.error}


class AgentEpisodes:
    """The orchestrator's `EpisodeRunner` for an `[agent]` program (module docstring)."""

    def __init__(self, config: AgentConfig, env: ToolEnv, gateway: Gateway, tools: AgentTools):
        if not config.enabled:
            raise ValueError("AgentEpisodes needs an agent: set agent.entry or agent.command")
        self.config, self.env, self.gateway, self.tools = config, env, gateway, tools
        self._entry = agent_entry(config) if config.entry is not None else None
        self._program = find_program(config.command[0], config.cwd) if config.command is not None else None

    async def __call__(self, task: Task, group_id: str, sample_index: int) -> list[Trajectory]:
        session_id = f"{sample_index}-{uuid.uuid4().hex}"
        base_url = f"{self.gateway.base_url}/s/{session_id}/v1"
        task_json = {**task.to_json(), "tools": self.tools.schemas()}
        start = time.time()
        self.tools.open(session_id)
        reward: float | None = None
        error: str | None = None
        try:
            async with asyncio.timeout(self.config.timeout_s):
                if self._entry is not None:
                    value = await self._run_entry(task_json, base_url)
                else:
                    value = await self._run_command(task_json, base_url, session_id)
            reward = _reward_value(value)
        except TimeoutError:
            error = f"the agent did not finish within agent.timeout_s = {self.config.timeout_s:g} s"
        except AgentError as err:
            error = str(err)
        except Exception as err:  # noqa: BLE001 - the agent's own bug fails this episode, with its traceback
            error = f"the agent raised:\n{''.join(traceback.format_exception(err))}"
        record = self._close(session_id)
        book = self.tools.pop(session_id)
        error = error or book.unavailable
        if error is None and not record["segments"]:
            error = "the agent made no model request through the gateway (nothing to train)"
        timing = {"wall_s": time.time() - start, "start_time": start, "end_time": time.time()}
        if error is not None:
            return _failed(record, task, group_id, sample_index, error, timing)
        try:
            task_reward, metrics, terms = self._reward(task, record, book.calls, reward)
        except Exception as err:  # noqa: BLE001 - a user environment's bug fails this episode, as in the native loop
            return _failed(record, task, group_id, sample_index,
                           f"environment error: {''.join(traceback.format_exception(err))}", timing)
        trajectories = session_trajectories(record, task_id=task.task_id, group_id=group_id, task_reward=task_reward)
        for traj in trajectories:
            traj.sample_index = sample_index
            traj.metrics.update(metrics)
            traj.metrics["num_tools_run"] = float(len(book.calls))  # num_tool_calls: the calls the model wrote
            traj.timing = dict(timing)
        last = trajectories[-1]
        if last.turns:
            last.turns[-1].process_rewards = dict(terms)
        return trajectories

    # -- the two kinds of agent ---------------------------------------------------------------------

    async def _run_entry(self, task_json: dict, base_url: str):
        import openai

        client = openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=self.config.timeout_s)
        try:
            return await self._entry(json.loads(json.dumps(task_json)), client)
        finally:
            await client.close()

    async def _run_command(self, task_json: dict, base_url: str, session_id: str):
        argv = [self._program, *self.config.command[1:]]
        env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": API_KEY, "AGENTRL_SESSION": session_id}
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True,
                                                    cwd=self.config.cwd)
        try:
            stdout, stderr = await proc.communicate(json.dumps(task_json).encode())
        except BaseException:  # timed out or cancelled: the agent and whatever it started go, by its group id
            if proc.returncode is None:
                signal_group(proc.pid, signal.SIGKILL)
                await proc.wait()
            raise
        tail = stderr.decode(errors="replace")[-self.config.stderr_tail_chars:] if self.config.stderr_tail_chars else ""
        if proc.returncode != 0:
            raise AgentError(f"the agent command {' '.join(self.config.command)!r} exited with {proc.returncode}; "
                             f"the end of its stderr:\n{tail}")
        lines = [line for line in stdout.decode(errors="replace").splitlines() if line.strip()]
        if not lines:
            raise AgentError("the agent command printed nothing; its last stdout line must be its reward as JSON "
                             f"(a number or null); the end of its stderr:\n{tail}")
        try:
            return json.loads(lines[-1])
        except json.JSONDecodeError:
            raise AgentError(f"the agent command's last stdout line {lines[-1][:200]!r} is not JSON; it must be its "
                             "reward (a number or null)") from None

    # -- the record ---------------------------------------------------------------------------------

    def _close(self, session_id: str) -> dict:
        try:
            return self.gateway.sessions.close(session_id)
        except GatewayError:  # never opened: the agent sent no request
            return {"id": session_id, "segments": [], "counters": {}}

    def _reward(self, task: Task, record: dict, calls: list[CallRecord], reward: float | None):
        """(task reward, metrics, named terms): the agent's reward, or the environment's of the
        recorded episode (module docstring)."""
        if reward is not None:
            return reward, {"agent_reward": 1.0}, {}
        state = self.recorded_episode(task, record["segments"][-1], calls)
        scored = self.env.reward(task, state)
        return float(scored.task), {**scored.metrics, "agent_reward": 0.0}, dict(scored.terms)

    def recorded_episode(self, task: Task, segment: dict, calls: list[CallRecord]) -> EpisodeState:
        """What the environment's `reward` sees of an agent episode: one segment as an EpisodeState."""
        chat = self.env.chat
        turns = [Turn(t["action_start"], t["action_end"], t["obs_end"], num_tool_calls=t["num_tool_calls"])
                 for t in segment["turns"]]
        last = segment["turns"][-1]
        ids = segment["token_ids"][last["action_start"]:last["action_end"]]
        stopped = bool(ids) and ids[-1] in chat.stop_token_ids
        text = chat.decode(ids[:-1] if stopped else ids)
        state = EpisodeState(task=task, token_ids=list(segment["token_ids"]), is_action=list(segment["is_action"]),
                             logprobs=[0.0 if x is None else x for x in segment["logprobs"]],
                             versions=[-1 if x is None else x for x in segment["versions"]], prompt_len=segment["prompt_len"],
                             messages=[], turns=turns, done=True,
                             status="truncated" if last["finish_reason"] == "length" else "ok")
        state.answer = self.env.final_answer(self.env.parser.parse(text), text, stopped)
        state.calls = list(calls)
        state.num_calls = len(calls)
        state.tools_used = {c.name for c in calls if c.success}
        return state


def _reward_value(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise AgentError(f"the agent returned {value!r} as its reward; a reward is a finite number, or None to let "
                         "the environment's reward score the episode")
    return float(value)


def _failed(record: dict, task: Task, group_id: str, sample_index: int, error: str, timing: dict) -> list[Trajectory]:
    """The failed member: its recorded segments (every token so far), or one empty trajectory."""
    trajectories = session_trajectories(record, task_id=task.task_id, group_id=group_id) if record["segments"] else [
        Trajectory(task_id=task.task_id, group_id=group_id, sample_index=sample_index,
                   token_ids=np.zeros(0, np.int32), is_action=np.zeros(0, np.uint8),
                   behavior_logprobs=np.zeros(0, np.float32), policy_versions=np.zeros(0, np.int32),
                   prompt_len=0, turns=[], task_reward=0.0)]
    for traj in trajectories:
        traj.sample_index, traj.status, traj.error, traj.timing = sample_index, "failed", error, dict(timing)
    return trajectories


@contextlib.asynccontextmanager
async def agent_episodes(config: AgentConfig, env: ToolEnv, pool, tokenizer, *, model_dir: str | None = None,
                         temperature: float = 1.0) -> AsyncIterator[AgentEpisodes]:
    """A gateway on a free loopback port over `pool`, serving `env`'s tools, and the runner on it;
    the gateway is stopped on exit."""
    tools = AgentTools(env)
    gateway_config = GatewayConfig(
        host="127.0.0.1", port=0, max_model_len=env.config.max_total_tokens, default_temperature=temperature,
        # A session must outlive the slowest episode; the runner closes every session it opens.
        session_idle_s=max(600.0, 2 * config.timeout_s),
        gc_threshold0=None)  # the orchestrator owns the collector's thresholds in this process
    gateway = Gateway(gateway_config, tokenizer, pool, model_dir=model_dir, tools=tools)
    tools.gateway = gateway
    await gateway.start()
    try:
        yield AgentEpisodes(config, env, gateway, tools)
    finally:
        await gateway.stop()
