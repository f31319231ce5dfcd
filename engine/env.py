"""ToolEnv: the agent MDP. It parses actions, calls tools, builds observations, rewards and termination.

Lifecycle of one episode (driven by `episode.run_episode`):
    state = env.reset(task)                       # ids: system + user + "<|im_start|>assistant\\n"
    while not state.done:
        gen = await generate(state.token_ids, env.sampling_params(state, ...))
        transition = await env.step(state, gen)   # appends action ids, then observation ids
    traj = state.to_trajectory(group_id, sample_index)

Rules the env owns (all in `EnvConfig`): max turns, max total tokens, per-turn generation budget,
tool timeouts, per-turn and per-episode call limits, observation size, and what each malformed call
costs (`ProcessRewardConfig`). A malformed call (bad JSON, unknown tool, schema violation, truncated
tag, unclosed answer) becomes a readable error inside the tool message plus a process penalty; it
never raises. The only exception `step` lets through is `ToolUnavailable` (infrastructure: the
runner marks the episode failed instead of penalising the policy).

Token bookkeeping (the trajectory invariants): the action appended is a prefix of the ids the server
returned, with their log-probs and versions unchanged. Generation stops on `<|im_end|>`; if the
text goes on past the end of the action (after `</answer>`, or an imagined `<tool_response>` after
the last `</tool_call>`) the ids are cut at the first token whose text reaches the cut point, and
the turn is closed with `<|im_end|>\\n` as observation (non-action) ids. Observations are tokenized
once and appended. So `decode(state.token_ids) == render(state.messages)`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Literal

import jsonschema
import numpy as np

from agentrl.common.config import config_dataclass
from agentrl.common.trajectory import Trajectory, Turn
from agentrl.engine import rewards as R
from agentrl.engine.chat import CLOSED, EXAMPLE_MESSAGES, IM_END, ChatFormat, system_prompt
from agentrl.engine.metrics import exact_match, f1_score
from agentrl.engine.parsers import HermesParser, ToolCall, ToolCallParser
from agentrl.engine.tasks import QATask
from agentrl.engine.tools import Tool, ToolResult


@config_dataclass
class EnvConfig:
    max_turns: int = 4
    """Policy turns per episode; the episode is truncated after the last one."""
    max_total_tokens: int = 4096
    """Whole episode length (prompt + actions + observations), tokens; must fit the server's max_model_len."""
    max_action_tokens: int = 128
    """Generation budget per turn, tokens. A correct 2-hop SmolLM2 episode used ~146 generated tokens in all."""
    min_action_tokens: int = 16
    """The episode is truncated when fewer tokens than this would be left for the next turn."""
    max_calls_per_turn: int = 3
    max_calls_per_episode: int = 8
    tool_timeout_s: float = 10.0
    """Per call; a call past it is a failed result ("timed out"), not a crash."""
    max_observation_tokens: int = 512
    """Tool message content beyond this many tokens is cut (3 passages of the synthetic corpus: ~90)."""
    task_metric: Literal["em", "f1"] = "em"
    """Task reward: "em" (exact match in {0, 1}) or "f1"."""
    plain_text_is_answer: bool = False
    """Take an action without tags that ended with <|im_end|> as the final answer (Naive RAG)."""
    tool_list: Literal["json", "signature"] = "json"
    """How the system prompt lists the tools: "json" (whole schemas) or "signature" (one short line
    each); see chat.system_prompt."""
    worked_example: bool = True
    """Put one worked example (chat.EXAMPLE_MESSAGES: ~200 tokens) between the system message and the
    question. The untrained model needs it to call tools at all; a policy cold-started on gold
    trajectories does not, and every episode is then 200 tokens shorter to sample and to train."""
    rewards: R.ProcessRewardConfig = field(default_factory=R.ProcessRewardConfig)

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_action_tokens < 1 or self.max_total_tokens <= self.max_action_tokens:
            raise ValueError("EnvConfig needs max_turns >= 1, max_action_tokens >= 1 and max_total_tokens > max_action_tokens")


