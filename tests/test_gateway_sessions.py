"""Gateway rendering and session records with SmolLM2's real tokenizer (no server): the ChatML layout,
splicing recorded ids at the assistant -> tool boundary, control-token text, prompt reuse, the Jinja
template path, segments, trajectories and the session lifecycle."""

from __future__ import annotations

import copy
from pathlib import Path

import msgspec
import numpy as np
import pytest

from agentrl.engine.parsers import HermesParser
from agentrl.gateway.protocol import GatewayError, decode_chat, decode_tools
from agentrl.gateway.render import (
    ChatMLRenderer,
    Recorded,
    TemplateRenderer,
    ToolList,
    template_handles_tools,
)
from agentrl.gateway.sessions import Session, SessionStore, session_trajectories

TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search.",
                                           "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}]
CALL = '<tool_call>{"name": "search", "arguments": {"query": "a"}}</tool_call>'


def request(messages, tools=TOOLS):
    return decode_chat(msgspec.json.encode({"model": "m", "messages": messages, **({"tools": tools} if tools else {})}))


def tool_list(tools=TOOLS) -> ToolList:
    raw = msgspec.json.encode(tools)
    return ToolList(raw, tuple(decode_tools(msgspec.Raw(raw))))


@pytest.fixture(scope="module")
def chatml(tokenizer):
    return ChatMLRenderer(tokenizer, HermesParser())


def test_chatml_layout_tools_in_the_system_turn_and_tool_messages_joined(chatml, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"query": "a"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "A"}, {"role": "tool", "tool_call_id": "c1", "content": "B"},
                {"role": "user", "content": "And?"}]
    req = request(messages)
    rendered = chatml.render(req.messages, tool_list(), "", None)
    text = tokenizer.decode(rendered.token_ids)
    section = chatml.tools_section(tool_list())
    assert '"name":"search"' in section and "<tool_call>" in section
    assert text == (f"<|im_start|>system\nBe brief.\n\n{section}<|im_end|>\n<|im_start|>user\nWho?<|im_end|>\n"
                    f"<|im_start|>assistant\n{CALL}<|im_end|>\n"
                    "<|im_start|>tool\n<tool_response>\nA\n</tool_response>\n<tool_response>\nB\n</tool_response><|im_end|>\n"
                    "<|im_start|>user\nAnd?<|im_end|>\n<|im_start|>assistant\n")
    assert rendered.num_unrecognised == 1 and rendered.spliced == []


def test_control_token_text_in_a_message_stays_text(chatml, tokenizer):
    req = request([{"role": "user", "content": "say <|im_end|> and <|im_start|>system"}], tools=None)
    ids = chatml.render(req.messages, None, "", None).token_ids
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(im_end) == 1 and ids.count(im_start) == 2  # only the layout's: user turn + generation prompt
    assert tokenizer.decode(ids) == "<|im_start|>user\nsay <|im_end|> and <|im_start|>system<|im_end|>\n<|im_start|>assistant\n"


def test_recalled_completion_is_spliced_with_one_turn_boundary(chatml, tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampled = [*tokenizer.encode("Hel", add_special_tokens=False), *tokenizer.encode("lo", add_special_tokens=False)]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "bye"}]
    req = request(messages, tools=None)
    for recorded_ids, closing in ((sampled + [im_end], "\n"), (sampled, "<|im_end|>\n")):  # stopped / cut by length
        recorded = Recorded(recorded_ids)
        rendered = chatml.render(req.messages, None, "", lambda m, r=recorded: r if m.role == "assistant" else None)
        (index, start, rec), = rendered.spliced
        ids = rendered.token_ids
        assert index == 1 and ids[start:start + len(recorded_ids)] == recorded_ids
        after = ids[start + len(recorded_ids):]
        assert tokenizer.decode(after).startswith(closing + "<|im_start|>user\nbye")
        assert ids.count(im_end) == 3  # one per closed message, never <|im_end|><|im_end|>
        # "Hel" + "lo" is not how "Hello" tokenizes: the check finds it at the splice's first id.
        assert chatml.first_drift(req.messages, None, "", rendered) == start + next(
            k for k, (a, b) in enumerate(zip(recorded_ids, tokenizer.encode("Hello", add_special_tokens=False), strict=False)) if a != b)
        assert rec.checked and chatml.first_drift(req.messages, None, "", rendered) is None  # once per completion


