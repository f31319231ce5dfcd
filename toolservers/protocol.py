"""Wire format shared by tool servers and clients.

Transport: a client DEALER sends ONE frame per message; the server ROUTER therefore sees exactly
two frames `[peer_identity, payload]` and answers `[peer_identity, payload]`. A payload is a
msgpack map (one request or reply) or a msgpack array of such maps (a batch). Batching is how
both ends amortize ZeroMQ's per-message cost: the client sends the requests issued in one
event-loop turn as one frame, the server answers the replies for one peer produced in one loop
turn as one frame. Each element is handled exactly as if it had come alone.

Sizes: every socket sets ZeroMQ's MAXMSGSIZE, so a frame over the receiver's limit is never
buffered (ZeroMQ drops that connection instead). Each request is at most the server's
`max_request_bytes` (a larger one is answered `request_too_large` with its id); a request frame is
at most its `max_frame_bytes` (the client splits its batches under its own `max_request_bytes`,
which by default is the server's). A reply frame is at most the server's `max_reply_frame_bytes`
(batches are split under it, one larger reply is replaced by `reply_too_large`), under the
client's MAXMSGSIZE `max_reply_bytes`.

Request (client -> server):
    id         int    client-chosen, unique per client; echoed in the reply so the client can
                      match replies that arrive out of order.
    op         str    "call" | "describe" | "ping".
    tool       str    ("call" only) the tool's name.
    args       map    ("call" only) the tool's arguments, checked against the tool's JSON schema.
    timeout_s  float  ("call" only) time budget left when the request was sent, in seconds. A
                      relative budget rather than an absolute timestamp, so that client and server
                      clocks need not agree. <= 0 means the deadline has already passed.

Reply (server -> client):
    id         int | None  the request's id; None when the request could not be decoded.
    ok         bool
    content    any         the tool's result (None when ok is false).
    error      map | None  {"type": str, "message": str} when ok is false.
    latency_s  float       seconds from the server receiving the request to sending the reply.

Error types (the `type` of an error) are the constants `E_*` below; they name what went wrong so a
caller can branch on them without parsing messages.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import msgpack

OP_CALL = "call"
OP_DESCRIBE = "describe"
OP_PING = "ping"

E_MALFORMED = "malformed_request"  # payload is not msgpack, not a map, or lacks a field
E_BAD_FRAMES = "bad_frames"  # the message did not have exactly one payload frame
E_TOO_LARGE = "request_too_large"  # one request over max_request_bytes (server's or client's)
E_REPLY_TOO_LARGE = "reply_too_large"  # the result, packed, is over ServerConfig.max_reply_frame_bytes
E_UNKNOWN_TOOL = "unknown_tool"
E_UNKNOWN_OP = "unknown_op"
E_INVALID_ARGS = "invalid_arguments"  # arguments do not match the tool's JSON schema
E_DEADLINE = "deadline_exceeded"  # deadline passed before (or while) the tool ran
E_OVERLOADED = "overloaded"  # server at max in-flight requests; the request was NOT executed
E_TOOL = "tool_error"  # the tool ran and failed (e.g. calculator division by zero)
E_SANDBOX = "sandbox_error"  # the sandbox itself failed (not the user's code)
E_SHUTTING_DOWN = "shutting_down"  # server is stopping; the request was NOT executed

# Errors for which the request was certainly not executed, so a client may resend it anywhere,
# even for a tool that is not idempotent.
NOT_EXECUTED_ERRORS = frozenset({E_OVERLOADED, E_SHUTTING_DOWN})


@dataclass(frozen=True)
class ToolError:
    """A service-side error: `type` is one of the E_* constants, `message` says what and why."""

    type: str
    message: str


# A Packer reused per thread: packb builds one per call (~30% slower); a Packer is not thread-safe.
_local = threading.local()


def pack(obj: Any) -> bytes:
    try:
        packer = _local.packer
    except AttributeError:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(obj)


def unpack(payload: bytes) -> Any:
    return msgpack.unpackb(payload, raw=False, strict_map_key=False)


_ARRAY_HEADERS = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}


def unpack_sized(payload: bytes) -> list[tuple[Any, int]]:
    """The elements of a payload, each with its packed size in bytes: a batch's elements, or the
    payload itself. Raises ValueError for anything that is not exactly one msgpack value."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(payload), 1))
    unpacker.feed(payload)
    elements = []
    try:
        count = unpacker.read_array_header() if payload[:1] and payload[0] in _ARRAY_HEADERS else None
        for _ in range(1 if count is None else count):
            start = unpacker.tell()
            value = unpacker.unpack()
            elements.append((value, unpacker.tell() - start))
    except msgpack.UnpackException as exc:  # OutOfData (truncated) is not a ValueError
        raise ValueError(f"Unpack failed: {type(exc).__name__} {exc}") from None
    if unpacker.tell() != len(payload):
        raise ValueError(f"extra data after the first value ({len(payload) - unpacker.tell()} bytes)")
    if count is None:
        return [(elements[0][0], len(payload))]
    return elements


