"""Tool calling (treedraft.tools): the answer schema and what it accepts, the rendered messages, the answer's
message, and the real model calling a tool with speculative output = plain."""

from __future__ import annotations

import json

import pytest

from treedraft.grammar import DONE, JsonGrammar, run
from treedraft.interfaces import GenerationError
from treedraft.tools import RESPONSE_KEY, answer_message, answer_schema, parse_tools, render_messages, tool_mode

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
            "required": ["city"],
            "additionalProperties": False,
            "$defs": {"unit": {"enum": ["C", "F"]}},  # a reference inside a tool's parameters
        },
    },
}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}  # fmt: skip
NOARGS = {"type": "function", "function": {"name": "now"}}


def accepts(sch: dict, text: bytes) -> bool:
    g = JsonGrammar([bytes([b]) for b in range(256)], [256], 257).with_schema(sch)
    end = run(g.start(), text, g.nodes)
    return end is not None and end[0] == DONE


@pytest.mark.parametrize(
    "choice,text,ok",
    [
        ("required", b'{"get_weather": {"city": "Paris", "unit": "C"}}', True),
        ("required", b'{"get_weather": {"unit": "C"}}', False),  # city is required
        ("required", b'{"get_weather": {"city": "Paris", "unit": "K"}}', False),  # the $ref'd enum
        ("required", b'{"add": {"a": 1, "b": 2}}', True),
        ("required", b'{"add": {"a": 1, "b": 2.5}}', False),
        ("required", b'{"now": {}}', True),
        ("required", b"{}", False),  # exactly one call
        ("required", b'{"add": {"a": 1, "b": 2}, "now": {}}', False),
        ("required", b'{"response": "hi"}', False),  # only "auto" may answer in text
        ("required", b'{"sub": {}}', False),  # no such tool
        ("auto", b'{"response": "hi"}', True),
        ("auto", b'{"now": {}}', True),
        ("auto", b'{"response": "hi", "now": {}}', False),
        ({"type": "function", "function": {"name": "add"}}, b'{"add": {"a": 1, "b": 2}}', True),
        ({"type": "function", "function": {"name": "add"}}, b'{"now": {}}', False),  # only the named tool
    ],
)
def test_answer_schema_accepts_exactly_one_valid_call(choice, text: bytes, ok: bool) -> None:
    tools = parse_tools([WEATHER, ADD, NOARGS])
    assert accepts(answer_schema(tools, tool_mode(choice, tools)), text) == ok


@pytest.mark.parametrize(
    "tools,choice,match",
    [
        ([], "required", "non-empty"),
        ([{"type": "function", "function": {"name": "a b"}}], None, "letters"),
        ([NOARGS, NOARGS], None, "second tool"),
        ([{"type": "retrieval"}], None, "must be"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None, "type object"),
        ([NOARGS], {"type": "function", "function": {"name": "later"}}, "not in tools"),
        ([NOARGS], "sometimes", "tool_choice must be"),
        ([{"type": "function", "function": {"name": RESPONSE_KEY}}], "auto", "clashes"),
    ],
)
def test_bad_tools_are_refused_with_the_reason(tools: list, choice, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parsed = parse_tools(tools)
        answer_schema(parsed, tool_mode(choice, parsed) or "auto")


def test_modes() -> None:
    tools = parse_tools([NOARGS])
    assert tool_mode(None, tools) == "auto" and tool_mode("none", tools) is None and tool_mode(None, []) is None
    assert tool_mode("required", tools) == "required" and tool_mode(NOARGS, tools) == "fn:now"
    named_auto = {"type": "function", "function": {"name": "auto"}}  # a tool named like a mode is still forced
    tools = parse_tools([named_auto, ADD])
    sch = answer_schema(tools, tool_mode(named_auto, tools))
    assert accepts(sch, b'{"auto": {}}') and not accepts(sch, b'{"add": {"a": 1, "b": 2}}')
    assert not accepts(sch, b'{"response": "x"}')


def test_rendered_messages_describe_tools_and_replay_calls() -> None:
    """The tools' description joins the system message (or comes first); an earlier call is the JSON the model
    writes; a tool result is a user turn naming its tool and call."""
    tools = parse_tools([WEATHER, ADD])
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 C, sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "no such call"},
    ]  # fmt: skip
    out = render_messages(msgs, tools, "auto")
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]  # the results: one user turn
    assert (
        out[0]["content"].startswith("Be brief.\n\n") and "- get_weather: The weather in a city." in out[0]["content"]
    )
    assert "- add: Arguments:" in out[0]["content"] and '{"response": "<your answer>"}' in out[0]["content"]
    assert json.loads(out[2]["content"]) == {"get_weather": {"city": "Paris"}}
    assert out[3]["content"] == "Result of get_weather (call c1): 21 C, sunny\nTool result (call c2): no such call"
    named = render_messages(msgs[1:2], tools, "fn:add")
    assert (
        named[0]["role"] == "system"
        and "get_weather" not in named[0]["content"]
        and "calling add" in named[0]["content"]
    )
    assert render_messages(msgs[1:2], tools, None) == msgs[1:2]  # tool_choice none: no description


