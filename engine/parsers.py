"""Tool-call parsers: turn one action's text into tool calls, parse errors and a final answer.

A parser is pluggable (`ToolEnv(parser=...)`); it knows only the text format, not the tools, so
"unknown tool" and "schema violation" are decided by the `ToolEnv`. A parser never raises on model
output: anything it cannot read becomes a `ParseError` the model is shown.

`HermesParser`: calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the format of
Hermes / Qwen chat templates and of agentrl's SmolLM2 tool template), final answers as
`<answer>...</answer>`. Several calls in one action are allowed (the env runs them concurrently).

`cut_point(text)` says where the action ends, in characters: right after the first `</answer>`,
else right after the last `</tool_call>` that precedes any imagined tool response, else the end.
The tags are several tokens each for SmolLM2 (`</tool_call>` is 5 ids), so generation cannot stop
on them with stop token ids; the engine stops on `<|im_end|>` and applies the cut afterwards to the
exact ids the server returned (see `episode`).
"""

from __future__ import annotations

import json
import re
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
    """"bad_json" | "truncated" | "bad_call" (JSON that is not {"name": str, "arguments": object})."""
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


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedAction: ...

    def cut_point(self, text: str) -> int: ...

    def format_call(self, name: str, arguments: dict) -> str: ...

    def format_answer(self, answer: str) -> str: ...


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
                obj = json.loads(body)
            except json.JSONDecodeError as err:
                out.errors.append(ParseError("bad_json", f"the tool call is not valid JSON ({err.msg} at char {err.pos})", raw))
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                out.errors.append(ParseError("bad_call", 'a tool call must be {"name": "<tool>", "arguments": {...}}', raw))
                continue
            arguments = obj.get("arguments", {})
            if isinstance(arguments, str):  # some models double-encode the arguments object
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    arguments = None
            if not isinstance(arguments, dict):
                out.errors.append(ParseError("bad_call", '"arguments" must be a JSON object', raw))
                continue
            out.calls.append(ToolCall(obj["name"], arguments, raw))
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