@dataclass
class EpisodeState:
    task: QATask
    token_ids: list[int]
    is_action: list[int]
    logprobs: list[float]
    versions: list[int]
    prompt_len: int
    messages: list[tuple[str, str, str]]
    """(role, content, tail) per message, in order: what `token_ids` decodes to (see chat.render)."""
    turns: list[Turn] = field(default_factory=list)
    done: bool = False
    status: str = "ok"
    error: str | None = None
    answer: str | None = None
    task_reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    call_cache: dict[str, ToolResult] = field(default_factory=dict)
    tools_used: set[str] = field(default_factory=set)
    num_calls: int = 0
    generate_s: float = 0.0
    tool_s: float = 0.0
    start_time: float = field(default_factory=time.time)

    def append(self, ids: list[int], *, logprobs: list[float] | None = None, versions: list[int] | None = None) -> None:
        self.token_ids.extend(ids)
        if logprobs is None:
            self.is_action.extend([0] * len(ids))
            self.logprobs.extend([0.0] * len(ids))
            self.versions.extend([-1] * len(ids))
        else:
            self.is_action.extend([1] * len(ids))
            self.logprobs.extend(logprobs)
            self.versions.extend(versions)

    def fail(self, reason: str) -> None:
        self.done, self.status, self.error = True, "failed", reason

    def to_trajectory(self, group_id: str, sample_index: int) -> Trajectory:
        num_turns = len(self.turns)
        metrics = {"num_turns": float(num_turns), "num_tool_calls": float(self.num_calls), **self.metrics}
        for turn in self.turns:
            for term, value in turn.process_rewards.items():
                metrics[f"process/{term}"] = metrics.get(f"process/{term}", 0.0) + value
        end = time.time()
        traj = Trajectory(
            task_id=self.task.task_id, group_id=group_id, sample_index=sample_index,
            token_ids=np.asarray(self.token_ids, dtype=np.int32), is_action=np.asarray(self.is_action, dtype=np.uint8),
            behavior_logprobs=np.asarray(self.logprobs, dtype=np.float32), policy_versions=np.asarray(self.versions, dtype=np.int32),
            prompt_len=self.prompt_len, turns=self.turns, task_reward=float(self.task_reward), status=self.status, error=self.error,
            metrics=metrics,
            timing={"generate_s": self.generate_s, "tool_s": self.tool_s, "wall_s": end - self.start_time,
                    "start_time": self.start_time, "end_time": end},
        )
        traj.validate()
        return traj


@dataclass
class Transition:
    observation_ids: list[int]
    process_rewards: dict[str, float]
    done: bool


