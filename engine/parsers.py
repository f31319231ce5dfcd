"""Tool-call parsers: turn one action's text into tool calls, parse errors and a final answer.

A parser is pluggable (`ToolEnv(parser=...)`); it knows only the text format, not the tools, so
"unknown tool" and "schema violation" are decided by the `ToolEnv`. A parser never raises on model
output: anything it cannot read becomes a `ParseError` the model is shown.

`HermesParser`: calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the format of
Hermes / Qwen chat templates and of agentrl's SmolLM2 tool template), final answers as
`<answer>...</answer>`. Several calls in one action are allowed (the env runs them concurrently).

`Llama3JsonParser`: Llama 3.1 / 3.2 JSON calls, the whole action being
`{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`, several separated by `;`).
`MistralParser`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (and the later
`[TOOL_CALLS]name[ARGS]{...}` form). All three read `<answer>...</answer>` the same way, so a
`ToolEnv` can run any of them. `TOOL_CALL_PARSERS` names them; `detect_tool_call_format` picks one
from a tokenizer's vocabulary (the control tokens each family's models are trained with).

`cut_point(text)` says where the action ends, in characters: right after the first `</answer>`,
else right after the last `</tool_call>` that precedes any imagined tool response, else the end.
The tags are several tokens each for SmolLM2 (`</tool_call>` is 5 ids), so generation cannot stop
on them with stop token ids; the engine stops on `<|im_end|>` and applies the cut afterwards to the
exact ids the server returned (see `episode`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class ToolCall:
    name: str
    arguments: dict
    raw: str


@dataclass
class ParseError:
    kind: str
    """"bad_json" | "truncated" | "bad_call" (JSON that is not {"name": str, "arguments": object}) |
    "bad_arguments" (JSON no tool could be sent: see `wire_problem`)."""
    message: str
    raw: str


@dataclass
class ParsedAction:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ParseError] = field(default_factory=list)
    answer: str | None = None
    """Text inside <answer>...</answer>, stripped; None when there is no closed answer tag."""
    answer_truncated: bool = False
    """An <answer> tag was opened and never closed."""


MAX_ARGUMENT_DEPTH = 32
"""Deepest nesting of a call's arguments (objects and arrays); no tool schema needs more."""


class _NotJSON(ValueError):
    pass


class CallDecoder(json.JSONDecoder):
    """The JSON decoder for model-written calls. Two differences from `json`'s: NaN and Infinity are
    refused (they are not JSON, RFC 8259, and no tool service could be sent them), and nesting deeper
    than Python's recursion limit (a 1,000-deep array) is a decode error rather than a RecursionError."""

    def __init__(self):
        super().__init__(parse_constant=self._refuse_constant)

    @staticmethod
    def _refuse_constant(name: str):
        raise _NotJSON(name)

    def raw_decode(self, s: str, idx: int = 0):
        try:
            return super().raw_decode(s, idx)
        except RecursionError:
            raise json.JSONDecodeError("nested too deeply", s, idx) from None
        except _NotJSON as constant:
            raise json.JSONDecodeError(f"{constant} is not JSON", s, idx) from None


_JSON = CallDecoder()


def wire_problem(value, depth: int = 0) -> str | None:
    """Why `value` (decoded arguments) cannot be sent to a tool, or None. Decoded JSON can still hold
    what the wire format (msgpack) or a tool cannot take: a lone surrogate from a `\\ud800` escape,
    an integer past 64 bits, a float that overflowed to infinity (`1e999`), or nesting past
    MAX_ARGUMENT_DEPTH."""
    if depth > MAX_ARGUMENT_DEPTH:
        return f"the arguments are nested deeper than {MAX_ARGUMENT_DEPTH} levels"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            return f"a string holds a lone surrogate ({err.object[err.start]!r} at {err.start})"
        return None
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return None if -(2**63) <= value < 2**64 else "an integer is out of the 64-bit range"
    if isinstance(value, float):
        return None if math.isfinite(value) else "a number is out of the float range"
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        problem = wire_problem(key, depth + 1) if isinstance(key, str) else None
        if problem is None:
            problem = wire_problem(item, depth + 1)
        if problem is not None:
            return problem
    return None


def _checked_call(name: str, arguments: dict, raw: str) -> ToolCall | ParseError:
    problem = wire_problem(name) or wire_problem(arguments)
    if problem is not None:
        return ParseError("bad_arguments", problem, raw)
    return ToolCall(name, arguments, raw)


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedAction: ...

    def cut_point(self, text: str) -> int: ...

    def format_call(self, name: str, arguments: dict) -> str: ...

    def format_answer(self, answer: str) -> str: ...


def cut_action(parser: ToolCallParser, ids: list[int], text: str, decode: Callable[[list[int]], str],
               prefix: str = "") -> int | None:
    """How many of the sampled `ids` (no stop token; `text` = decode(ids)) an action keeps when the
    parser says it ends early (after a closed answer or the last closed call: `cut_point`), or None
    when the action is whole. `prefix` is text the action starts with that was not sampled (a forced
    prefill). Everything after the cut is dropped: the engine's episodes and the gateway's turns keep
    exactly the tokens that make up the action."""
    cut = parser.cut_point(prefix + text) - len(prefix)
    if cut >= len(text):
        return None
    lo, hi = 1, len(ids)  # the fewest tokens whose text reaches the cut (decoded length grows with k)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(ids[:mid])) >= max(cut, 0):
            hi = mid
        else:
            lo = mid + 1
    return lo


