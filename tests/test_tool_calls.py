"""OpenAI tool calling (server/tool_calls/): request checks, the constraint mapping, the default tool
template on SmolLM2's chat template, and parsing completions whole and streamed."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from depthserve.errors import InvalidRequestError
from depthserve.structured import ToolCallConstraint, ToolSpec
from server.tool_calls import (
    ContentDelta,
    FunctionTool,
    InvalidToolChoiceError,
    InvalidToolMessageError,
    NamedToolChoice,
    ParsedToolCall,
    ToolCallDelta,
    ToolCallStreamParser,
    new_tool_call_id,
    parse_tool_calls,
    parse_tool_choice,
    parse_tools,
    reassemble,
    render_chat_prompt,
    template_uses_tools,
    tool_call_constraint,
    tool_call_problem,
    tool_conversation,
)

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
    "additionalProperties": False,
}
RAW_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER_PARAMETERS, "strict": True}},
    {"type": "function", "function": {"name": "get_time"}},
]


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


# ---- request side ------------------------------------------------------------------------------
def test_parse_tools():
    weather, time = parse_tools(RAW_TOOLS)
    assert weather == FunctionTool("get_weather", "Current weather in a city", WEATHER_PARAMETERS, True)
    assert time == FunctionTool("get_time")
    assert parse_tools(None) == () == parse_tools([])


@pytest.mark.parametrize("tools, field", [
    ("get_weather", "tools"),
    ([{"type": "retrieval"}], "tools[0].type"),
    ([{"type": "function"}], "tools[0].function"),
    ([{"type": "function", "function": {"name": "get weather"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "tools[0].function.name"),
    ([RAW_TOOLS[1], {"type": "function", "function": {"name": "f", "parameters": "an object"}}],
     "tools[1].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "int"}}}}}],
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], "tools[0].function.strict"),
    ([RAW_TOOLS[1], RAW_TOOLS[1]], "tools[1].function.name"),
    ([RAW_TOOLS[1]] * 129, "tools"),
])
def test_bad_tools_name_the_field(tools, field):
    with pytest.raises(InvalidRequestError) as raised:
        parse_tools(tools)
    assert raised.value.field == field
    assert str(raised.value).startswith(field + ": ")
    assert raised.value.status == 400


def test_parse_tool_choice():
    tools = parse_tools(RAW_TOOLS)
    assert parse_tool_choice(None, tools) == "auto"
    assert parse_tool_choice(None, ()) == "none"
    assert parse_tool_choice("auto", ()) == "none"
    assert parse_tool_choice("required", tools) == "required"
    assert parse_tool_choice("none", tools) == "none"
    named = {"type": "function", "function": {"name": "get_time"}}
    assert parse_tool_choice(named, tools) == NamedToolChoice("get_time")


@pytest.mark.parametrize("choice, field", [
    ("always", "tool_choice"),
    ({"type": "function", "function": {"name": "get_date"}}, "tool_choice.function.name"),
    ({"type": "function"}, "tool_choice.function"),
    ({"type": "tool", "function": {"name": "get_time"}}, "tool_choice.type"),
])
def test_bad_tool_choice_names_the_field(choice, field):
    with pytest.raises(InvalidToolChoiceError) as raised:
        parse_tool_choice(choice, parse_tools(RAW_TOOLS))
    assert raised.value.field == field and isinstance(raised.value, InvalidRequestError)


def test_required_needs_tools():
    with pytest.raises(InvalidToolChoiceError, match="^tool_choice: "):
        parse_tool_choice("required", ())


def test_constraint_mapping():
    tools = parse_tools(RAW_TOOLS)
    assert tool_call_constraint(tools, "none") is None
    assert tool_call_constraint((), "auto") is None
    any_object = {"type": "object"}
    assert tool_call_constraint(tools, "auto") == ToolCallConstraint(
        (ToolSpec("get_weather", WEATHER_PARAMETERS), ToolSpec("get_time", any_object)), require_call=False)
    assert tool_call_constraint(tools, "auto", parallel_calls=False).parallel_calls is False
    assert tool_call_constraint(tools, "required") == ToolCallConstraint(
        (ToolSpec("get_weather", WEATHER_PARAMETERS), ToolSpec("get_time", None)), require_call=True)
    assert tool_call_constraint(tools, NamedToolChoice("get_weather")) == ToolCallConstraint(
        (ToolSpec("get_weather", WEATHER_PARAMETERS),), require_call=True, parallel_calls=False)


# ---- prompt side -------------------------------------------------------------------------------
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_b", "name": "get_time", "content": [{"type": "text", "text": "12:00"}]},
]


def test_default_template_renders_tools_calls_and_results(smollm_tokenizer):
    tools = parse_tools(RAW_TOOLS)
    prompt = render_chat_prompt(smollm_tokenizer, CONVERSATION, tools, "auto")
    tool_lines = "\n".join(json.dumps(t.openai_dict(), ensure_ascii=False) for t in tools)
    assert prompt.startswith("<|im_start|>system\n# Tools\n\n")
    assert f"<tools>\n{tool_lines}\n</tools>" in prompt
    assert '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>' in prompt
    assert "Call a function only when it helps; otherwise answer in plain text." in prompt
    assert "SmolLM" not in prompt  # the tools' system turn replaces the template's default one
    assert ("<|im_start|>assistant\n"
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n') in prompt
    assert ("<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>\n"
            "<tool_response>\n12:00\n</tool_response><|im_end|>\n<|im_start|>assistant\n") in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_default_template_system_message_and_choices():
    tools = parse_tools(RAW_TOOLS)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    turns = tool_conversation(messages, tools, NamedToolChoice("get_time"))
    assert turns[0]["content"].startswith("Be brief.\n\n# Tools\n")
    assert '"get_weather"' not in turns[0]["content"] and '"get_time"' in turns[0]["content"]
    assert turns[0]["content"].endswith('Answer with one call to the function "get_time" and no other text.')
    assert tool_conversation(messages, tools, "required")[0]["content"].endswith(
        "Answer with one or more function calls and no other text.")
    assert tool_conversation(messages, tools, "none") == messages  # no tools: the prompt is unchanged
    content_and_call = [{"role": "assistant", "content": "Let me look.", "tool_calls": CONVERSATION[1]["tool_calls"][1:]}]
    assert tool_conversation(content_and_call)[0]["content"] == (
        'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("message, field", [
    ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, "messages[0].tool_calls[0]"),
    ({"role": "user", "content": [{"type": "image_url"}]}, "messages[0].content[0]"),
])
def test_bad_tool_messages_name_the_field(message, field):
    with pytest.raises(InvalidToolMessageError) as raised:
        tool_conversation([message])
    assert raised.value.field == field


TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments.city }}]{% endfor %}{{ '\\n' }}{% endfor %}"
)


def test_user_template_that_knows_tools_renders_them(smollm_tokenizer):
    assert template_uses_tools(TOOL_TEMPLATE)
    assert not template_uses_tools(smollm_tokenizer.chat_template)
    tools = parse_tools(RAW_TOOLS)
    prompt = render_chat_prompt(smollm_tokenizer, CONVERSATION[:3], tools, "auto", chat_template=TOOL_TEMPLATE)
    assert prompt == ("TOOLS:get_weather;get_time;\nuser: Weather in Paris?\nassistant: [get_weather Paris][get_time ]\n"
                      "tool: 18 C, sunny\n")
    assert render_chat_prompt(smollm_tokenizer, CONVERSATION[:1], tools, "none",
                              chat_template=TOOL_TEMPLATE) == "user: Weather in Paris?\n"


# ---- output side: whole completions ------------------------------------------------------------
def call(text: str):
    return parse_tool_calls(text, ids())


def test_one_call():
    assert call('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>') == (
        None, [ParsedToolCall("call_0", "get_weather", '{"city":"Paris"}')])


def test_two_calls_and_content_before():
    text = ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": [1, 2]}}\n</tool_call>\n'
            '<tool_call>{ "name" : "b" , "arguments" : { } }</tool_call>\n')
    assert call(text) == ("Let me check.", [ParsedToolCall("call_0", "a", '{"x":[1,2]}'), ParsedToolCall("call_1", "b", "{}")])


def test_plain_text_is_content_exactly():
    for text in ["", "  hello \n", "a < b and <tool> <tool_call", "x <tool_call>not json</tool_call> y"]:
        assert call(text) == (text or None, [])


def test_malformed_blocks_stay_in_content():
    bad = ['<tool_call>{"arguments": {}, "name": "a"}</tool_call>', '<tool_call>{"name": "a", "arguments": 5}</tool_call>',
           '<tool_call>{"name": "", "arguments": {}}</tool_call>', "<tool_call>[1, 2]</tool_call>"]
    good = '<tool_call>{"name": "ok", "arguments": {}}</tool_call>'
    for block in bad:
        assert call(block) == (block, [])
        assert call(f"{block}\n{good}") == (block, [ParsedToolCall("call_0", "ok", "{}")])


def test_json_strings_may_hold_tags_quotes_and_unicode():
    arguments = {"q": 'say "</tool_call>" \\ then <tool_call>', "emoji": "héllo 🌍", "n": {"deep": [{"x": "}"}]}}
    text = f'<tool_call>{{"name": "search", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}</tool_call>'
    content, calls = call(text)
    assert content is None and [c.name for c in calls] == ["search"]
    assert json.loads(calls[0].arguments_json) == arguments
    escaped = json.dumps(arguments)  # \uXXXX escapes are kept as the model wrote them
    assert call(f'<tool_call>{{"name": "s", "arguments": {escaped}}}</tool_call>')[1][0].arguments_json == \
        json.dumps(arguments, separators=(",", ":"))


def test_truncated_call_keeps_what_was_written():
    content, calls = call('Sure <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    assert content == "Sure" and calls == [ParsedToolCall("call_0", "get_weather", '{"city":"Par')]
    tools = parse_tools(RAW_TOOLS)
    assert "not JSON" in tool_call_problem(calls[0], tools)
    # A missing end tag is forgiven
    assert call('<tool_call>{"name": "get_time", "arguments": {}}')[1] == [ParsedToolCall("call_0", "get_time", "{}")]


def test_junk_after_arguments_is_content():
    assert call('<tool_call>{"name": "a", "arguments": {}, "x": 1}</tool_call>') == (
        ', "x": 1}</tool_call>', [ParsedToolCall("call_0", "a", "{}")])


def test_tool_call_problem():
    tools = parse_tools(RAW_TOOLS)
    assert tool_call_problem(ParsedToolCall("i", "get_weather", '{"city":"Paris","unit":"c"}'), tools) is None
    assert "not one of the tools" in tool_call_problem(ParsedToolCall("i", "get_date", "{}"), tools)
    assert "'unit'" in tool_call_problem(ParsedToolCall("i", "get_weather", '{"city":"Paris","unit":"k"}'), tools)
    assert "not a JSON object" in tool_call_problem(ParsedToolCall("i", "get_time", "[]"), tools)
    assert tool_call_problem(ParsedToolCall("i", "get_time", '{"anything": 1}'), tools) is None  # not strict


def test_ids_look_like_openai():
    first, second = new_tool_call_id(), new_tool_call_id()
    assert first != second and first.startswith("call_") and len(first) == 29 and first[5:].isalnum()


# ---- output side: streaming --------------------------------------------------------------------
STREAM_TEXTS = [
    "Hello there, no tools here.\n",
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
    '<tool_call>\n{"name": "a", "arguments": {"q": "x \\"</tool_call>\\" \\\\ \\u00e9 é 🌍 <tool_call>", "l": [1, {"k": "}"}]}}\n'
    '</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\n',
    'a <tool_ b <tool_call>nope</tool_call> <tool_call>{"name": "c", "arguments": {"v": null}}</tool_call> tail  \n',
    '<tool_call>{"name": "d", "arguments": {"x": "unterminated',
    '<tool_call> { "name" :"e","arguments":{ "s" : "  spaced  " } } junk</tool_call>  <',
    "   \n",
]


def assert_stream_matches(text: str, cuts: list[int]) -> None:
    parser = ToolCallStreamParser(ids())
    deltas = []
    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        deltas += parser.feed(text[start:end])
    end = parser.finish()
    deltas += end.deltas
    expected = call(text)
    assert reassemble(deltas) == expected, (text, cuts)
    assert end.tool_called == bool(expected[1])
    seen: set[int] = set()
    for delta in deltas:  # each call's first delta names it; later ones carry arguments only
        if isinstance(delta, ToolCallDelta):
            assert (delta.id is not None) == (delta.index not in seen) and (delta.name is None) == (delta.id is None)
            seen.add(delta.index)
        else:
            assert isinstance(delta, ContentDelta) and delta.text


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_reassembles_to_the_whole_parse_for_random_splits(text):
    rng = random.Random(len(text))
    assert_stream_matches(text, list(range(1, len(text))))  # one character at a time
    for _ in range(200):
        assert_stream_matches(text, sorted(rng.sample(range(1, len(text)), rng.randint(0, min(12, len(text) - 1)))))


def test_stream_deltas_are_openai_shaped():
    parser = ToolCallStreamParser(ids())
    deltas = [d.openai_delta() for piece in ["Hi <tool_", 'call>{"name": "f", "arguments": {"a', '": 1}}</tool_call>']
              for d in parser.feed(piece)]
    assert deltas == [
        {"content": "Hi"},
        {"tool_calls": [{"index": 0, "id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"a'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '":1}'}}]},
    ]
    assert parser.finish().tool_called and parser.calls == [ParsedToolCall("call_0", "f", '{"a":1}')]


# ---- the grammar's output parses -----------------------------------------------------------------
@pytest.mark.parametrize("choice", ["required", NamedToolChoice("get_weather")])
def test_what_the_grammar_lets_through_parses_into_valid_calls(smollm_tokenizer, choice):
    """Random logits masked by the tool constraint, greedy: every finished output is calls only,
    each valid against its tool (the non-strict get_time too: required enforces every schema)."""
    import torch

    from depthserve.structured import apply_token_bitmask_, create_grammar_backend

    backend = create_grammar_backend(smollm_tokenizer, eos_token_ids=[2, 0])
    tools = parse_tools(RAW_TOOLS)
    grammar = backend.compile(tool_call_constraint(tools, choice))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        checked = 0
        for seed in range(3):
            matcher, generator, bitmask = grammar.new_matcher(), torch.Generator().manual_seed(seed), backend.allocate_bitmask(1)
            tokens: list[int] = []
            for _ in range(300):
                backend.fill_bitmask([matcher], bitmask)
                logits = torch.randn(1, backend.tokenizer.vocab_size, generator=generator)
                apply_token_bitmask_(logits, bitmask)
                token = int(logits.argmax())
                assert matcher.accept_token(token), matcher.error
                if token in (0, 2) or matcher.is_finished():
                    break
                tokens.append(token)
            else:
                continue  # random arguments can run long; only finished outputs are checked
            checked += 1
            content, calls = parse_tool_calls(smollm_tokenizer.decode(tokens))
            assert content is None and calls
            assert all(tool_call_problem(c, tools) is None for c in calls)
            if isinstance(choice, NamedToolChoice):
                assert [c.name for c in calls] == ["get_weather"]
        assert checked, "no output finished within the step bound"
    finally:
        torch.set_num_threads(threads)
