"""Chat messages -> prompt token ids, with the gateway's own earlier completions spliced in as the
exact ids that were sampled.

Two renderers behind one method (`render(messages, tools, prefill, recall) -> Rendered`):

- `ChatMLRenderer` (models whose chat template has no tool section, e.g. SmolLM2 with agentrl's
  template): the project's ChatML layout built as ids the way `engine.chat.ChatFormat` builds
  native episodes: `<|im_start|>{role}\\n` + content ids + `<|im_end|>\\n` per message; the tools
  listed in the system turn (`TOOLS_SECTION`); an assistant message with tool calls rendered as its
  content followed by each call in the family's format; consecutive tool messages joined into one
  `tool` turn of `<tool_response>\\n...\\n</tool_response>` blocks (the native env's observation
  layout, so a policy trained natively sees the same tokens through the gateway). Message contents
  are tokenized as plain text: text such as `<|im_end|>` inside a message never becomes a control
  id (only the layout puts control ids in the prompt).
- `TemplateRenderer` (the tokenizer's own Jinja template, where it handles `tools`, e.g. Qwen2.5,
  Llama 3.1, Mistral): `apply_chat_template(messages, tools=..., add_generation_prompt=True)`, then
  the text is tokenized as transformers tokenizes a rendered template (special-token text parsed,
  as vLLM's own chat endpoint does). Recalled assistant messages are rendered with a sentinel
  content; the text is split at the sentinels and the recorded ids go in their place.

Splicing (both): `recall(message)` returns the ids the gateway recorded for one of its own
completions (the forced-call prefill, if any, + the sampled ids it kept), or None. Those ids go
between the assistant header and the closing boundary unchanged. If they end with a stop id (the
model closed its own turn), the closing boundary's first id (the same stop id) is not added again:
`...sampled, <|im_end|>` + `\\n`, never `<|im_end|><|im_end|>\\n` (the assistant -> tool boundary
bug class). An assistant message the session does not know is rendered from its text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from agentrl.engine.chat import ChatFormat
from agentrl.gateway.protocol import GatewayError, Message, ToolSpec, call_arguments, text_of


@dataclass
class Recorded:
    """One of the gateway's own completions, as the body of the assistant message that echoes it."""

    token_ids: list[int]
    """Forced-call prefill ids (prompt tokens) + the sampled ids kept (action tokens)."""
    checked: bool = False
    """Whether a rendering of its text has been compared with these ids yet (once per completion)."""


RecallFn = Callable[[Message], Recorded | None]


@dataclass
class Rendered:
    token_ids: list[int]
    """The whole prompt: messages, generation prompt, and the forced-call prefill."""
    prefill_ids: list[int]
    """The forced-call prefill at the end of `token_ids` ([] when the model may answer freely)."""
    spliced: list[tuple[int, int, Recorded]] = field(default_factory=list)
    """(message index, position in `token_ids`, record) of every recalled assistant message."""
    num_unrecognised: int = 0
    """Assistant messages rendered from their text (not recalled)."""
    messages: Sequence[Message] = ()
    """What was rendered, kept for `PromptCache` reuse."""
    tools_key: bytes | None = None
    message_ends: list[int] = field(default_factory=list)
    """Per message: the length of `token_ids` once it is rendered, or -1 where it is not a boundary
    (a tool message followed by another: one `tool` turn holds both)."""
    unrecognised_before: list[int] = field(default_factory=list)
    """Per message: `num_unrecognised` counted up to and including it."""


@dataclass(frozen=True)
class ToolList:
    """A request's `tools`, decoded once per distinct list (the raw JSON bytes are the cache key)."""

    key: bytes
    specs: tuple[ToolSpec, ...]

    @property
    def names(self) -> list[str]:
        return [t.function.name for t in self.specs]

    def as_dicts(self) -> list[dict]:
        return [{"type": "function", "function": {"name": t.function.name, "description": t.function.description or "",
                                                  "parameters": t.function.parameters or {"type": "object", "properties": {}}}}
                for t in self.specs]


TOOLS_SECTION = """# Tools

You may call one or more of these tools. Their descriptions and JSON schemas:
<tools>
{tools}
</tools>
To call a tool, write: {example}"""

