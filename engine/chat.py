"""Chat formatting as token ids (ChatML, SmolLM2's format) and the tool listing of a system prompt.

ChatML: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message. The boundary pieces are built as
ids once (`<|im_start|>` and `<|im_end|>` are single special ids in SmolLM2's vocabulary: 1 and 2)
and appended around separately tokenized contents; generated ids are appended exactly as sampled.
Nothing is ever re-tokenized from decoded text, so the ids the learner sees are the ids the policy
saw (Agent-R1 issue #30 traced GRPO NaNs to re-tokenization drift).

Invariant: `tokenizer.decode(ids)` of an episode equals `render(messages)` of its messages, because
every piece is either a boundary whose text is fixed or the ids of exactly one content string.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


@dataclass
class ChatFormat:
    tokenizer: object
    """A Hugging Face tokenizer with ChatML special tokens."""

    memo_size: int = 65536
    """Entries kept by `encode_cached` before it starts over."""

    def __post_init__(self) -> None:
        tok = self.tokenizer
        # The Rust tokenizer of a fast HF tokenizer gives the same ids without the Python wrapper's
        # per-call checks (measured: ~15% of an encode, and most of the wrapper's CPU in the capacity run).
        self._backend = getattr(tok, "backend_tokenizer", None)
        self._memo: dict[str, list[int]] = {}
        self.im_start_id = tok.convert_tokens_to_ids(IM_START)
        self.im_end_id = tok.convert_tokens_to_ids(IM_END)
        if self.im_start_id in (None, tok.unk_token_id) or self.im_end_id in (None, tok.unk_token_id):
            raise ValueError("the tokenizer has no ChatML tokens <|im_start|>/<|im_end|>; use a ChatML model (e.g. SmolLM2-Instruct, Qwen2.5-Instruct)")
        self.newline_ids = self.encode("\n")
        self._role_heads = {role: [self.im_start_id, *self.encode(role + "\n")] for role in ("system", "user", "assistant", "tool")}
        self.turn_end_ids = [self.im_end_id, *self.newline_ids]
        """`<|im_end|>\\n`: closes a message."""
        self.assistant_head_ids = self._role_heads["assistant"]
        """`<|im_start|>assistant\\n`: opens the policy's turn (the generation prompt)."""
        self.stop_token_ids = sorted({self.im_end_id, *([tok.eos_token_id] if tok.eos_token_id is not None else [])})

    def encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_cached(self, text: str) -> list[int]:
        """`encode` with a bounded memo: tool results repeat (the n samples of a GRPO group issue the
        same searches; corpus passages recur), and encoding is the env's largest per-turn CPU cost."""
        ids = self._memo.get(text)
        if ids is None:
            if len(self._memo) >= self.memo_size:
                self._memo.clear()
            ids = self._memo[text] = self.encode(text)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=False)
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def message(self, role: str, content: str) -> list[int]:
        return [*self.role_head(role), *self.encode(content), *self.turn_end_ids]

    def role_head(self, role: str) -> list[int]:
        if role not in self._role_heads:
            self._role_heads[role] = [self.im_start_id, *self.encode(role + "\n")]
        return self._role_heads[role]


def render(messages: Sequence[tuple[str, str, str]]) -> str:
    """The ChatML text of `messages`: (role, content, tail) triples, where tail is what closes the
    message (`CLOSED` normally; `<|im_end|>` alone for a final action that stopped; "" for a message
    still open)."""
    return "".join(f"{IM_START}{role}\n{content}{tail}" for role, content, tail in messages)


CLOSED = IM_END + "\n"


def _signature(schema: dict) -> str:
    """`name(arg: type, opt?: type): description`: one short line per tool."""
    fn = schema["function"]
    params = fn.get("parameters", {})
    required = set(params.get("required", ()))
    args = ", ".join(f"{name}{'' if name in required else '?'}: {spec.get('type', 'any')}"
                     for name, spec in params.get("properties", {}).items())
    return f"{fn['name']}({args}): {fn.get('description', '')}"


def list_tools(tool_schemas: Sequence[dict], tool_list: str = "json") -> str:
    """The tools of a system prompt, one per line.

    `tool_list` "json": each tool's whole schema as one-line JSON; "signature": one
    `name(arg: type, opt?: type): description` line per tool. With search, python and calculator the
    whole QA system prompt is 441 tokens (SmolLM2's tokenizer) as "json" and 198 as "signature".
    Arguments are validated against the full schema either way; the short form makes every sampled
    and every trained episode ~240 tokens shorter."""
    if tool_list == "json":
        lines = [json.dumps({"name": s["function"]["name"], "description": s["function"].get("description", ""),
                             "parameters": s["function"].get("parameters", {})}, separators=(",", ":")) for s in tool_schemas]
    elif tool_list == "signature":
        lines = [_signature(s) for s in tool_schemas]
    else:
        raise ValueError(f"tool_list={tool_list!r}: choose 'json' or 'signature'")
    return "\n".join(lines)
