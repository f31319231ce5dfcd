"""ToolEnv: the agent MDP. The public base class of every environment: it parses actions, calls tools,
builds observations, rewards and termination, and asks its hooks what the task means.

An environment is a subclass; the engine (orchestrator, episode loop, trajectory, learner) never
looks inside a task. The hooks (override what you need; docs/ENVIRONMENTS.md has examples):

    intro()                    the system prompt's instructions (how to call tools, how to finish)
    system_prompt              intro + the registered tools, as JSON schemas or one-line signatures
    example_messages()         worked-example turns after the system message (() for none)
    example_messages_for(task) the worked-example turns one task sees (default: example_messages();
                               an environment may vary them per task, e.g. their order)
    first_messages(task)       the opening turns for a task (default: task.messages, or the user
                               message `user_prefix + task.prompt`)
    final_answer(parsed, ...)  what ends the episode with an answer (default: <answer>...</answer>;
                               with `finish_tool`, also a call to that tool, whose arguments are
                               the answer)
    refuse(state, parsed)      a rule of the environment the action breaks, as the message the policy
                               is shown instead of carrying it out (its calls are not run, its
                               answer does not end the episode; the turn counts, with the
                               `no_action` term), or None (default: None)
    observation_note(state)    text the environment ends the next tool message with (after the
                               tool responses, never cut), or None (default: None)
    reward(task, episode)      -> Reward(task reward, metrics, named process terms): the only place
                               that knows what success is
    demonstration(task)        scripted actions that solve the task (SFT cold start), or None
    baselines(tasks)           other environments to evaluate on the same tasks (e.g. Naive RAG)

and class attributes: `Options` (the dataclass `[env.options]` is checked against),
`required_tools` (built-in tool services it needs started), `score_metric` (the trajectory
metric reported as the held-out score), `max_score` (its value on a solved task, 1.0 unless set;
`agentrl check` holds demonstrations to it), `report_by` (metadata keys to break scores down by),
`summary_metrics` (trajectory metrics the run's JSON line also reports before training, after SFT
and at the end, as METRIC_before, METRIC_sft, METRIC_after).

The Tool / ToolEnv split (Agent-R1): a Tool says what happened (content, success, latency); the
environment decides what it means. Rules the mechanics own (all in `EnvConfig`): max turns, max
total tokens, per-turn generation budget, tool timeouts, per-turn and per-episode call limits,
observation size, and the process terms of each call (`ProcessRewardConfig`). A malformed call
(bad JSON, unknown tool, schema violation, truncated tag, unclosed answer) becomes a readable error
inside the tool message plus a process penalty; it never raises. `ToolUnavailable` (infrastructure)
fails the episode; so does any exception from a hook (episode.run_episode records its traceback).

Lifecycle of one episode (driven by `episode.run_episode`):
    state = env.reset(task)                       # ids: system + examples + first messages + "<|im_start|>assistant\n"
    while not state.done:
        gen = await generate(state.token_ids, ...)
        transition = await env.step(state, gen)   # appends action ids, then observation ids
    traj = state.to_trajectory(group_id, sample_index)

Token bookkeeping (the trajectory invariants): the action appended is a prefix of the ids the server
returned, with their log-probs and versions unchanged. Generation stops on `<|im_end|>`; if the
text goes on past the end of the action (after `</answer>`, or an imagined `<tool_response>` after
the last `</tool_call>`) the ids are cut at the first token whose text reaches the cut point, and
the turn is closed with `<|im_end|>\n` as observation (non-action) ids. Observations are tokenized
once and appended. So `decode(state.token_ids) == render(state.messages)`.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import jsonschema
import numpy as np
from pydantic import Field

from agentrl.common.config import PluginRef, config_dataclass
from agentrl.common.trajectory import Trajectory, Turn, int32_array
from agentrl.engine import rewards as R
from agentrl.engine.chat import CLOSED, IM_END, ChatFormat, list_tools
from agentrl.engine.parsers import HermesParser, ParsedAction, ToolCall, ToolCallParser, cut_action
from agentrl.engine.task import Task
from agentrl.engine.tools import Tool, ToolResult, ToolUnavailable

logger = logging.getLogger(__name__)


@config_dataclass
class EnvConfig:
    env_class: PluginRef = Field(default="multihop_qa", alias="class")
    """The environment: a built-in name (multihop_qa) or "package.module:Class" (a ToolEnv subclass)."""
    options: dict[str, Any] = field(default_factory=dict)
    """The environment's own options ([env.options]), checked against its `Options` dataclass."""
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
    plain_text_is_answer: bool = False
    """Take an action without tags that ended with <|im_end|> as the final answer (Naive RAG)."""
    finish_tool: str | None = None
    """Also end the episode when the policy calls a tool of this name; its arguments object is the
    answer (a structured answer). The environment declares its schema (`finish_parameters`)."""
    tool_list: Literal["json", "signature"] = "json"
    """How the system prompt lists the tools: "json" (whole schemas) or "signature" (one short line
    each); see chat.system_prompt."""
    worked_example: bool | Literal["auto"] = "auto"
    """Put the environment's worked example (`example_messages()`; the QA one is ~200 tokens) between
    the system message and the task. SmolLM2 needs it to call tools at all untrained; a policy
    cold-started on demonstrations does not, and every episode is then that much shorter. "auto":
    shown when the run has no SFT cold start (`sft.enabled = false`, rewards alone), not after one
    (`agentrl train` resolves it); an environment used outside a run shows it (`shows_worked_example`)."""
    rewards: R.ProcessRewardConfig = field(default_factory=R.ProcessRewardConfig)

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_action_tokens < 1 or self.max_total_tokens <= self.max_action_tokens:
            raise ValueError("EnvConfig needs max_turns >= 1, max_action_tokens >= 1 and max_total_tokens > max_action_tokens")

    @property
    def shows_worked_example(self) -> bool:
        """Whether episodes start with the worked example ("auto" unresolved by a run: yes)."""
        return self.worked_example is not False