# What the assistant turn starts with when `tool_choice` demands a call: the prompt-based model is
# made to continue a call that the prompt has already opened (there is no constrained decoding on the
# token-in/token-out path). "{name}" is the JSON string of the demanded tool's name.
FORCED_CALL_PREFILL: dict[str, tuple[str, str]] = {
    "hermes": ("<tool_call>", '<tool_call>{{"name": {name}, "arguments": '),
    "llama3_json": ('{{"name": ', '{{"name": {name}, "parameters": '),
    "mistral": ("[TOOL_CALLS][", '[TOOL_CALLS][{{"name": {name}, "arguments": '),
}


def forced_prefill(family: str, forced: str | None) -> str:
    """The prefill for `ToolChoice.forced`: "" (free), any call ("required"), or a named call."""
    if forced is None:
        return ""
    any_call, named = FORCED_CALL_PREFILL[family]
    return any_call.format() if forced == "" else named.format(name=json.dumps(forced))


def plain_text_tokenizer(tokenizer) -> Tokenizer:
    """A copy of the fast tokenizer that reads special-token text (`<|im_end|>`) as plain text."""
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.encode_special_tokens = True
    return backend


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where `a` and `b` differ (the shorter one's length if one is a prefix of the
    other); None when they are equal."""
    if a == b:
        return None
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


class _Memo:
    """Bounded memo of text -> ids: system prompts, worked examples and tool results recur across
    the turns and sessions of a run, and encoding is the renderer's largest cost (~50 us for a
    100-token tool result)."""

    def __init__(self, encode: Callable[[str], list[int]], size: int = 65536):
        self._encode, self._size, self._ids = encode, size, {}

    def __call__(self, text: str) -> list[int]:
        ids = self._ids.get(text)
        if ids is None:
            if len(self._ids) >= self._size:
                self._ids.clear()
            ids = self._ids[text] = self._encode(text)
        return ids


class ChatMLRenderer:
    name = "chatml"

    def __init__(self, tokenizer, parser):
        self.chat = ChatFormat(tokenizer)
        self.parser = parser
        self.stop_token_ids = self.chat.stop_token_ids
        plain = plain_text_tokenizer(tokenizer)
        self._plain_encode = lambda text: plain.encode(text, add_special_tokens=False).ids
        self._text = _Memo(self._plain_encode)
        self._system_memo: dict[tuple[str | None, bytes], list[int]] = {}
        self._example_call = parser.format_call("tool_name", {"argument": "value"})

    def tools_section(self, tools: ToolList) -> str:
        lines = [json.dumps({"name": t.function.name, "description": t.function.description or "",
                             "parameters": t.function.parameters or {}}, separators=(",", ":"), ensure_ascii=False)
                 for t in tools.specs]
        return TOOLS_SECTION.format(tools="\n".join(lines), example=self._example_call)

    def _system_ids(self, system: str | None, tools: ToolList) -> list[int]:
        key = (system, tools.key)
        ids = self._system_memo.get(key)
        if ids is None:
            if len(self._system_memo) >= 4096:
                self._system_memo.clear()
            section = self.tools_section(tools)
            content = section if system is None else f"{system}\n\n{section}"
            ids = self._system_memo[key] = [*self.chat.role_head("system"), *self._text(content), *self.chat.turn_end_ids]
        return ids

    def assistant_text(self, message: Message, index: int) -> str:
        calls = "".join(self.parser.format_call(call.function.name, call_arguments(index, j, call))
                        for j, call in enumerate(message.tool_calls or ()))
        return text_of(message) + calls

    def first_drift(self, messages: Sequence[Message], tools: ToolList | None, prefill: str, rendered: Rendered) -> int | None:
        """The first prompt position where rendering the recalled, not yet checked, assistant messages
        from their text differs from the recorded ids; None when none differs. Per message: each
        recalled body sits between the same header and closing either way (see `render`)."""
        for index, start, recorded in rendered.spliced:
            if recorded.checked:
                continue
            recorded.checked = True
            body = recorded.token_ids
            if body and body[-1] == self.chat.im_end_id:
                body = body[:-1]
            from_text = self._plain_encode(self.assistant_text(messages[index], index))  # unique text: not memoised
            offset = first_difference(body, from_text)
            if offset is not None:
                return start + offset
        return None

    def render(self, messages: Sequence[Message], tools: ToolList | None, prefill: str, recall: RecallFn | None,
               previous: Rendered | None = None) -> Rendered:
        """`previous`: the same session's last rendering; the messages this request repeats from its
        start are not rendered again (an agent resends its whole history every turn: at the 4th turn
        of the benchmark's episodes that is 12 of 14 messages, ~24 us -> ~8 us)."""
        chat = self.chat
        tools_key = tools.key if tools is not None else None
        out = Rendered([], [], messages=messages, tools_key=tools_key)
        ids, ends, unrecognised = out.token_ids, out.message_ends, out.unrecognised_before
        reused = self._reusable(previous, messages, tools_key) if previous is not None else 0
        if reused:
            ids += previous.token_ids[:previous.message_ends[reused - 1]]
            ends += previous.message_ends[:reused]
            unrecognised += previous.unrecognised_before[:reused]
            out.spliced = [s for s in previous.spliced if s[0] < reused]
            out.num_unrecognised = unrecognised[-1]
        elif tools is not None:
            has_system = messages[0].role in ("system", "developer")
            ids += self._system_ids(text_of(messages[0]) if has_system else None, tools)
            if has_system:
                ends.append(len(ids))
                unrecognised.append(0)
        i, num_messages = len(ends), len(messages)
        while i < num_messages:
            message = messages[i]
            role = message.role
            if role == "assistant":
                ids += chat.assistant_head_ids
                recorded = recall(message) if recall is not None else None
                if recorded is not None:
                    out.spliced.append((i, len(ids), recorded))
                    ids += recorded.token_ids
                    closed = bool(recorded.token_ids) and recorded.token_ids[-1] == chat.im_end_id
                    ids += chat.newline_ids if closed else chat.turn_end_ids
                else:
                    out.num_unrecognised += 1
                    ids += self._text(self.assistant_text(message, i))
                    ids += chat.turn_end_ids
            elif role == "tool":
                responses = []
                while i < num_messages and messages[i].role == "tool":
                    responses.append(f"<tool_response>\n{text_of(messages[i])}\n</tool_response>")
                    ends.append(-1)
                    unrecognised.append(out.num_unrecognised)
                    i += 1
                ids += chat.role_head("tool")
                ids += self._text("\n".join(responses))
                ids += chat.turn_end_ids
                ends[-1] = len(ids)
                continue
            else:
                ids += chat.role_head("system" if role == "developer" else role)
                ids += self._text(text_of(message))
                ids += chat.turn_end_ids
            ends.append(len(ids))
            unrecognised.append(out.num_unrecognised)
            i += 1
        ids += chat.assistant_head_ids
        if prefill:
            out.prefill_ids = chat.encode(prefill)
            ids += out.prefill_ids
        return out

    @staticmethod
    def _reusable(previous: Rendered, messages: Sequence[Message], tools_key: bytes | None) -> int:
        """How many leading messages can be taken from `previous`: those it rendered identically,
        cut back to a message boundary of both renderings (not inside a `tool` turn)."""
        if previous.tools_key != tools_key:
            return 0
        old = previous.messages
        k, limit = 0, min(len(old), len(messages))
        while k < limit and old[k] == messages[k]:
            k += 1
        while k and (previous.message_ends[k - 1] < 0 or
                     (messages[k - 1].role == "tool" and k < len(messages) and messages[k].role == "tool")):
            k -= 1
        return k


def end_of_turn_ids(tokenizer, model_dir: str | Path | None) -> list[int]:
    """Ids that end an assistant turn: the tokenizer's EOS, the generation config's EOS ids, and the
    end-of-turn tokens of the common template families present in the vocabulary."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    config = Path(model_dir) / "generation_config.json" if model_dir else None
    if config is not None and config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    vocab = tokenizer.get_vocab()
    for token in ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>"):
        if token in vocab:
            ids.add(vocab[token])
    return sorted(ids)


class TemplateRenderer:
    name = "template"
    _SENTINEL = "\x00agentrl-splice-{}\x00"
    _SPLIT = re.compile("\x00agentrl-splice-\\d+\x00")

    def __init__(self, tokenizer, parser, model_dir: str | Path | None = None):
        if not tokenizer.chat_template:
            raise ValueError("the tokenizer has no chat template; use the chatml renderer or give a template")
        self.tokenizer = tokenizer
        self.parser = parser
        self.stop_token_ids = end_of_turn_ids(tokenizer, model_dir)
        backend = tokenizer.backend_tokenizer
        self._encode = lambda text: backend.encode(text, add_special_tokens=False).ids

    def _template_message(self, message: Message, index: int) -> dict:
        role = message.role
        out: dict = {"role": role, "content": text_of(message)}
        if message.tool_calls:
            out["tool_calls"] = [{"id": call.id, "type": "function",
                                  "function": {"name": call.function.name, "arguments": call_arguments(index, j, call)}}
                                 for j, call in enumerate(message.tool_calls)]
        if message.tool_call_id is not None:
            out["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            out["name"] = message.name
        return out

    def first_drift(self, messages: Sequence[Message], tools: ToolList | None, prefill: str, rendered: Rendered) -> int | None:
        """The first position where the whole prompt rendered from the messages' text differs from the
        spliced prompt; None when they agree."""
        if all(recorded.checked for _, _, recorded in rendered.spliced):
            return None
        for _, _, recorded in rendered.spliced:
            recorded.checked = True
        return first_difference(rendered.token_ids, self.render(messages, tools, prefill, None).token_ids)

    def render(self, messages: Sequence[Message], tools: ToolList | None, prefill: str, recall: RecallFn | None,
               previous: Rendered | None = None) -> Rendered:
        """`previous` is not used: a Jinja template is rendered whole (it may look at any message)."""
        conversation, recalled = [], []
        unrecognised = 0
        for i, message in enumerate(messages):
            recorded = recall(message) if recall is not None and message.role == "assistant" else None
            if recorded is not None:
                conversation.append({"role": "assistant", "content": self._SENTINEL.format(len(recalled))})
                recalled.append((i, recorded))
            else:
                unrecognised += message.role == "assistant"
                conversation.append(self._template_message(message, i))
        try:
            text = self.tokenizer.apply_chat_template(conversation, tools=tools.as_dicts() if tools else None,
                                                      add_generation_prompt=True, tokenize=False)
        except Exception as err:  # a Jinja template raises whatever its author chose (TemplateError, TypeError, ...)
            raise GatewayError(400, f"the model's chat template cannot render these messages: {type(err).__name__}: {err}",
                               param="messages") from err
        pieces = self._SPLIT.split(text + prefill)
        if len(pieces) != len(recalled) + 1:
            raise GatewayError(500, "the chat template does not render assistant content verbatim, so the sampled ids "
                               "cannot be spliced in; serve this model with the chatml renderer (--renderer chatml)",
                               code="template_not_spliceable")
        ids: list[int] = []
        out = Rendered(ids, [], num_unrecognised=unrecognised)
        stops = set(self.stop_token_ids)
        for k, piece in enumerate(pieces):
            piece_ids = self._encode(piece)
            if k and piece_ids and piece_ids[0] in stops:
                previous = recalled[k - 1][1].token_ids
                if previous and previous[-1] in stops:
                    piece_ids = piece_ids[1:]  # the sampled stop id already closes the message
            ids += piece_ids
            if k < len(recalled):
                out.spliced.append((recalled[k][0], len(ids), recalled[k][1]))
                ids += recalled[k][1].token_ids
        if prefill:
            out.prefill_ids = self._encode(prefill)
            if ids[-len(out.prefill_ids):] != out.prefill_ids:
                raise GatewayError(500, "the forced tool-call prefill does not tokenize on its own boundary with this template",
                                   code="prefill_boundary")
        return out


def template_handles_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders a `tools` list (the "auto" renderer's choice)."""
    template = tokenizer.chat_template
    return isinstance(template, str) and "tools" in template
