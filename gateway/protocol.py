"""The OpenAI wire format the gateway accepts: request structs, their validation, and errors.

Requests are decoded with msgspec into the structs below (a 12-message chat request decodes in
~10 us; the stdlib `json` plus hand checks took several times that), with unknown fields refused, as
OpenAI refuses them: a parameter the gateway would silently ignore is a bug waiting in the agent.
Fields the OpenAI API has but the gateway cannot honour (stop strings, penalties, logit bias, n > 1,
top log-probs, ...) are declared so that their default values pass and any other value is refused
with a message that names the field.

Every refusal is a `GatewayError`, sent as OpenAI's error JSON:
`{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}` with a 4xx status
(5xx only for the inference servers failing, never for what the client sent).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import msgspec


class GatewayError(Exception):
    """A request the gateway refuses; becomes OpenAI's error JSON with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
                              429: "rate_limit_error"}.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


class FunctionCallIn(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str
    """JSON text of the arguments object, as OpenAI sends and returns it."""


class ToolCallIn(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    function: FunctionCallIn
    type: str = "function"
    index: int | None = None
    """Present when a client rebuilt the call from stream deltas."""


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # What an OpenAI client's `message.model_dump()` echoes back; null (or empty) is the only value accepted.
    refusal: str | None = None
    function_call: dict | None = None
    audio: dict | None = None
    annotations: list | None = None


class FunctionSpec(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolSpec(msgspec.Struct, forbid_unknown_fields=True):
    function: FunctionSpec
    type: str = "function"


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    function: NamedFunction
    type: str = "function"


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Unsupported(msgspec.Struct):
    """Fields both endpoints declare only to refuse values other than their defaults."""

    n: int | None = None
    stop: str | list[str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict | None = None
    user: str | None = None


class ChatRequest(_Unsupported, forbid_unknown_fields=True, kw_only=True):
    model: str
    messages: list[Message]
    tools: msgspec.Raw = msgspec.Raw()
    """Kept raw: its bytes are the cache key of the rendered tool list (decoded on a miss only);
    empty when absent."""
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict | None = None


class CompletionRequest(_Unsupported, forbid_unknown_fields=True, kw_only=True):
    model: str
    prompt: str | list[int | str | list[int]]
    """Text, token ids, or a batch of one of either (`prompt_ids` checks which)."""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    seed: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None


_CHAT_DECODER = msgspec.json.Decoder(ChatRequest)
_COMPLETION_DECODER = msgspec.json.Decoder(CompletionRequest)
_TOOLS_DECODER = msgspec.json.Decoder(list[ToolSpec])
_AT_PATH = re.compile(r" - at `\$(.*)`$")
ROLES = ("system", "developer", "user", "assistant", "tool")


def _decode(decoder: msgspec.json.Decoder, body: bytes, prefix: str = ""):
    if not body:
        raise invalid("the request has no body; send a JSON object", None)
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as err:
        reason = str(err)
        match = _AT_PATH.search(reason)
        where = (prefix + match.group(1)).lstrip(".") if match else prefix
        reason = _AT_PATH.sub("", reason)
        missing = re.search(r"missing required field `([^`]+)`", reason)
        unknown = re.search(r"unknown field `([^`]+)`", reason)
        if missing or unknown:
            param = ".".join(x for x in (where, (missing or unknown).group(1)) if x)
            message = f"missing required field `{param}`" if missing else f"unrecognised request argument `{param}`"
        else:
            param = where or None
            message = f"{param}: {reason}" if param else reason
        raise invalid(f"invalid request: {message}", param) from None
    except msgspec.DecodeError as err:
        raise invalid(f"the body is not valid JSON: {err}", None) from None


def decode_chat(body: bytes) -> ChatRequest:
    req = _decode(_CHAT_DECODER, body)
    check_unsupported(req)
    check_sampling(req)
    if req.logprobs is not None and not req.logprobs and req.top_logprobs:
        raise invalid("`top_logprobs` needs `logprobs: true`", "top_logprobs")
    if req.top_logprobs:
        raise invalid("`top_logprobs` > 0 is not supported: the inference servers return the sampled token's log-prob only", "top_logprobs")
    if req.response_format is not None and req.response_format.get("type", "text") != "text":
        raise invalid("`response_format` other than text is not supported (no constrained decoding)", "response_format")
    if not req.messages:
        raise invalid("`messages` must hold at least one message", "messages")
    for i, message in enumerate(req.messages):
        check_message(message, i)
    return req


def decode_completion(body: bytes) -> CompletionRequest:
    req = _decode(_COMPLETION_DECODER, body)
    check_unsupported(req)
    if req.echo:
        raise invalid("`echo: true` is not supported", "echo")
    if req.suffix:
        raise invalid("`suffix` is not supported", "suffix")
    if req.logprobs:
        raise invalid("`logprobs` > 0 is not supported: the inference servers return the sampled token's log-prob only; use 0", "logprobs")
    check_sampling(req)
    return req


def prompt_of(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request: text or token ids."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return prompt
    if prompt and all(type(x) is int for x in prompt):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str | list):
        return prompt[0]
    if not prompt:
        raise invalid("`prompt` is empty", "prompt")
    if len(prompt) > 1 and all(isinstance(x, str | list) for x in prompt):
        raise invalid(f"`prompt` holds a batch of {len(prompt)} prompts; send one prompt per request", "prompt")
    raise invalid("`prompt` must be a string, a list of token ids, or a list holding one of either", "prompt")


def decode_tools(raw: msgspec.Raw) -> list[ToolSpec]:
    tools = _decode(_TOOLS_DECODER, bytes(raw), prefix="tools")
    names = set()
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise invalid(f"tools[{i}].type must be \"function\", got {tool.type!r}", f"tools[{i}].type")
        if not tool.function.name:
            raise invalid(f"tools[{i}].function.name is empty", f"tools[{i}].function.name")
        if tool.function.name in names:
            raise invalid(f"two tools are named {tool.function.name!r}", f"tools[{i}].function.name")
        names.add(tool.function.name)
    return tools


def check_unsupported(req: _Unsupported) -> None:
    if req.n not in (None, 1):
        raise invalid(f"`n` = {req.n} is not supported: one choice per request (send n requests; in a session each is its own segment)", "n")
    if req.stop:
        raise invalid("`stop` strings are not supported: generation ends on the chat template's end-of-turn token; remove `stop`", "stop")
    for field_name in ("frequency_penalty", "presence_penalty"):
        if getattr(req, field_name):
            raise invalid(f"`{field_name}` is not supported (the token-in/token-out path samples without penalties); remove it or send 0",
                          field_name)
    if req.logit_bias:
        raise invalid("`logit_bias` is not supported", "logit_bias")


def check_sampling(req: ChatRequest | CompletionRequest) -> None:
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise invalid(f"`temperature` must be in [0, 2], got {req.temperature}", "temperature")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise invalid(f"`top_p` must be in (0, 1], got {req.top_p}", "top_p")
    if req.seed is not None and not -(2**63) <= req.seed < 2**63:
        raise invalid("`seed` must fit in 64 bits", "seed")


def check_message(message: Message, i: int) -> None:
    where = f"messages[{i}]"
    if message.role not in ROLES:
        raise invalid(f"{where}.role: unknown role {message.role!r}; expected one of {', '.join(ROLES)}", f"{where}.role")
    if message.function_call is not None:
        raise invalid(f"{where}.function_call is the deprecated form; send tool_calls", f"{where}.function_call")
    if message.audio is not None:
        raise invalid(f"{where}.audio is not supported", f"{where}.audio")
    if message.role == "assistant":
        if message.content is None and not message.tool_calls:
            raise invalid(f"{where}: an assistant message needs content or tool_calls", f"{where}.content")
        for j, call in enumerate(message.tool_calls or ()):
            if call.type != "function":
                raise invalid(f"{where}.tool_calls[{j}].type must be \"function\"", f"{where}.tool_calls[{j}].type")
    elif message.tool_calls:
        raise invalid(f"{where}: only assistant messages carry tool_calls", f"{where}.tool_calls")
    else:
        if message.content is None:
            raise invalid(f"{where}.content is missing (a {message.role} message needs content)", f"{where}.content")
        if message.role == "tool" and not message.tool_call_id:
            raise invalid(f"{where}.tool_call_id is missing (a tool message answers one tool call)", f"{where}.tool_call_id")
    if isinstance(message.content, list):
        for j, part in enumerate(message.content):
            if part.type != "text" or part.text is None:
                raise invalid(f"{where}.content[{j}]: only text parts are supported, got type {part.type!r}", f"{where}.content[{j}]")


def text_of(message: Message) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def call_arguments(message_index: int, call_index: int, call: ToolCallIn) -> dict:
    """An echoed call's arguments as an object (for rendering it as text); refuses what is not one."""
    where = f"messages[{message_index}].tool_calls[{call_index}].function.arguments"
    try:
        arguments = json.loads(call.function.arguments) if call.function.arguments.strip() else {}
    except json.JSONDecodeError as err:
        raise invalid(f"{where} is not valid JSON ({err.msg} at char {err.pos})", where) from None
    if not isinstance(arguments, dict):
        raise invalid(f"{where} must be a JSON object", where)
    return arguments


@dataclass(frozen=True)
class ToolChoice:
    """What a request's `tools` / `tool_choice` ask of this turn."""

    parse_calls: bool
    """Read tool calls out of the completion ("auto", "required", a named function)."""
    forced: str | None
    """None: the model may call or not; "": it must call some tool; a name: it must call that tool."""


def tool_choice(req: ChatRequest, tool_names: list[str]) -> ToolChoice:
    choice = req.tool_choice
    if not tool_names:
        if choice not in (None, "none"):
            raise invalid("`tool_choice` needs `tools`", "tool_choice")
        return ToolChoice(False, None)
    if choice is None or choice == "auto":
        return ToolChoice(True, None)
    if choice == "none":
        return ToolChoice(False, None)
    if choice == "required":
        return ToolChoice(True, "")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in tool_names:
            raise invalid(f"tool_choice names {choice.function.name!r}, which is not in `tools` ({', '.join(tool_names)})",
                          "tool_choice.function.name")
        return ToolChoice(True, choice.function.name)
    raise invalid(f"`tool_choice` must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                  f"got {choice!r}", "tool_choice")