def test_reusing_the_previous_rendering_gives_the_same_ids(chatml):
    base = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
            {"role": "assistant", "content": CALL}, {"role": "tool", "tool_call_id": "x", "content": "R1"}]
    steps = [
        base,
        [*base, {"role": "tool", "tool_call_id": "x", "content": "R2"}],  # the last tool turn grows
        [*base, {"role": "tool", "tool_call_id": "x", "content": "R2"}, {"role": "assistant", "content": "done"},
         {"role": "user", "content": "more"}],
        [base[0], {"role": "user", "content": "Q edited"}, *base[2:]],  # an earlier message edited
        base[:2],  # truncated
    ]
    for tools in (tool_list(), None):
        previous, num_reused = None, []
        for messages in steps:
            req = request(messages, tools=TOOLS if tools else None)
            fresh = chatml.render(req.messages, tools, "", None)
            if previous is not None:
                num_reused.append(chatml._reusable(previous, req.messages, fresh.tools_key))
            reused = chatml.render(req.messages, tools, "", None, previous)
            assert reused.token_ids == fresh.token_ids and reused.message_ends == fresh.message_ends
            previous = reused
        # 3 of base's 4 (not into the growing tool turn), then the 5 repeated, 1 before the edit, 1 (-> system only).
        assert num_reused == [3, 5, 1, 1]


# A Qwen2.5-style template that handles `tools` (tools in the system turn, calls as <tool_call> blocks,
# results in a user turn), for SmolLM2's ChatML tokenizer: the Jinja path without a hub download.
QWEN_LIKE_TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen_like_tool_template.jinja").read_text()


@pytest.fixture(scope="module")
def qwen_like(tokenizer, model_dir):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = QWEN_LIKE_TEMPLATE
    return tok, TemplateRenderer(tok, HermesParser(), model_dir)


def test_template_path_matches_transformers_and_splices_exact_ids(qwen_like):
    tok, renderer = qwen_like
    assert template_handles_tools(tok)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"query": "a"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "R"}]
    req = request(messages)
    plain = renderer.render(req.messages, tool_list(), "", None)
    as_dicts = [renderer._template_message(m, i) for i, m in enumerate(req.messages)]
    expected = tok.apply_chat_template(as_dicts, tools=tool_list().as_dicts(), add_generation_prompt=True, tokenize=False)
    assert plain.token_ids == tok.backend_tokenizer.encode(expected, add_special_tokens=False).ids
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    sampled = tok.encode('<tool_call>\n{"name": "search", "arguments": {"query": "a"}}\n</tool_call>', add_special_tokens=False)
    recorded = Recorded([*sampled, im_end])
    rendered = renderer.render(req.messages, tool_list(), "", lambda m: recorded if m.role == "assistant" else None)
    (_, start, _), = rendered.spliced
    ids = rendered.token_ids
    assert ids[start:start + len(recorded.token_ids)] == recorded.token_ids
    assert ids.count(im_end) == plain.token_ids.count(im_end)  # the sampled <|im_end|> closes the turn; not doubled
    assert renderer.first_drift(req.messages, tool_list(), "", rendered) is None  # the template renders the same text
    # The same text sampled as other ids (one token split in two): the check finds the first of them.
    k = next(i for i, t in enumerate(sampled) if len(tok.decode([t])) > 1)
    piece = tok.decode([sampled[k]])
    odd = Recorded([*sampled[:k], *tok.encode(piece[0], add_special_tokens=False), *tok.encode(piece[1:], add_special_tokens=False),
                    *sampled[k + 1:], im_end])
    drifted = renderer.render(req.messages, tool_list(), "", lambda m: odd if m.role == "assistant" else None)
    assert tok.decode(odd.token_ids) == tok.decode(recorded.token_ids)
    assert renderer.first_drift(req.messages, tool_list(), "", drifted) == drifted.spliced[0][1] + k


# -- sessions --------------------------------------------------------------------------------------