@dataclass
class CallRecord:
    """One tool call of an episode, as the environment's `reward` sees it."""

    turn: int
    """Index of the turn that made it."""
    name: str
    arguments: dict
    success: bool
    content: Any = None
    error: str | None = None
    repeated: bool = False
    """The same tool and arguments as an earlier call of the episode (answered from its cache)."""


@dataclass
class EpisodeState:
    task: Task
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
    answer: Any = None
    """The final answer (text, or a finish tool's arguments); None when the episode ended without one."""
    task_reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    calls: list[CallRecord] = field(default_factory=list)
    """Every call that was run or answered from the cache, in order (rejected calls are not here)."""
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
            token_ids=int32_array(self.token_ids, "token_ids"), is_action=np.asarray(self.is_action, dtype=np.uint8),
            behavior_logprobs=np.asarray(self.logprobs, dtype=np.float32),
            policy_versions=int32_array(self.versions, "policy_versions"),
            prompt_len=self.prompt_len, turns=self.turns, task_reward=float(self.task_reward), status=self.status, error=self.error,
            metrics=metrics,
            timing={"generate_s": self.generate_s, "tool_s": self.tool_s, "wall_s": end - self.start_time,
                    "start_time": self.start_time, "end_time": end},
            task=self.task, messages=list(self.messages), calls=list(self.calls), answer=self.answer,
        )
        traj.validate()
        return traj


@dataclass
class Transition:
    observation_ids: list[int]
    process_rewards: dict[str, float]
    done: bool


@dataclass
class Reward:
    """What an environment's `reward` returns for a finished episode."""

    task: float
    """The task reward (e.g. exact match in {0, 1}, F1, a fraction of tests passed), before weighting."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Per-episode scalars for evaluation and plots (the `score_metric` among them)."""
    terms: dict[str, float] = field(default_factory=dict)
    """Named process terms the environment adds, recorded raw on the episode's last turn (the
    learner weights them with the other process terms)."""


@dataclass
class NoOptions:
    """An environment without options: `[env.options]` must stay empty."""