class ToolEnv:
    def __init__(self, chat: ChatFormat, config: EnvConfig | None = None, *, parser: ToolCallParser | None = None,
                 system_prompt_text: str | None = None, example_messages: tuple[tuple[str, str], ...] | None = None):
        self.chat = chat
        self.config = config or EnvConfig()
        self.parser = parser or HermesParser()
        self.tools: dict[str, Tool] = {}
        self._validators: dict[str, jsonschema.protocols.Validator] = {}
        self._system_prompt_text = system_prompt_text
        if example_messages is None:
            example_messages = EXAMPLE_MESSAGES if self.config.worked_example else ()
        self.example_messages = tuple(example_messages)
        """Chat turns between the system message and the question (a worked example); () for none."""
        self._prefix_ids: list[int] | None = None
        self._prefix_messages: list[tuple[str, str, str]] = []

    def register_tool(self, tool: Tool) -> None:
        if tool.name in self.tools:
            raise ValueError(f"a tool named {tool.name!r} is already registered")
        validator_cls = jsonschema.validators.validator_for(tool.parameters)
        validator_cls.check_schema(tool.parameters)
        self.tools[tool.name] = tool
        self._validators[tool.name] = validator_cls(tool.parameters)
        self._prefix_ids = None

    @property
    def system_prompt(self) -> str:
        if self._system_prompt_text is not None:
            return self._system_prompt_text
        return system_prompt([t.schema() for t in self.tools.values()], self.config.tool_list)

    def reset(self, task: QATask, user_content: str | None = None) -> EpisodeState:
        if self._prefix_ids is None:
            # The same for every episode, so built and tokenized once (and prefix-cached by vLLM).
            # Rebuilding the system prompt per episode (it serialises every tool schema) cost ~270 us
            # of orchestrator CPU per episode in the capacity benchmark.
            prefix = [("system", self.system_prompt), *self.example_messages]
            self._prefix_messages = [(role, content, CLOSED) for role, content in prefix]
            self._prefix_ids = [i for role, content in prefix for i in self.chat.message(role, content)]
        user = user_content if user_content is not None else f"Question: {task.question}"
        ids = [*self._prefix_ids, *self.chat.message("user", user), *self.chat.assistant_head_ids]
        messages = [*self._prefix_messages, ("user", user, CLOSED), ("assistant", "", "")]
        return EpisodeState(task=task, token_ids=ids, is_action=[0] * len(ids), logprobs=[0.0] * len(ids),
                            versions=[-1] * len(ids), prompt_len=len(ids), messages=messages)

    def max_new_tokens(self, state: EpisodeState) -> int:
        return min(self.config.max_action_tokens, self.config.max_total_tokens - len(state.token_ids))

    async def step(self, state: EpisodeState, action) -> Transition:
        """Apply one generated action (`inference.Generation` or anything with token_ids, logprobs,
        versions, finish_reason). Mutates `state`; returns what was appended and earned."""
        if state.done:
            raise RuntimeError("step() on a finished episode")
        ids, logprobs, versions = list(action.token_ids), list(action.logprobs), list(action.versions)
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError("action token_ids, logprobs and versions differ in length")
        stopped = bool(ids) and ids[-1] in self.chat.stop_token_ids
        text = self.chat.decode(ids[:-1] if stopped else ids)
        cut = self.parser.cut_point(text)
        if cut < len(text):
            keep = self._tokens_covering(ids, cut)
            ids, logprobs, versions, stopped = ids[:keep], logprobs[:keep], versions[:keep], False
            text = self.chat.decode(ids)
        action_start = len(state.token_ids)
        state.append(ids, logprobs=logprobs, versions=versions)
        state.messages[-1] = ("assistant", text, IM_END if stopped else "")
        turn = Turn(action_start=action_start, action_end=len(state.token_ids), obs_end=len(state.token_ids))
        state.turns.append(turn)

        terms: dict[str, float] = {}
        parsed = self.parser.parse(text)
        turn.num_tool_calls = len(parsed.calls) + len(parsed.errors)
        if parsed.answer is None and self.config.plain_text_is_answer and stopped and not parsed.calls and not parsed.errors:
            parsed.answer = text.strip()
        if parsed.answer is not None:
            self._finish(state, parsed.answer)
            return self._close(state, turn, terms, [], stopped)

        responses: list[str] = []
        for err in parsed.errors:
            self._add(terms, R.MALFORMED_CALL)
            responses.append(self._error_response(None, f"malformed tool call ({err.kind}): {err.message}"))
        if parsed.answer_truncated:
            self._add(terms, R.MALFORMED_CALL)
            responses.append(self._error_response(None, "the <answer> tag was not closed with </answer>"))
        if not parsed.calls and not responses:
            self._add(terms, R.NO_ACTION)
            responses.append(self._error_response(None, "no tool call and no answer: call a tool with <tool_call>{...}</tool_call> or answer with <answer>...</answer>"))
        responses.extend(await self._run_calls(state, parsed.calls, terms))
        return self._close(state, turn, terms, responses, stopped)

    # -- internals -------------------------------------------------------------------------------

    def _tokens_covering(self, ids: list[int], num_chars: int) -> int:
        """Smallest k such that decode(ids[:k]) has at least `num_chars` characters (binary search:
        decoded length grows with k)."""
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.chat.decode(ids[:mid])) >= num_chars:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _add(self, terms: dict[str, float], term: str, count: int = 1) -> None:
        terms[term] = terms.get(term, 0.0) + count * self.config.rewards.value(term)

    async def _run_calls(self, state: EpisodeState, calls: list[ToolCall], terms: dict[str, float]) -> list[str]:
        cfg = self.config
        responses: list[str | None] = [None] * len(calls)
        to_run: list[tuple[int, ToolCall, str]] = []
        for i, call in enumerate(calls):
            if i >= cfg.max_calls_per_turn or state.num_calls >= cfg.max_calls_per_episode:
                self._add(terms, R.OVER_LIMIT)
                limit = f"{cfg.max_calls_per_turn} per turn" if i >= cfg.max_calls_per_turn else f"{cfg.max_calls_per_episode} per episode"
                responses[i] = self._error_response(call.name, f"call limit reached ({limit}); the call was not run")
                continue
            state.num_calls += 1
            tool = self.tools.get(call.name)
            if tool is None:
                self._add(terms, R.MALFORMED_CALL)
                responses[i] = self._error_response(call.name, f"unknown tool {call.name!r}; available: {', '.join(sorted(self.tools))}")
                continue
            schema_error = next(iter(self._validators[call.name].iter_errors(call.arguments)), None)
            if schema_error is not None:
                self._add(terms, R.MALFORMED_CALL)
                where = "/".join(map(str, schema_error.absolute_path)) or "arguments"
                responses[i] = self._error_response(call.name, f"invalid arguments at {where}: {schema_error.message}")
                continue
            self._add(terms, R.VALID_CALL)
            key = call.name + "\x00" + json.dumps(call.arguments, sort_keys=True)
            if key in state.call_cache:
                self._add(terms, R.DUPLICATE_CALL)
                responses[i] = self._format_result(call.name, state.call_cache[key])
                continue
            to_run.append((i, call, key))

        if to_run:
            start = time.perf_counter()
            if len(to_run) == 1:  # the usual case; gather would wrap the one call in a task
                results = [await self._execute(self.tools[to_run[0][1].name], to_run[0][1].arguments)]
            else:
                results = await asyncio.gather(*(self._execute(self.tools[c.name], c.arguments) for _, c, _ in to_run))
            state.tool_s += time.perf_counter() - start
            for (i, call, key), result in zip(to_run, results, strict=True):
                state.call_cache[key] = result
                if result.success:
                    self._add(terms, R.TOOL_SUCCESS)
                    if call.name not in state.tools_used:
                        if state.tools_used:
                            self._add(terms, R.TOOL_DIVERSITY)
                        state.tools_used.add(call.name)
                else:
                    state.metrics["num_tool_failures"] = state.metrics.get("num_tool_failures", 0.0) + 1
                responses[i] = self._format_result(call.name, result)
        return [r for r in responses if r is not None]

    async def _execute(self, tool: Tool, arguments: dict) -> ToolResult:
        timeout_s = self.config.tool_timeout_s
        start = time.perf_counter()
        try:
            # The tool gets the deadline too; the outer bound (plus 1 s for the reply to travel) covers a tool that ignores it.
            # asyncio.timeout, not wait_for: wait_for wraps the call in a new task (Python 3.11), a
            # measurable share of the orchestrator's per-turn CPU with thousands of episodes.
            async with asyncio.timeout(timeout_s + 1.0):
                return await tool.execute(arguments, timeout_s=timeout_s)
        except TimeoutError:
            return ToolResult(None, False, time.perf_counter() - start, f"timed out after {timeout_s} s")

    @staticmethod
    def _error_response(name: str | None, message: str) -> str:
        body = {"name": name, "error": message} if name else {"error": message}
        return f"<tool_response>\n{json.dumps(body)}\n</tool_response>"

    def _format_result(self, name: str, result: ToolResult) -> str:
        if not result.success:
            return self._error_response(name, result.error or "the tool failed")
        return f"<tool_response>\n{format_content(result.content)}\n</tool_response>"

    def _finish(self, state: EpisodeState, answer: str) -> None:
        state.answer = answer
        state.done = True
        em, f1 = exact_match(answer, state.task.answers), f1_score(answer, state.task.answers)
        state.metrics.update(em=em, f1=f1)
        state.task_reward = em if self.config.task_metric == "em" else f1

    def _close(self, state: EpisodeState, turn: Turn, terms: dict[str, float], responses: list[str], stopped: bool) -> Transition:
        """Record the turn's rewards; unless the episode ends here, append the observation
        (close the assistant message, the tool message, open the next assistant message)."""
        turn.process_rewards = terms
        cfg = self.config
        if not state.done and len(state.turns) >= cfg.max_turns:
            state.done, state.status = True, "truncated"
        obs: list[int] = []
        if not state.done:
            content_ids: list[int] = []
            for k, response in enumerate(responses):  # responses joined by "\n", each encoded once (memo)
                content_ids += (self.chat.newline_ids if k else []) + self.chat.encode_cached(response)
            content = "\n".join(responses)
            if len(content_ids) > cfg.max_observation_tokens:
                content_ids = content_ids[: cfg.max_observation_tokens]
                content = self.chat.decode(content_ids)
            obs = [*(self.chat.newline_ids if stopped else self.chat.turn_end_ids), *self.chat.role_head("tool"),
                   *content_ids, *self.chat.turn_end_ids, *self.chat.assistant_head_ids]
            if len(state.token_ids) + len(obs) + cfg.min_action_tokens > cfg.max_total_tokens:
                state.done, state.status, obs = True, "truncated", []
        if state.done:
            if state.answer is None:
                state.metrics.update(em=0.0, f1=0.0)
                if state.status == "truncated" and cfg.rewards.no_answer:
                    terms[R.NO_ANSWER] = terms.get(R.NO_ANSWER, 0.0) + cfg.rewards.no_answer
            return Transition([], terms, True)
        state.messages[-1] = ("assistant", state.messages[-1][1], CLOSED)
        state.messages += [("tool", content, CLOSED), ("assistant", "", "")]
        state.append(obs)
        turn.obs_end = len(state.token_ids)
        return Transition(obs, terms, False)


def format_content(content) -> str:
    """Tool content as the model reads it: passages as numbered "title: text" lines, other
    structures as compact JSON, strings as they are."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(c, dict) and "text" in c for c in content):
        if not content:
            return "no results"
        return "\n".join(f"[{i}] {c.get('title', '')}: {c['text']}" for i, c in enumerate(content, 1))
    return json.dumps(content, ensure_ascii=False)