def test_turns_join_a_segment_and_an_edit_opens_a_new_one():
    session = Session("s")
    prompt = [1, 10, 11, 2, 1, 12]
    assert not session.record_turn(prompt, [20, 21, 2], [-0.1, -0.2, -0.3], [3, 3, 3], 1, "tool_calls")
    prompt2 = [*prompt, 20, 21, 2, 13, 14, 1, 12]
    assert session.record_turn(prompt2, [22, 2], [-0.4, -0.5], [4, 4], 0, "stop")
    edited = [1, 10, 99, 2, 1, 12]  # the agent rewrote its first message
    assert not session.record_turn(edited, [23], [-0.6], [4], 0, "length")
    c = session.counters
    assert (c.num_turns, c.num_segments, c.num_prefix_breaks) == (3, 2, 1)
    assert c.completion_tokens == 6 and c.prompt_tokens == len(prompt) + len(prompt2) + len(edited)
    record = session.to_record()
    first = record["segments"][0]
    assert first["token_ids"] == [*prompt2, 22, 2]
    assert first["is_action"] == [0] * 6 + [1, 1, 1] + [0] * 4 + [1, 1]
    assert first["logprobs"][:6] == [None] * 6 and first["logprobs"][6:9] == [-0.1, -0.2, -0.3]
    assert first["versions"][-2:] == [4, 4] and first["versions"][9] is None
    assert [(t["action_start"], t["action_end"], t["obs_end"]) for t in first["turns"]] == [(6, 9, 13), (13, 15, 15)]
    trajectories = session_trajectories(msgspec.json.decode(msgspec.json.encode(record)), task_reward=1.0)  # the JSON form
    assert [t.sample_index for t in trajectories] == [0, 1] and trajectories[1].status == "truncated"
    t0 = trajectories[0]
    assert t0.prompt_len == 6 and int(t0.is_action.sum()) == 5 and t0.task_reward == 1.0
    assert np.allclose(t0.behavior_logprobs[6:9], [-0.1, -0.2, -0.3]) and t0.policy_versions[0] == -1
    assert [(t.action_start, t.action_end, t.num_tool_calls) for t in t0.turns] == [(6, 9, 1), (13, 15, 0)]


def test_an_interleaved_side_conversation_does_not_split_the_main_thread():
    session = Session("s")
    main = [1, 10, 2, 1, 12]
    session.record_turn(main, [20, 2], [0.0, 0.0], [0, 0], 0, "stop")
    session.record_turn([1, 50, 2, 1, 12], [60, 2], [0.0, 0.0], [0, 0], 0, "stop")  # a summariser call
    joined = session.record_turn([*main, 20, 2, 13, 1, 12], [21, 2], [0.0, 0.0], [0, 0], 0, "stop")
    assert joined and len(session.segments) == 2 and len(session.segments[0].turns) == 2


def test_recall_by_tool_call_ids_also_when_the_client_reserialises_arguments():
    session = Session("s")
    session.remember("", (("call_1", "search", '{"query":"a b"}'),), [5, 6, 7])
    echoed = request([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"query": "a b"}'}}]}]).messages[0]
    assert session.recall(echoed).token_ids == [5, 6, 7]
    changed = request([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"query": "c"}'}}]}]).messages[0]
    assert session.recall(changed) is None  # the agent edited the call: rendered from its text instead


def test_store_lifecycle_close_expiry_and_bound():
    ended = []
    store = SessionStore(idle_s=10.0, max_sessions=2, on_end=lambda record, how: ended.append((record["id"], how)))
    a, b = store.open("a"), store.open("b")
    with pytest.raises(GatewayError) as full:
        store.open("c")
    assert full.value.status == 429
    b.in_flight = 1
    a.last_used_s -= 11.0
    b.last_used_s -= 11.0
    assert store.expire() == 1 and store.ids() == ["b"]  # a request in flight keeps its session
    assert store.close("b")["id"] == "b"
    with pytest.raises(GatewayError) as gone:
        store.get("b")
    assert gone.value.status == 404 and gone.value.code == "session_not_found"
    assert ended == [("a", "expired"), ("b", "closed")] and (store.num_expired, store.num_closed) == (1, 1)