class ToolEnv:
    """The base class of every environment (module docstring): subclass it and override the hooks."""

    Options: type = NoOptions
    required_tools: tuple[str, ...] = ()
    """Built-in tool services (search, python, calculator) the environment needs started."""
    score_metric: str = "score"
    """The trajectory metric reported as the held-out score (score_before / score_after)."""
    max_score: float = 1.0
    """The `score_metric` of a solved task; `agentrl check` refuses a demonstration that scores less."""
    report_by: tuple[str, ...] = ()
    """Task metadata keys by which held-out scores are also broken down (e.g. "num_hops")."""
    summary_metrics: tuple[str, ...] = ()
    """Trajectory metrics the run's JSON line reports as METRIC_before / _sft / _after (e.g. "em")."""
    user_prefix: str = ""
    """Prepended to `task.prompt` by the default `first_messages`."""
    finish_parameters: dict | None = None
    """JSON schema of the finish tool's arguments when `EnvConfig.finish_tool` is set."""

    def __init__(self, chat: ChatFormat, config: EnvConfig | None = None, options: Any = None, *,
                 parser: ToolCallParser | None = None):
        self.chat = chat
        self.config = config or EnvConfig()
        self.options = options if options is not None else self.Options()
        self.parser = parser or HermesParser()
        self.tools: dict[str, Tool] = {}
        self._validators: dict[str, jsonschema.protocols.Validator] = {}
        # System prompt + worked examples, tokenized once per distinct example turns (see reset).
        self._prefixes: dict[tuple, tuple[list[int], list[tuple[str, str, str]]]] = {}
        if self.config.finish_tool is not None:
            from agentrl.engine.tools import FinishTool

            self.register_tool(FinishTool(self.config.finish_tool, self.finish_parameters or {"type": "object"}))

    # -- hooks ----------------------------------------------------------------------------------

    def intro(self) -> str:
        """The system prompt's instructions, before the tool list."""
        finish = (f' When you are done, call {self.config.finish_tool} with the result.' if self.config.finish_tool
                  else " When you are done, reply <answer>your answer</answer>.")
        return ('You solve tasks with tools. Call a tool with <tool_call>{"name": "<tool name>", "arguments": {...}}'
                "</tool_call>." + finish)

    def example_messages(self) -> tuple[tuple[str, str], ...]:
        """Chat turns between the system message and the task (a worked example); () for none."""
        return ()

    def example_messages_for(self, task: Task) -> tuple[tuple[str, str], ...]:
        """The worked-example turns `task` sees: `example_messages()` unless the environment varies
        them per task. Return the same few tuples for many tasks: each distinct one is tokenized once."""
        return self.example_messages()

    def first_messages(self, task: Task) -> list[tuple[str, str]]:
        """The opening (role, content) turns for `task`, after the system prompt and examples."""
        if task.messages is not None:
            return [(m["role"], m["content"]) for m in task.messages]
        return [("user", f"{self.user_prefix}{task.prompt}")]

    def final_answer(self, parsed: ParsedAction, text: str, stopped: bool) -> Any:
        """The answer this action ends the episode with, or None to go on."""
        if parsed.answer is not None:
            return parsed.answer
        if self.config.plain_text_is_answer and stopped and not parsed.calls and not parsed.errors:
            return text.strip()
        finish = self.config.finish_tool
        if finish is not None:
            for call in parsed.calls:
                if call.name == finish and next(iter(self._validators[finish].iter_errors(call.arguments)), None) is None:
                    return call.arguments
        return None

    def refuse(self, state: EpisodeState, parsed: ParsedAction) -> str | None:
        """Why this parsed action is not carried out (the error text the policy sees), or None to carry
        it out. `state` holds the episode so far, this action's message included."""
        return None

    def observation_note(self, state: EpisodeState) -> str | None:
        """Text the environment adds after this turn's tool responses (the end of the observation the
        policy reads next; never cut by `max_observation_tokens`), or None. `state` holds the episode
        so far, this turn's calls included."""
        return None

    def reward(self, task: Task, episode: EpisodeState) -> Reward:
        """Score a finished episode (`episode.answer` is None when it ended without one)."""
        raise NotImplementedError(f"{type(self).__name__} must implement reward(task, episode)")

    def demonstration(self, task: Task) -> list[str] | None:
        """Action texts that solve `task` (run through the real tools for the SFT cold start), or None."""
        return None

    async def baselines(self, tasks: list[Task]) -> dict[str, ToolEnv]:
        """Other environments to evaluate on the same held-out tasks once, before training."""
        return {}

    # -- mechanics ------------------------------------------------------------------------------

    def register_tool(self, tool: Tool) -> None:
        if tool.name in self.tools:
            raise ValueError(f"a tool named {tool.name!r} is already registered")
        validator_cls = jsonschema.validators.validator_for(tool.parameters)
        validator_cls.check_schema(tool.parameters)
        self.tools[tool.name] = tool
        self._validators[tool.name] = validator_cls(tool.parameters)
        self._prefixes = {}

    def with_tools_disabled(self) -> ToolEnv:
        """This environment with every tool but the finish tool replaced by a `DisabledTool`: same
        prompt, same reward, each call fails (the tool-disabled evaluation)."""
        from agentrl.engine.tools import DisabledTool

        env = copy.copy(self)
        env.tools = {name: tool if name == self.config.finish_tool else DisabledTool(tool) for name, tool in self.tools.items()}
        return env

    async def call_tool(self, name: str, arguments: dict) -> ToolResult:
        """Run one registered tool as an episode would, for a caller outside the episode loop (an
        agent program's call through the gateway): an unknown tool or arguments that fail its schema
        are a failed result saying why; the call gets `tool_timeout_s`. `ToolUnavailable` propagates
        (infrastructure, not the agent's doing)."""
        problem = self.call_problem(name, arguments)
        if problem is not None:
            return ToolResult(None, False, 0.0, problem)
        return await self._execute(self.tools[name], arguments)

    def call_problem(self, name: str, arguments: Any) -> str | None:
        """Why a call cannot run (an unknown tool, arguments that fail its schema: the error the
        policy reads), or None."""
        if name not in self.tools:
            return f"unknown tool {name!r}; available: {', '.join(sorted(self.tools))}"
        schema_error = next(iter(self._validators[name].iter_errors(arguments)), None)
        if schema_error is not None:
            where = "/".join(map(str, schema_error.absolute_path)) or "arguments"
            return f"invalid arguments at {where}: {schema_error.message}"
        return None

    @property
    def system_prompt(self) -> str:
        return f"{self.intro()}\n<tools>\n{list_tools([t.schema() for t in self.tools.values()], self.config.tool_list)}\n</tools>"

    def reset(self, task: Task) -> EpisodeState:
        examples = self.example_messages_for(task) if self.config.shows_worked_example else ()
        cached = self._prefixes.get(examples)
        if cached is None:
            # The same for every episode with these examples, so built and tokenized once (and
            # prefix-cached by vLLM). Rebuilding the system prompt per episode (it serialises every
            # tool schema) cost ~270 us of orchestrator CPU per episode in the capacity benchmark.
            prefix = [("system", self.system_prompt), *examples]
            cached = ([i for role, content in prefix for i in self.chat.message(role, content)],
                      [(role, content, CLOSED) for role, content in prefix])
            self._prefixes[examples] = cached
        prefix_ids, prefix_messages = cached
        opening = self.first_messages(task)
        ids = [*prefix_ids, *(i for role, content in opening for i in self.chat.message(role, content)),
               *self.chat.assistant_head_ids]
        messages = [*prefix_messages, *((role, content, CLOSED) for role, content in opening), ("assistant", "", "")]
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
        keep = cut_action(self.parser, ids[:-1] if stopped else ids, text, self.chat.decode)
        if keep is not None:
            ids, logprobs, versions, stopped = ids[:keep], logprobs[:keep], versions[:keep], False
            text = self.chat.decode(ids)
        action_start = len(state.token_ids)
        state.append(ids, logprobs=logprobs, versions=versions)
        state.messages[-1] = ("assistant", text, IM_END if stopped else "")
        turn = Turn(action_start=action_start, action_end=len(state.token_ids), obs_end=len(state.token_ids))
        state.turns.append(turn)

        terms: dict[str, float] = {}
        parsed = self.parser.parse(text)
        refusal = self.refuse(state, parsed)
        if refusal is not None:  # nothing of it is carried out: no calls counted, no answer taken
            self._add(terms, R.NO_ACTION)
            return self._close(state, turn, terms, [self._error_response(None, refusal)], stopped)
        turn.num_tool_calls = len(parsed.calls) + len(parsed.errors)
        answer = self.final_answer(parsed, text, stopped)
        if answer is not None:
            state.answer, state.done = answer, True
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

    def _add(self, terms: dict[str, float], term: str, count: int = 1) -> None:
        terms[term] = terms.get(term, 0.0) + count * self.config.rewards.value(term)

    async def _run_calls(self, state: EpisodeState, calls: list[ToolCall], terms: dict[str, float]) -> list[str]:
        cfg = self.config
        turn = len(state.turns) - 1
        responses: list[str | None] = [None] * len(calls)
        to_run: list[tuple[int, ToolCall, str]] = []
        for i, call in enumerate(calls):
            if i >= cfg.max_calls_per_turn or state.num_calls >= cfg.max_calls_per_episode:
                self._add(terms, R.OVER_LIMIT)
                limit = f"{cfg.max_calls_per_turn} per turn" if i >= cfg.max_calls_per_turn else f"{cfg.max_calls_per_episode} per episode"
                responses[i] = self._error_response(call.name, f"call limit reached ({limit}); the call was not run")
                continue
            state.num_calls += 1
            problem = self.call_problem(call.name, call.arguments)
            if problem is not None:
                self._add(terms, R.MALFORMED_CALL)
                responses[i] = self._error_response(call.name, problem)
                continue
            self._add(terms, R.VALID_CALL)
            key = call.name + "\x00" + json.dumps(call.arguments, sort_keys=True)
            if key in state.call_cache:
                self._add(terms, R.DUPLICATE_CALL)
                cached = state.call_cache[key]
                state.calls.append(CallRecord(turn, call.name, call.arguments, cached.success, cached.content, cached.error,
                                              repeated=True))
                responses[i] = self._format_result(call.name, cached)
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
                state.calls.append(CallRecord(turn, call.name, call.arguments, result.success, result.content, result.error))
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
        except ToolUnavailable:
            raise  # no replica answered: the episode fails (the call was never answered, not wrong)
        except Exception as err:  # noqa: BLE001 - a tool that raises (or arguments its client cannot send) is a failed call the model sees
            logger.warning("tool %r raised on a call; answered as a tool error", tool.name, exc_info=True)
            return ToolResult(None, False, time.perf_counter() - start, f"the tool raised {type(err).__name__}: {err}")

    @staticmethod
    def _error_response(name: str | None, message: str) -> str:
        body = {"name": name, "error": message} if name else {"error": message}
        return f"<tool_response>\n{json.dumps(body)}\n</tool_response>"

    def _format_result(self, name: str, result: ToolResult) -> str:
        if not result.success:
            return self._error_response(name, result.error or "the tool failed")
        return f"<tool_response>\n{format_content(result.content)}\n</tool_response>"

    def _score(self, state: EpisodeState, terms: dict[str, float]) -> None:
        """Ask the environment's `reward` about the finished episode (exceptions propagate: the
        episode runner fails the episode with the traceback)."""
        reward = self.reward(state.task, state)
        state.task_reward = float(reward.task)
        state.metrics.update(reward.metrics)
        for term, value in reward.terms.items():
            terms[term] = terms.get(term, 0.0) + float(value)

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
            note = self.observation_note(state)
            note_ids = [*(self.chat.newline_ids if responses else []), *self.chat.encode_cached(note)] if note else []
            budget = max(cfg.max_observation_tokens - len(note_ids), 0)
            if len(content_ids) > budget:
                content_ids = content_ids[:budget]
                content = self.chat.decode(content_ids)
            if note:
                content_ids += note_ids
                content = f"{content}\n{note}" if responses else note
            obs = [*(self.chat.newline_ids if stopped else self.chat.turn_end_ids), *self.chat.role_head("tool"),
                   *content_ids, *self.chat.turn_end_ids, *self.chat.assistant_head_ids]
            if len(state.token_ids) + len(obs) + cfg.min_action_tokens > cfg.max_total_tokens:
                state.done, state.status, obs = True, "truncated", []
        if state.done:
            if state.answer is None and state.status == "truncated" and cfg.rewards.no_answer:
                terms[R.NO_ANSWER] = terms.get(R.NO_ANSWER, 0.0) + cfg.rewards.no_answer
            self._score(state, terms)
            return Transition([], terms, True)
        state.messages[-1] = ("assistant", state.messages[-1][1], CLOSED)
        state.messages += [("tool", content, CLOSED), ("assistant", "", "")]
        state.append(obs)
        turn.obs_end = len(state.token_ids)
        return Transition(obs, terms, False)


def format_content(content) -> str:
    """Tool content as the model reads it: passages as numbered "title: text" lines, other
    structures as one line of JSON with `json.dumps`' spacing (`{"a": 1, "b": [2, 3]}`), non-ASCII
    kept, strings as they are."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(c, dict) and "text" in c for c in content):
        if not content:
            return "no results"
        return "\n".join(f"[{i}] {c.get('title', '')}: {c['text']}" for i, c in enumerate(content, 1))
    return json.dumps(content, ensure_ascii=False)
