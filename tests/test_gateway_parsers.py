"""Tool-call parsers of the three families behind the ToolCallParser interface: valid calls, several
calls in one action, malformed ones (never raised, always a ParseError), the cut point, and the
family detected from a tokenizer's vocabulary."""

from __future__ import annotations

import pytest

from agentrl.engine.parsers import (
    TOOL_CALL_PARSERS,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolCallParser,
    detect_tool_call_format,
)


def test_every_parser_fits_the_interface():
    methods = [m for m in vars(ToolCallParser) if not m.startswith("_")]
    assert sorted(methods) == ["cut_point", "format_answer", "format_call", "parse"]
    for parser_cls in TOOL_CALL_PARSERS.values():
        assert all(callable(getattr(parser_cls(), m)) for m in methods), parser_cls


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
def test_format_call_parses_back(name):
    parser = TOOL_CALL_PARSERS[name]()
    arguments = {"query": "founder of \"Brimbell\" Optics", "top_k": 3, "nested": {"a": [1, 2]}}
    parsed = parser.parse(parser.format_call("search", arguments))
    assert [(c.name, c.arguments) for c in parsed.calls] == [("search", arguments)] and not parsed.errors
    answer = parser.parse("thinking " + parser.format_answer("Lorrowby"))
    assert answer.answer == "Lorrowby" and not answer.calls


# -- Hermes / Qwen ---------------------------------------------------------------------------------


def test_hermes_several_calls_and_malformed_ones():
    text = ('I will search. <tool_call>{"name": "search", "arguments": {"query": "a"}}</tool_call>\n'
            '<tool_call>{"name": "calc", "arguments": "{\\"x\\": 1}"}</tool_call>'  # double-encoded arguments
            '<tool_call>{"name": "search", "arguments": {"query": </tool_call>'
            '<tool_call>["search"]</tool_call><tool_call>{"name": "x", "arguments": {}')
    parsed = HermesParser().parse(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("search", {"query": "a"}), ("calc", {"x": 1})]
    assert [e.kind for e in parsed.errors] == ["bad_json", "bad_call", "truncated"]
    assert parsed.calls[0].raw == '<tool_call>{"name": "search", "arguments": {"query": "a"}}</tool_call>'


def test_hermes_cut_point_drops_an_imagined_tool_response():
    call = '<tool_call>{"name": "search", "arguments": {"query": "a"}}</tool_call>'
    text = call + "\n<tool_response>made up</tool_response>"
    assert HermesParser().cut_point(text) == len(call)


# -- Llama 3 JSON ----------------------------------------------------------------------------------


def test_llama3_valid_calls_with_and_without_python_tag():
    parser = Llama3JsonParser()
    one = parser.parse('{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert [(c.name, c.arguments) for c in one.calls] == [("get_weather", {"city": "Paris"})]
    tagged = parser.parse('<|python_tag|>{"name": "search", "arguments": {"query": "x"}}')
    assert [(c.name, c.arguments) for c in tagged.calls] == [("search", {"query": "x"})]
    assert tagged.calls[0].raw.startswith("<|python_tag|>")


def test_llama3_several_calls_separated_by_semicolons():
    text = '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}};{"name": "c", "parameters": {"y": [2]}}'
    parsed = Llama3JsonParser().parse(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("a", {"x": 1}), ("b", {}), ("c", {"y": [2]})]
    assert "".join(c.raw for c in parsed.calls) == text  # the raws tile the action: content = text minus calls is ""


def test_llama3_plain_text_is_not_a_call_and_malformed_calls_are_errors():
    parser = Llama3JsonParser()
    assert parser.parse("The weather in Paris is sunny.").calls == [] and not parser.parse("Sunny.").errors
    bad = parser.parse('{"name": "a", "parameters": {"x": 1,}}')
    assert [e.kind for e in bad.errors] == ["bad_json"] and not bad.calls
    cut = parser.parse('{"name": "a", "parameters": {"city": "Par')
    assert [e.kind for e in cut.errors] == ["truncated"]
    not_a_call = parser.parse('{"tool": "a", "parameters": {}}')
    assert [e.kind for e in not_a_call.errors] == ["bad_call"]
    bad_args = parser.parse('{"name": "a", "parameters": [1, 2]}')
    assert [e.kind for e in bad_args.errors] == ["bad_call"]
    builtin = parser.parse('<|python_tag|>brave_search.call(query="x")')
    assert builtin.calls == [] and builtin.errors == []  # not JSON: plain text for this parser


def test_llama3_cut_point_after_the_last_call():
    call = '{"name": "a", "parameters": {"x": 1}}'
    assert Llama3JsonParser().cut_point(call + " and then I imagine the answer") == len(call)
    assert Llama3JsonParser().cut_point("plain text") == len("plain text")


# -- Mistral ---------------------------------------------------------------------------------------


def test_mistral_json_list_with_several_calls_and_content_before():
    text = 'Let me check. [TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    parsed = MistralParser().parse(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("a", {"x": 1}), ("b", {})]
    assert text.replace(parsed.calls[0].raw, "").strip() == "Let me check."


def test_mistral_v11_name_args_form():
    parsed = MistralParser().parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]noop[ARGS]{}')
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", {"city": "Paris"}), ("noop", {})]


def test_mistral_malformed_calls_are_errors():
    parser = MistralParser()
    assert [e.kind for e in parser.parse('[TOOL_CALLS][{"name": "a", "arguments": {"x": }]').errors] == ["bad_json"]
    assert [e.kind for e in parser.parse('[TOOL_CALLS][{"name": "a", "arguments": {"x": "abc').errors] == ["truncated"]
    assert [e.kind for e in parser.parse('[TOOL_CALLS]{"name": "a"}').errors] == ["bad_call"]
    assert [e.kind for e in parser.parse('[TOOL_CALLS][{"arguments": {}}]').errors] == ["bad_call"]
    assert parser.parse("no calls here").calls == [] and parser.parse("no calls here").errors == []


def test_mistral_cut_point_after_the_call_block():
    block = '[TOOL_CALLS][{"name": "a", "arguments": {}}]'
    assert MistralParser().cut_point(block + " trailing") == len(block)


# -- detection -------------------------------------------------------------------------------------


class _Vocab:
    def __init__(self, *tokens: str):
        self._vocab = {t: i for i, t in enumerate(tokens)}

    def get_vocab(self) -> dict[str, int]:
        return self._vocab


def test_detect_tool_call_format_from_the_vocabulary(tokenizer):
    assert detect_tool_call_format(_Vocab("a", "[TOOL_CALLS]", "[ARGS]")) == "mistral"
    assert detect_tool_call_format(_Vocab("<|python_tag|>", "<|eom_id|>")) == "llama3_json"
    assert detect_tool_call_format(_Vocab("<tool_call>", "</tool_call>")) == "hermes"
    assert detect_tool_call_format(tokenizer) == "hermes"  # SmolLM2: ChatML, agentrl's Hermes-style tool template
