"""One generated chat turn, cut and parsed: what the gateway answers and records.

Generation stops on the renderer's end-of-turn ids. When calls are parsed, the action is cut where
the family's parser says it ends (after the last call, before an imagined tool response), as the
native environment cuts: the kept ids are an exact prefix of what was sampled, and they are what
`usage.completion_tokens` counts and the session records.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from dataclasses import dataclass

import msgspec

from agentrl.engine.parsers import cut_action
from agentrl.gateway import protocol as P
from agentrl.gateway.render import Rendered

_ENCODER = msgspec.json.Encoder()


@dataclass
class Turn:
    """One generated turn, after the stop / cut rules: what is answered and recorded."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str
    """The assistant message's whole text: forced-call prefill + decoded kept ids (stop id not shown)."""
    content: str | None
    tool_calls: list[dict]
    finish_reason: str


def chat_turn(generation, rendered: Rendered, choice: P.ToolChoice, *, parallel: bool, parser,
              stop_ids: Collection[int], decode: Callable[[list[int]], str]) -> Turn:
    """The turn of `generation` (ids, logprobs, versions, finish_reason) for a prompt `rendered`:
    the stop id dropped from the text, the action cut after its last call when calls are parsed,
    OpenAI `tool_calls` (only the first unless `parallel`)."""
    ids, logprobs, versions = generation.token_ids, generation.logprobs, generation.versions
    stopped = bool(ids) and ids[-1] in stop_ids
    prefill = decode(rendered.prefill_ids) if rendered.prefill_ids else ""
    sampled_text = decode(ids[:-1] if stopped else ids)
    text = prefill + sampled_text
    finish = "length" if generation.finish_reason == "length" else "stop"
    if not choice.parse_calls:
        return Turn(ids, logprobs, versions, text, text, [], finish)
    keep = cut_action(parser, ids[:-1] if stopped else ids, sampled_text, decode, prefill)
    if keep is not None:
        ids, logprobs, versions = ids[:keep], logprobs[:keep], versions[:keep]
        text = prefill + decode(ids)
        finish = "stop"  # the action ended where the parser says; what followed it is dropped
    parsed = parser.parse(text)
    calls = parsed.calls if parallel else parsed.calls[:1]
    if not calls:
        return Turn(ids, logprobs, versions, text, text, [], finish)
    content = text
    for call in parsed.calls:
        content = content.replace(call.raw, "", 1)
    tool_calls = [{"id": "call_" + os.urandom(12).hex(), "type": "function",
                   "function": {"name": call.name, "arguments": _ENCODER.encode(call.arguments).decode()}} for call in calls]
    return Turn(ids, logprobs, versions, text, content.strip() or None, tool_calls, "tool_calls")