class HermesParser:
    CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
    ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
    RESPONSE_OPEN = "<tool_response>"
    _CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
    _ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

    def parse(self, text: str) -> ParsedAction:
        out = ParsedAction()
        answer = self._ANSWER.search(text)
        if answer is not None:
            out.answer = answer.group(1).strip()
            return out
        if self.ANSWER_OPEN in text:
            out.answer_truncated = True
        for match in self._CALL.finditer(text):
            body, closed = match.group(1).strip(), bool(match.group(2))
            raw = match.group(0)
            if not closed:
                out.errors.append(ParseError("truncated", "the <tool_call> tag was not closed with </tool_call>", raw))
                continue
            try:
                obj = _JSON.decode(body)
            except json.JSONDecodeError as err:
                out.errors.append(ParseError("bad_json", f"the tool call is not valid JSON ({err.msg} at char {err.pos})", raw))
                continue
            call = _call_from_object(obj, raw, ("arguments",), '{"name": "<tool>", "arguments": {...}}')
            (out.calls if isinstance(call, ToolCall) else out.errors).append(call)
        return out

    def cut_point(self, text: str) -> int:
        answer_end = text.find(self.ANSWER_CLOSE)
        if answer_end >= 0:
            return answer_end + len(self.ANSWER_CLOSE)
        response = text.find(self.RESPONSE_OPEN)
        head = text if response < 0 else text[:response]
        last_close = head.rfind(self.CALL_CLOSE)
        if last_close >= 0:
            return last_close + len(self.CALL_CLOSE)
        return len(text)

    def format_call(self, name: str, arguments: dict) -> str:
        return f"{self.CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments})}{self.CALL_CLOSE}"

    def format_answer(self, answer: str) -> str:
        return f"{self.ANSWER_OPEN}{answer}{self.ANSWER_CLOSE}"


def _read_answer(text: str, out: ParsedAction) -> bool:
    """Fill `out.answer` / `out.answer_truncated` from `<answer>` tags; True when the action is an answer."""
    close = text.find(HermesParser.ANSWER_CLOSE)
    open_ = text.find(HermesParser.ANSWER_OPEN)
    if open_ >= 0 and close > open_:
        out.answer = text[open_ + len(HermesParser.ANSWER_OPEN):close].strip()
        return True
    out.answer_truncated = open_ >= 0
    return False


def _answer_end(text: str) -> int:
    close = text.find(HermesParser.ANSWER_CLOSE)
    return close + len(HermesParser.ANSWER_CLOSE) if close >= 0 else -1