def test_answer_message() -> None:
    msg, finish = answer_message('{"add": {"a": 1, "b": 2}}', "stop", "required")
    assert finish == "tool_calls" and msg["content"] is None
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 1, "b": 2}
    assert answer_message('{"response": "hi \\"x\\""}', "stop", "auto") == (
        {"role": "assistant", "content": 'hi "x"'},
        "stop",
    )
    whole, finish = answer_message('{"add": {"a": 1, "b": 2}}', "length", "auto")  # the budget ended at the "}"
    assert finish == "tool_calls" and whole["tool_calls"][0]["function"]["name"] == "add"
    # cut by the budget (finish "length"): the call so far, never the JSON wrapper as text (as OpenAI cuts a call)
    for mode in ("auto", "required", "fn:add"):
        cut, finish = answer_message('{"add": {"a": 1', "length", mode)
        assert finish == "length" and cut["content"] is None, mode
        assert cut["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1'}
    esc, _ = answer_message('{ "a\\"b" :', "length", "required")  # an escaped name, the colon just written
    assert esc["tool_calls"][0]["function"] == {"name": 'a"b', "arguments": ""}
    spaced, _ = answer_message('{"add"   \n ', "length", "required")  # the name settled, its colon not yet written
    assert spaced["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    for before in ('{\n  "get_wea', "{", "", '{"response": ', '{"response"', '{"resp'):  # no tool named yet
        assert answer_message(before, "length", "auto") == ({"role": "assistant", "content": ""}, "length"), before
        if "response" not in before:  # (in "required" mode a tool may be named "response")
            assert answer_message(before, "length", "required")[0] == {"role": "assistant", "content": ""}, before
    named, _ = answer_message('{"ad', "length", "fn:add")  # a named call's tool is known from the start
    assert named["tool_calls"][0]["function"] == {"name": "add", "arguments": ""} and named["content"] is None


@pytest.mark.slow
def test_real_model_calls_a_tool(smollm_int4) -> None:
    """SmolLM2 with the weather tool: the forced call names it with valid arguments, and the default drafter's
    answer = plain."""
    llm = smollm_int4
    tools = parse_tools([WEATHER, ADD])
    msgs = render_messages([{"role": "user", "content": "What is the weather in Paris?"}], tools, "required")
    fmt = {"type": "json_schema", "json_schema": {"schema": answer_schema(tools, "required")}}
    plain = llm.generate(msgs, drafter=None, max_new_tokens=64, response_format=fmt)
    spec = llm.generate(msgs, drafter="default", max_new_tokens=64, response_format=fmt)
    assert spec.token_ids == plain.token_ids and plain.finish_reason == "stop", plain.text
    msg, finish = answer_message(plain.text, "stop", "required")
    assert finish == "tool_calls" and msg["tool_calls"][0]["function"]["name"] in ("get_weather", "add")
    api = llm.generate("What is the weather in Paris?", max_new_tokens=64, tools=[WEATHER, ADD], tool_choice="required")
    assert api.token_ids == plain.token_ids and api.finish_reason == "tool_calls" and api.text == ""
    assert api.tool_calls[0]["function"] == msg["tool_calls"][0]["function"]
    with pytest.raises(GenerationError, match="not in tools"):
        llm.generate("Hi", max_new_tokens=4, tools=[ADD], tool_choice={"type": "function", "function": {"name": "x"}})
    with pytest.raises(GenerationError, match="'uri-reference'"):
        bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "d": {"type": "string", "format": "uri-reference"}}}}}  # fmt: skip
        llm.generate("Hi", max_new_tokens=4, tools=[bad], tool_choice="required")
    free = llm.generate("Hi", max_new_tokens=4, tools=[ADD], tool_choice="none")
    assert free.tool_calls is None and free.token_ids == llm.generate("Hi", max_new_tokens=4).token_ids


def test_response_text_streams_the_decoded_string_whatever_the_chunks() -> None:
    """ResponseText on an "auto" answer cut into random chunks (escapes, \\u escapes, surrogate pairs, whitespace):
    the pieces it returns join to the response's value; a tool call's answer returns nothing; an answer cut by the
    budget gives the value's text so far (nothing before the value starts)."""
    import random

    from treedraft.tools import ResponseText

    rng = random.Random(3)
    for _ in range(200):
        value = "".join(rng.choice(["a", " ", '"', "\\", "\n", "\u00e9", "\U0001f600", "\x01", "/"]) for _ in range(12))
        text = json.dumps({"response": value}, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        r, got, i = ResponseText(), [], 0
        while i < len(text):
            j = i + rng.randint(1, 4)
            got.append(r.feed(text[i:j]))
            i = j
        assert r.mode == "response" and r.closed and "".join(got) == value, (text, got)
        cut = rng.randrange(len(text))
        msg, finish = answer_message(text[:cut], "length", "auto")
        started = ResponseText()
        started.feed(text[:cut])
        if started.mode == "response":  # the value's characters so far
            assert finish == "length" and value.startswith(msg["content"])
        else:  # cut before the value: nothing of the wrapper
            assert msg == {"role": "assistant", "content": ""}, text[:cut]
    call = ResponseText()
    assert call.feed('{"get_weather": {"city": "') == "" and call.mode == "call"


def test_answer_format_refuses_what_cannot_go_with_tools() -> None:
    """A response_format of its own or stop strings (one could cut the call) are refused, naming the parameter;
    otherwise the answer's JSON Schema format (the server and LLM.generate share this)."""
    from treedraft.tools import ToolRequestError, answer_format

    tools = parse_tools([ADD])
    with pytest.raises(ToolRequestError, match="stop cannot") as e:
        answer_format(tools, "required", stop=["}"])
    assert e.value.param == "stop"
    with pytest.raises(ToolRequestError, match="response_format cannot") as e:
        answer_format(tools, "required", response_format={"type": "json_object"})
    assert e.value.param == "response_format"
    fmt = answer_format(tools, "required")
    assert fmt == {"type": "json_schema", "json_schema": {"schema": answer_schema(tools, "required")}}


def test_a_tool_without_a_parameters_type_takes_an_object_and_its_arguments_are_the_models_own_json() -> None:
    """A review (session 44): parameters {} let the grammar write {"f": 5} (arguments 5; OpenAI's are an object), and
    the arguments were json.dumps of the parsed value: 1e400 came back as Infinity (not JSON), long numbers lost
    digits, repeated keys merged."""
    for params in ({}, {"description": "no args"}):
        sch = answer_schema(
            parse_tools([{"type": "function", "function": {"name": "f", "parameters": params}}]), "required"
        )
        assert not accepts(sch, b'{"f":5}') and not accepts(sch, b'{"f":null}') and accepts(sch, b'{"f":{}}')
    for args in ('{"x":1e400}', '{"x":12345678901234567890.123456789}', '{"x": 1, "d": {"k": 1, "k": 2}}'):
        msg, _ = answer_message('{"f": ' + args + "}", "stop", "required")
        assert msg["tool_calls"][0]["function"]["arguments"] == args