def short_repr(value: Any, max_chars: int = 80) -> str:
    """repr() cut to max_chars: error messages echo what a client sent, never all of it."""
    text = repr(value)
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def pack_array(packed_items: list[bytes]) -> bytes:
    """A msgpack array from already-packed elements (no unpack/repack of the replies)."""
    n = len(packed_items)
    if n < 16:
        header = bytes([0x90 | n])
    elif n < 1 << 16:
        header = b"\xdc" + n.to_bytes(2, "big")
    else:
        header = b"\xdd" + n.to_bytes(4, "big")
    return header + b"".join(packed_items)


def reply(req_id: int | None, content: Any, latency_s: float) -> bytes:
    return pack({"id": req_id, "ok": True, "content": content, "error": None, "latency_s": latency_s})


def error_reply(req_id: int | None, err_type: str, message: str, latency_s: float = 0.0) -> bytes:
    return pack(
        {
            "id": req_id,
            "ok": False,
            "content": None,
            "error": {"type": err_type, "message": message},
            "latency_s": latency_s,
        }
    )


# --- argument checking against the tool's JSON schema ------------------------------------------
#
# Tools declare their arguments as JSON Schema (what OpenAI function calling and the engine use).
# Checking happens on every request, on the server's one busy thread, so it is a small checker for
# the subset of JSON Schema the tools use rather than a general validator (jsonschema costs ~30 us
# per call, which alone would cap the calculator at ~30k req/s). `check_schema_supported` rejects,
# at tool registration, any keyword this checker does not understand, so nothing is silently
# left unchecked.

_SUPPORTED_KEYWORDS = {
    "type",
    "properties",
    "required",
    "additionalProperties",
    "description",
    "minimum",
    "maximum",
    "maxLength",
    "minLength",
    "default",
}
_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
}


def check_schema_supported(schema: dict, where: str = "parameters") -> None:
    unknown = set(schema) - _SUPPORTED_KEYWORDS
    if unknown:
        raise ValueError(f"{where}: JSON schema keywords {sorted(unknown)} are not supported by the checker")
    if schema.get("type") not in _TYPES:
        raise ValueError(f"{where}: type must be one of {sorted(_TYPES)}, got {schema.get('type')!r}")
    for name, sub in schema.get("properties", {}).items():
        check_schema_supported(sub, f"{where}.{name}")


def validate_args(args: Any, schema: dict, where: str = "arguments") -> str | None:
    """Return None if `args` matches `schema`, else a message naming the first problem."""
    expected = schema["type"]
    # bool is an int in Python; JSON Schema keeps them apart.
    if not isinstance(args, _TYPES[expected]) or (expected in ("integer", "number") and isinstance(args, bool)):
        return f"{where}: expected {expected}, got {type(args).__name__}"
    if expected == "number" and isinstance(args, float) and not math.isfinite(args):
        return f"{where}: expected a finite number, got {args}"
    if expected == "object":
        props = schema.get("properties", {})
        for name in schema.get("required", ()):
            if name not in args:
                return f"{where}: missing required field {name!r}"
        if schema.get("additionalProperties") is False:
            extra = set(args) - set(props)
            if extra:
                names = sorted(short_repr(str(name), 40) for name in extra)
                shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
                return f"{where}: unexpected field(s) {shown}; allowed: {sorted(props)}"
        for name, value in args.items():
            if name in props:
                problem = validate_args(value, props[name], f"{where}.{name}")
                if problem:
                    return problem
    if "minimum" in schema and args < schema["minimum"]:
        return f"{where}: {args} is below the minimum {schema['minimum']}"
    if "maximum" in schema and args > schema["maximum"]:
        return f"{where}: {args} is above the maximum {schema['maximum']}"
    if "maxLength" in schema and len(args) > schema["maxLength"]:
        return f"{where}: length {len(args)} is over the maximum {schema['maxLength']}"
    if "minLength" in schema and len(args) < schema["minLength"]:
        return f"{where}: length {len(args)} is under the minimum {schema['minLength']}"
    return None