def _call_from_object(obj, raw: str, arguments_keys: tuple[str, ...], shape: str) -> ToolCall | ParseError:
    """A decoded JSON value as a call: {"name": str, <one of arguments_keys>: object}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ParseError("bad_call", f"a tool call must be {shape}", raw)
    key = next((k for k in arguments_keys if k in obj), None)
    arguments = obj.get(key, {}) if key else {}
    if isinstance(arguments, str):  # some models double-encode the arguments object
        try:
            arguments = _JSON.decode(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(arguments, dict):
        return ParseError("bad_call", f'"{key}" must be a JSON object', raw)
    return _checked_call(obj["name"], arguments, raw)


def _json_error(err: json.JSONDecodeError, text: str, raw: str) -> ParseError:
    # A decode error at the end of the text (or a string still open there) is a call the generation
    # budget cut off.
    if err.pos >= len(text.rstrip()) or err.msg.startswith("Unterminated string"):
        return ParseError("truncated", f"the tool call JSON ends before it is complete ({err.msg})", raw)
    return ParseError("bad_json", f"the tool call is not valid JSON ({err.msg} at char {err.pos})", raw)


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos




class _CallListParser:
    """What the JSON-call parsers share: `_calls(text)` returns (calls and errors, end of the last
    one in chars); answers are read as `<answer>...</answer>`, as HermesParser does."""

    def _calls(self, text: str) -> tuple[list[ToolCall | ParseError], int]:
        raise NotImplementedError

    def parse(self, text: str) -> ParsedAction:
        out = ParsedAction()
        if _read_answer(text, out):
            return out
        for item in self._calls(text)[0]:
            (out.calls if isinstance(item, ToolCall) else out.errors).append(item)
        return out

    def cut_point(self, text: str) -> int:
        answer_end = _answer_end(text)
        if answer_end >= 0:
            return answer_end
        found, end = self._calls(text)
        return end if found else len(text)

    def format_answer(self, answer: str) -> str:
        return f"{HermesParser.ANSWER_OPEN}{answer}{HermesParser.ANSWER_CLOSE}"


class Llama3JsonParser(_CallListParser):
    """Llama 3.1 / 3.2 JSON tool calls: an action that starts with `{` (after optional whitespace and
    `<|python_tag|>`) is a list of `{"name": ..., "parameters": {...}}` objects separated by `;`
    ("arguments" is read too); text after the last object is left alone (not a call). An action that
    starts with anything else is plain text. Llama 3.1's built-in tools (`<|python_tag|>` followed by
    Python code) are not JSON and come back as a `bad_json` error."""

    PYTHON_TAG = "<|python_tag|>"
    SHAPE = '{"name": "<tool>", "parameters": {...}}'

    def _calls(self, text: str) -> tuple[list[ToolCall | ParseError], int]:
        """Parsed calls and errors, and the end (chars) of the last one; ([], 0) for plain text."""
        pos = _skip_space(text, 0)
        if text.startswith(self.PYTHON_TAG, pos):
            pos = _skip_space(text, pos + len(self.PYTHON_TAG))
        if not text.startswith("{", pos):
            return [], 0
        found: list[ToolCall | ParseError] = []
        raw_start = 0
        while True:
            try:
                obj, end = _JSON.raw_decode(text, pos)
            except json.JSONDecodeError as err:
                found.append(_json_error(err, text, text[raw_start:]))
                return found, len(text)
            found.append(_call_from_object(obj, text[raw_start:end], ("parameters", "arguments"), self.SHAPE))
            raw_start = end
            pos = _skip_space(text, end)
            if text.startswith(";", pos):
                pos = _skip_space(text, pos + 1)
            if not text.startswith("{", pos):
                return found, end


    def format_call(self, name: str, arguments: dict) -> str:
        return json.dumps({"name": name, "parameters": arguments})



class MistralParser(_CallListParser):
    """Mistral tool calls after the `[TOOL_CALLS]` control token: a JSON array of
    `{"name": ..., "arguments": {...}}` objects (tokenizer v3), or `name[ARGS]{...}` (v11), one block
    per `[TOOL_CALLS]`. Text before the first `[TOOL_CALLS]` is content. Every call of one JSON
    array shares that array's text as `raw`."""

    TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
    SHAPE = '[TOOL_CALLS][{"name": "<tool>", "arguments": {...}}]'
    _NAME = re.compile(r"[A-Za-z0-9_.\-]+")

    def _calls(self, text: str) -> tuple[list[ToolCall | ParseError], int]:
        found: list[ToolCall | ParseError] = []
        start = text.find(self.TOOL_CALLS)
        end = 0
        while start >= 0:
            pos = _skip_space(text, start + len(self.TOOL_CALLS))
            block, end = self._block(text, start, pos)
            found += block
            start = text.find(self.TOOL_CALLS, end)
        return found, end

    def _block(self, text: str, start: int, pos: int) -> tuple[list[ToolCall | ParseError], int]:
        if text.startswith("[", pos):  # v3: a JSON array of calls
            try:
                items, end = _JSON.raw_decode(text, pos)
            except json.JSONDecodeError as err:
                return [_json_error(err, text, text[start:])], len(text)
            raw = text[start:end]
            if not isinstance(items, list):
                return [ParseError("bad_call", f"tool calls must be {self.SHAPE}", raw)], end
            return [_call_from_object(item, raw, ("arguments",), self.SHAPE) for item in items], end
        args_at = text.find(self.ARGS, pos)
        name = text[pos:args_at] if args_at >= 0 else ""
        if not self._NAME.fullmatch(name):
            next_block = text.find(self.TOOL_CALLS, pos)
            end = len(text) if next_block < 0 else next_block
            return [ParseError("bad_call", f"tool calls must be {self.SHAPE} or [TOOL_CALLS]name[ARGS]{{...}}", text[start:end])], end
        args_pos = args_at + len(self.ARGS)
        try:
            arguments, end = _JSON.raw_decode(text, _skip_space(text, args_pos))
        except json.JSONDecodeError as err:
            return [_json_error(err, text, text[start:])], len(text)
        return [_call_from_object({"name": name, "arguments": arguments}, text[start:end], ("arguments",), self.SHAPE)], end


    def format_call(self, name: str, arguments: dict) -> str:
        return f"{self.TOOL_CALLS}[{json.dumps({'name': name, 'arguments': arguments})}]"



TOOL_CALL_PARSERS: dict[str, type] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}
"""Tool-call formats by name (the `tool_parser` setting of the gateway and of configs)."""


def detect_tool_call_format(tokenizer) -> str:
    """The tool-call format a tokenizer's model family was trained with, from its vocabulary:
    `[TOOL_CALLS]` -> "mistral", `<|python_tag|>` -> "llama3_json", else "hermes" (Hermes / Qwen
    models have `<tool_call>`; ChatML models without a tool format, such as SmolLM2, use agentrl's
    Hermes-style tool template)."""
    vocab = tokenizer.get_vocab()
    if MistralParser.TOOL_CALLS in vocab:
        return "mistral"
    if Llama3JsonParser.PYTHON_TAG in vocab:
        return "llama3_json"
    return "hermes"
