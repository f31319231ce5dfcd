"""The agentrl task rules at the text level, for the TRL side of `benchmarks/vs_trl.py`.

This file runs inside the TRL venv (`.venv-trl`), which does not have agentrl installed. It loads
agentrl's own answer parser (`engine/parsers.py`) and metrics (`agentrl/envs/multihop_qa/metrics.py`) from the
repository by file path (both import only the standard library), so the two sides extract answers
and score exact match with the same code. What agentrl's `ToolEnv` decides from token ids and live
tool results is restated here from text, because TRL hands reward functions text:

- `score_turns`: the process reward terms and the task EM of one episode, given its assistant turns'
  texts. Same rules and values as `ToolEnv.step` (tests/test_vs_trl.py checks parity on fixed
  episodes): the action is cut at the parser's cut point; an answer ends the episode; each
  malformed call, unclosed answer, unknown tool or schema violation costs `malformed_call`; a turn
  with neither a call nor an answer costs `no_action`; an episode that ends without an answer costs `no_answer` once; each call past the per-turn / per-episode
  limit costs `over_limit`; each valid call earns `valid_call`, plus `tool_success` the first time
  its (tool, arguments) occurs and `duplicate_call` after that (the search tool never fails).
- `format_passages`: the tool message content agentrl shows for a list of passages
  (`engine.env.format_content`).
- `observation_text`: the tool message content of one turn, including agentrl's error messages,
  for the greedy evaluation loop.

Only the search tool exists on both sides of the comparison (vs_trl.py runs agentrl with
`tools = ["search"]`), so the schema check below is the search service's schema.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}: is this the agentrl repository?")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


parsers = _load("agentrl_text_parsers", REPO_ROOT / "engine" / "parsers.py")
metrics = _load("agentrl_text_metrics", REPO_ROOT / "agentrl" / "envs" / "multihop_qa" / "metrics.py")
PARSER = parsers.HermesParser()


@dataclass
class ProcessValues:
    """Raw value per occurrence of each process term; the defaults of agentrl's ProcessRewardConfig."""

    valid_call: float = 0.1
    tool_success: float = 0.1
    duplicate_call: float = -0.05
    malformed_call: float = -0.2
    over_limit: float = -0.1
    no_action: float = -0.1
    no_answer: float = 0.0


@dataclass
class EpisodeScore:
    process_terms: dict[str, float] = field(default_factory=dict)
    """Term -> summed value over the episode (only terms that occurred)."""
    answer: str | None = None
    em: float = 0.0
    f1: float = 0.0
    num_valid_calls: int = 0

    @property
    def process_total(self) -> float:
        return sum(self.process_terms.values())


def search_arguments_error(arguments: dict) -> str | None:
    """The search service's JSON schema (toolservers.search.SearchTool.spec: query a string of 1 to
    2000 characters, top_k an integer in [1, 50], nothing else) as a check; None when valid."""
    extra = sorted(set(arguments) - {"query", "top_k"})
    if extra:
        return f"additional properties are not allowed ({', '.join(map(repr, extra))})"
    if "query" not in arguments:
        return "'query' is a required property"
    query = arguments["query"]
    if not isinstance(query, str) or not 1 <= len(query) <= 2000:
        return "query must be a string of 1 to 2000 characters"
    top_k = arguments.get("top_k", 3)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= 50:
        return "top_k must be an integer in [1, 50]"
    return None


def score_turns(turn_texts: list[str], answers: list[str], values: ProcessValues | None = None, *,
                max_calls_per_turn: int = 3, max_calls_per_episode: int = 8, tool_names: tuple[str, ...] = ("search",)) -> EpisodeScore:
    """Process terms and task EM of an episode whose assistant turns produced `turn_texts` (each
    without its closing `<|im_end|>`)."""
    values = values or ProcessValues()
    out = EpisodeScore()
    seen: set[str] = set()
    num_calls = 0

    def add(term: str) -> None:
        out.process_terms[term] = out.process_terms.get(term, 0.0) + getattr(values, term)

    for text in turn_texts:
        text = text[: PARSER.cut_point(text)]
        parsed = PARSER.parse(text)
        if parsed.answer is not None:
            out.answer = parsed.answer
            break
        for _ in parsed.errors:
            add("malformed_call")
        if parsed.answer_truncated:
            add("malformed_call")
        if not parsed.calls and not parsed.errors and not parsed.answer_truncated:
            add("no_action")
        for i, call in enumerate(parsed.calls):
            if i >= max_calls_per_turn or num_calls >= max_calls_per_episode:
                add("over_limit")
                continue
            num_calls += 1
            if call.name not in tool_names or search_arguments_error(call.arguments) is not None:
                add("malformed_call")
                continue
            add("valid_call")
            out.num_valid_calls += 1
            key = call.name + "\x00" + json.dumps(call.arguments, sort_keys=True)
            if key in seen:
                add("duplicate_call")
            else:
                seen.add(key)
                add("tool_success")
    if out.answer is not None:
        out.em = metrics.exact_match(out.answer, answers)
        out.f1 = metrics.f1_score(out.answer, answers)
    elif turn_texts and values.no_answer:
        add("no_answer")
    return out


def format_passages(passages: list[dict]) -> str:
    """agentrl's `format_content` for a list of passages."""
    if not passages:
        return "no results"
    return "\n".join(f"[{i}] {p.get('title', '')}: {p['text']}" for i, p in enumerate(passages, 1))


def _error(name: str | None, message: str) -> str:
    body = {"name": name, "error": message} if name else {"error": message}
    return f"<tool_response>\n{json.dumps(body)}\n</tool_response>"


def observation_text(parsed, search, state: dict, *, max_calls_per_turn: int = 3, max_calls_per_episode: int = 8) -> str:
    """The tool message content agentrl's ToolEnv returns for a turn without an answer (errors in
    the same words, results as `<tool_response>` blocks joined by newlines). `search(query, top_k)`
    returns passages; `state` carries the episode's call count and results cache between turns."""
    responses = [_error(None, f"malformed tool call ({e.kind}): {e.message}") for e in parsed.errors]
    if parsed.answer_truncated:
        responses.append(_error(None, "the <answer> tag was not closed with </answer>"))
    if not parsed.calls and not responses:
        responses.append(_error(None, "no tool call and no answer: call a tool with <tool_call>{...}</tool_call> or answer with <answer>...</answer>"))
    cache = state.setdefault("cache", {})
    for i, call in enumerate(parsed.calls):
        num_calls = state.get("num_calls", 0)
        if i >= max_calls_per_turn or num_calls >= max_calls_per_episode:
            limit = f"{max_calls_per_turn} per turn" if i >= max_calls_per_turn else f"{max_calls_per_episode} per episode"
            responses.append(_error(call.name, f"call limit reached ({limit}); the call was not run"))
            continue
        state["num_calls"] = num_calls + 1
        if call.name != "search":
            responses.append(_error(call.name, f"unknown tool {call.name!r}; available: search"))
            continue
        problem = search_arguments_error(call.arguments)
        if problem is not None:
            responses.append(_error(call.name, f"invalid arguments: {problem}"))
            continue
        key = json.dumps(call.arguments, sort_keys=True)
        if key not in cache:
            cache[key] = format_passages(search(call.arguments["query"], call.arguments.get("top_k", 3)))
        responses.append(f"<tool_response>\n{cache[key]}\n</tool_response>")
    return "\n".join(responses)
