"""OpenAI answer bodies from finished turns: chat and text completions, their log-probs, and their
server-sent-event streams.

Streaming: the turn is generated whole (a failed server's turn is regenerated whole by the pool, so
nothing is streamed that a failover would take back), then sent as SSE chunks: the role, the content
in pieces, each tool call (id and name, then its arguments in pieces), the finish reason, the usage
chunk when `stream_options.include_usage`, and `[DONE]`. Time to first chunk is the turn's latency.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import msgspec

from agentrl.gateway.http import Response
from agentrl.gateway.turns import Turn

_ENCODER = msgspec.json.Encoder()
_PIECE = re.compile(r"\s*\S+\s*|\s+")


def json_response(body: dict, status: int = 200) -> Response:
    return Response(_ENCODER.encode(body), status)


def chat_completion(completion_id: str, model: str, turn: Turn, usage: dict, logprobs: dict | None) -> Response:
    message: dict = {"role": "assistant", "content": turn.content}
    if turn.tool_calls:
        message["tool_calls"] = turn.tool_calls
    return json_response({"id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": model,
                          "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                                       "finish_reason": turn.finish_reason}],
                          "usage": usage})


def chat_logprobs(turn: Turn, decode: Callable[[list[int]], str]) -> dict:
    """`choices[0].logprobs` of a chat completion: each kept token, its log-prob and bytes."""
    content = []
    for token_id, logprob in zip(turn.ids, turn.logprobs, strict=True):
        token = decode([token_id])
        content.append({"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []})
    return {"content": content}


def chat_stream(completion_id: str, model: str, turn: Turn, usage: dict | None) -> Response:
    """A chat turn as `chat.completion.chunk` events (the usage chunk when `usage` is given)."""
    base = {"id": completion_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}

    def chunk(delta: dict, finish_reason: str | None = None) -> bytes:
        return _event({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]})

    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": piece}) for piece in pieces(turn.content or "")]
    for k, call in enumerate(turn.tool_calls):
        events.append(chunk({"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                             "function": {"name": call["function"]["name"], "arguments": ""}}]}))
        events += [chunk({"tool_calls": [{"index": k, "function": {"arguments": piece}}]})
                   for piece in pieces(call["function"]["arguments"])]
    events.append(chunk({}, turn.finish_reason))
    if usage is not None:
        events.append(_event({**base, "choices": [], "usage": usage}))
    return event_stream(events)


def completion_stream(body: dict, include_usage: bool) -> Response:
    """A text completion's answer `body` as `text_completion` events."""
    base = {k: body[k] for k in ("id", "object", "created", "model")}
    choice = body["choices"][0]
    events = [_event({**base, "choices": [{"index": 0, "text": piece, "logprobs": None, "finish_reason": None}]})
              for piece in pieces(choice["text"])]
    events.append(_event({**base, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}]}))
    if include_usage:
        events.append(_event({**base, "choices": [], "usage": body["usage"]}))
    return event_stream(events)


def _event(body: dict) -> bytes:
    return b"data: " + _ENCODER.encode(body) + b"\n\n"


def event_stream(events: list[bytes]) -> Response:
    """The server-sent events of one answer, then `[DONE]`, sent in one go (the completion is
    already whole: streaming keeps OpenAI clients' streaming code paths working, not latency)."""
    return Response(b"".join([*events, b"data: [DONE]\n\n"]), content_type="text/event-stream", headers="Cache-Control: no-cache\r\n")


def pieces(text: str, words_per_piece: int = 4) -> list[str]:
    """`text` in pieces of a few words, which concatenate back to `text` exactly."""
    words = _PIECE.findall(text)
    return ["".join(words[k:k + words_per_piece]) for k in range(0, len(words), words_per_piece)]
