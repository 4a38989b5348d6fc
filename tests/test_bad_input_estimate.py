"""Hostile or invalid request bodies: a clear Invalid (400) naming the parameter, never a crash (a 5xx)."""

import time
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ext_proc.config import Estimation, Limits
from ext_proc.estimate import IMAGE_PART_TOKENS, MAX_JSON_DEPTH, Estimator, nesting_exceeds, route_of
from ext_proc.reasons import Invalid
from tests.helpers import json_depth

E = Estimator(Estimation(chars_per_token=4.0, per_message_tokens=4))
CHAT = "/v1/chat/completions"
USER = {"role": "user", "content": "hello"}


def est(doc: Any, path: str = CHAT, default: int = 100, estimator: Estimator = E) -> Any:
    return estimator.estimate(orjson.dumps(doc), path=path, default_max_tokens=default)


def invalid(doc: Any, path: str = CHAT, estimator: Estimator = E) -> Invalid:
    with pytest.raises(Invalid) as e:
        est(doc, path, estimator=estimator)
    assert e.value.rejection().status in (400, 401)
    return e.value


# -- nesting -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/v1/responses", "/v1/embeddings", "/other"])
def test_600_levels_of_nesting_is_invalid_body_not_recursion_error(path: str) -> None:
    deep = b"[" * 600 + b"]" * 600
    bodies = [b'{"messages": [{"role": "user", "content": "x", "name": ' + deep + b"}]}",
              b'{"prompt": ' + deep + b"}", b'{"input": ' + deep + b"}", b'{"tools": ' + deep + b"}"]
    for body in bodies:
        started = time.perf_counter()
        with pytest.raises(Invalid) as e:
            E.estimate(body, path=path, default_max_tokens=10)
        assert e.value.name == "invalid-body" and "nested" in e.value.message
        assert time.perf_counter() - started < 0.5


def test_nesting_beyond_what_orjson_parses_is_invalid_body_too() -> None:
    deep = b"[" * 5000 + b"]" * 5000
    with pytest.raises(Invalid, match="nested"):
        E.estimate(b'{"messages": ' + deep + b"}", path=CHAT, default_max_tokens=10)


def test_nesting_up_to_the_limit_is_fine() -> None:
    value: Any = "abcd"
    for _ in range(MAX_JSON_DEPTH - 4):  # doc > tools > [list] > ... nested lists
        value = [value]
    assert est({"messages": [USER], "tools": [value]}).prompt_tokens == 4 + 2 + 1
    with pytest.raises(Invalid):
        est({"messages": [USER], "tools": [[[[value]]]]})




# strings made of what could fool a count from the bytes: brackets, quotes, backslashes and escape letters
_TRICKY = st.text(alphabet='[]{}"\\nbu/ ,:', max_size=8)
_JSON = st.recursive(st.none() | st.integers(-1000, 1000) | _TRICKY,
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(_TRICKY, kids, max_size=4),
                     max_leaves=40)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=_JSON, limit=st.integers(0, 8), pad=st.booleans())
def test_nesting_from_the_bytes_is_the_documents_own(doc: Any, limit: int, pad: bool) -> None:
    """The byte-level depth is exact: brackets in strings (escaped quotes and backslashes around them)
    are not counted, so it neither refuses a legit body nor lets one through that orjson.dumps
    (beyond 255 levels) or the walks would choke on."""
    body = orjson.dumps(doc)
    if pad:  # indentation and brackets inside a string before the rest
        body = b'[ "]]]]{{\\\\", \n ' + orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"]"
        doc = ["]]]]{{\\", doc]
    assert nesting_exceeds(body, limit) == (json_depth(doc) > limit)


def test_brackets_inside_strings_neither_hide_nor_fakejson_depth() -> None:
    deep = b"[" * (MAX_JSON_DEPTH - 2) + b"]" * (MAX_JSON_DEPTH - 2)  # with the object and the tools list: 64
    closers = b'"' + b"]}" * 300 + b'\\"\\\\"'  # a string of closing brackets and escapes before the nest
    body = b'{"tools": [' + closers + b", [" + deep + b"]]}"  # 65 levels
    with pytest.raises(Invalid, match="nested"):
        E.estimate(body, path=CHAT, default_max_tokens=10)
    openers = b'"' + b"[{" * 300 + b'\\""'
    assert E.estimate(b'{"messages": [], "tools": [' + openers + b", " + deep + b"]}", path=CHAT,
                      default_max_tokens=10).parsed


# -- chat messages -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("doc", "param"), [
    ({}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": {"role": "user"}}, "messages"),
    ({"messages": [USER, "hello"]}, "messages[1]"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": 7, "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 42}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": {"type": "text", "text": "hi"}}]}, "messages[0].content"),
    ({"messages": [USER, {"role": "user", "content": ["hi"]}]}, "messages[1].content[0]"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": 3, "text": "x"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": True}]}, "messages[0].content"),
])
def test_chat_content_must_have_the_openai_shape(doc: dict[str, Any], param: str) -> None:
    e = invalid(doc)
    assert (e.name, e.param) == ("invalid-body", param)


def test_chat_content_shapes_that_are_fine() -> None:
    e = est({"messages": [
        {"role": "system", "content": "abcd"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                               "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "abcdabcd"}]},
        {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "A" * 9999}}]},
    ]})
    assert e.parsed and e.prompt_tokens == (4 + 1) + (4 + 3) + (4 + 1 + 2) + (4 + IMAGE_PART_TOKENS)


# -- n, best_of, max_tokens ----------------------------------------------------------------------------

BAD_VALUES = [1e4, -1, "10", True, 0, 1_000_000, 2.0, [1], {"n": 1}]


@pytest.mark.parametrize("value", BAD_VALUES)
@pytest.mark.parametrize("name", ["n", "best_of"])
def test_bad_n_and_best_of_are_invalid_parameter(name: str, value: Any) -> None:
    e = invalid({"prompt": "x", name: value}, "/v1/completions")
    assert (e.name, e.param) == ("invalid-parameter", name)


def test_n_is_capped_by_limits_max_n() -> None:
    assert est({"messages": [USER], "n": 16, "max_tokens": 2}).output_tokens == 32
    assert invalid({"messages": [USER], "n": 17}).param == "n"
    small = Estimator(Estimation(), Limits(max_n=2))
    assert invalid({"messages": [USER], "n": 3}, estimator=small).param == "n"
    assert est({"messages": [USER], "n": None, "max_tokens": 5}).output_tokens == 5


@pytest.mark.parametrize("value", BAD_VALUES)
@pytest.mark.parametrize(("name", "path"), [("max_tokens", CHAT), ("max_completion_tokens", CHAT),
                                            ("max_tokens", "/v1/completions"),
                                            ("max_output_tokens", "/v1/responses")])
def test_bad_output_caps_are_invalid_parameter_never_a_silent_default(name: str, path: str, value: Any) -> None:
    if value == 1_000_000:
        value = 1 << 60  # a big but well-formed integer is fine unless limits.max_output_tokens says so
        assert est({"messages": [USER], "input": "x", name: value}, path).output_tokens == value
        return
    e = invalid({"messages": [USER], "prompt": "x", "input": "x", name: value}, path)
    assert (e.name, e.param) == ("invalid-parameter", name)


def test_max_output_tokens_limit() -> None:
    capped = Estimator(Estimation(), Limits(max_output_tokens=1000))
    assert est({"messages": [USER], "max_tokens": 1000}, estimator=capped).output_tokens == 1000
    e = invalid({"messages": [USER], "max_tokens": 1001}, estimator=capped)
    assert (e.name, e.param) == ("invalid-parameter", "max_tokens")
    e = invalid({"input": "x", "max_output_tokens": 5000}, "/v1/responses", estimator=capped)
    assert e.param == "max_output_tokens"
    # the default reservation never exceeds the cap (the client did nothing wrong)
    assert est({"messages": [USER]}, default=4096, estimator=capped).output_tokens == 1000


# -- stream_options --------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["yes", True, 1, ["include_usage"]])
def test_stream_options_must_be_an_object(value: Any) -> None:
    e = invalid({"messages": [USER], "stream": True, "stream_options": value})
    assert (e.name, e.param) == ("invalid-parameter", "stream_options")


def test_stream_must_be_a_boolean() -> None:
    assert invalid({"messages": [USER], "stream": "yes"}).param == "stream"


def test_continuous_usage_stats_is_recorded() -> None:
    e = est({"messages": [USER], "stream": True,
             "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert e.stream and e.include_usage and e.continuous_usage


# -- Responses API and embeddings ---------------------------------------------------------------------

def test_responses_api_estimate() -> None:
    e = est({"model": "m", "instructions": "abcdabcd", "input": "abcdabcdabcd", "max_output_tokens": 50,
             "stream": True}, "/v1/responses")
    assert e.parsed and e.route == "responses"
    assert (e.prompt_tokens, e.output_tokens, e.stream) == (2 + 3, 50, True)
    assert e.include_usage  # response.completed always carries usage: nothing to inject
    e = est({"input": [
        {"role": "user", "content": "abcd"},
        {"role": "user", "content": [{"type": "input_text", "text": "abcdabcd"},
                                     {"type": "input_image", "image_url": "data:image/png;base64," + "A" * 5000}]},
        {"type": "function_call_output", "call_id": "c", "output": "abcd"},
    ]}, "/v1/responses", default=77)
    assert e.prompt_tokens == (4 + 1) + (4 + 2 + IMAGE_PART_TOKENS) + (4 + 1 + 1)
    assert e.output_tokens == 77
    assert not est({"input": "x"}, "/v1/responses").stream


@pytest.mark.parametrize(("doc", "param"), [
    ({"input": 42}, "input"),
    ({"input": ["abcd"]}, "input[0]"),
    ({"input": [{"role": "user", "content": 7}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": ["x"]}]}, "input[0].content[0]"),
    ({"input": "x", "instructions": ["a"]}, "instructions"),
])
def test_responses_api_shapes(doc: dict[str, Any], param: str) -> None:
    e = invalid(doc, "/v1/responses")
    assert (e.name, e.param) == ("invalid-body", param)


def test_embeddings_estimate() -> None:
    path = "/v1/embeddings"
    assert (est({"input": "abcdabcd"}, path).prompt_tokens, est({"input": "abcdabcd"}, path).output_tokens) == (2, 0)
    assert est({"input": ["abcd", "abcdabcd"]}, path).prompt_tokens == 3
    assert est({"input": [1, 2, 3]}, path).prompt_tokens == 3
    assert est({"input": [[1, 2], [3, 4, 5]]}, path).prompt_tokens == 5
    assert est({"input": "x", "max_tokens": "ignored", "n": 99}, path).output_tokens == 0
    assert est({"input": "x"}, path + "?api-version=1").route == "embeddings"
    for bad in ({"input": 3}, {"input": [1, "a"]}, {"input": [[1], "a"]}, {"input": [True]}, {"input": {"a": 1}},
                {"model": "m"}):
        e = invalid(bad, path)
        assert (e.name, e.param) == ("invalid-body", "input")


def test_routes_strip_the_query_string() -> None:
    assert route_of("/v1/chat/completions?x=1") == "chat"
    assert route_of("/v1/completions/") == "completions"
    assert route_of("/v1/models") is None


# -- the model's context -------------------------------------------------------------------------------

def test_model_context_tokens() -> None:
    ctx = Estimator(Estimation(per_message_tokens=0), Limits(model_context_tokens=100))
    assert est({"messages": [{"role": "user", "content": "x" * 200}], "max_tokens": 50}, estimator=ctx).total == 100
    e = invalid({"messages": [{"role": "user", "content": "x" * 200}], "max_tokens": 51}, estimator=ctx)
    assert (e.name, e.param) == ("context-too-long", "max_tokens")
    e = invalid({"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 1}, estimator=ctx)
    assert (e.name, e.param) == ("context-too-long", "messages")
    e = invalid({"prompt": "x" * 400}, "/v1/completions", estimator=ctx)
    assert (e.name, e.param) == ("context-too-long", "prompt")
    e = invalid({"input": "x" * 300, "max_output_tokens": 30}, "/v1/responses", estimator=ctx)
    assert (e.name, e.param) == ("context-too-long", "max_output_tokens")
    e = invalid({"input": "x" * 404}, "/v1/embeddings", estimator=ctx)
    assert (e.name, e.param) == ("context-too-long", "input")
    e = invalid({"messages": [USER], "max_completion_tokens": 101}, estimator=ctx)
    assert e.param == "max_completion_tokens"
    # no max_tokens: the default reservation shrinks to what fits instead of refusing a valid request
    assert est({"prompt": "x" * 360}, "/v1/completions", default=256, estimator=ctx).output_tokens == 10
    with pytest.raises(Invalid):  # not JSON: refused, never passed on unchecked
        E.estimate(b"x" * 4000, path=CHAT, default_max_tokens=10)


# -- anything at all -------------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats(allow_nan=False,
                                                                                 allow_infinity=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(
        st.sampled_from(["messages", "role", "content", "type", "text", "prompt", "input", "n", "best_of",
                         "max_tokens", "max_completion_tokens", "max_output_tokens", "stream", "stream_options",
                         "include_usage", "instructions", "tools", "image_url", "x"]) | st.text(max_size=5),
        children, max_size=6),
    max_leaves=40,
)
ROOT = st.fixed_dictionaries({}, optional={
    "messages": JSON | st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"])},
                                                      optional={"content": JSON}), max_size=4),
    "prompt": JSON, "input": JSON, "n": JSON, "best_of": JSON, "max_tokens": JSON, "max_output_tokens": JSON,
    "stream": JSON, "stream_options": JSON, "instructions": JSON, "tools": JSON,
}) | JSON
PATHS = st.sampled_from([CHAT, "/v1/completions", "/v1/responses", "/v1/embeddings", "/v1/other", "/"])
CHECKED = Estimator(Estimation(), Limits(max_output_tokens=4096, model_context_tokens=8192))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=ROOT, path=PATHS, estimator=st.sampled_from([E, CHECKED]))
def test_estimator_never_raises_anything_but_invalid(doc: Any, path: str, estimator: Estimator) -> None:
    try:
        body = orjson.dumps(doc)
    except orjson.JSONEncodeError:  # an integer beyond 64 bits: send it as text
        body = repr(doc).encode()
    try:
        e = estimator.estimate(body, path=path, default_max_tokens=256)
    except Invalid as exc:
        assert exc.rejection().status in (400, 401)
        return
    for value in (e.prompt_tokens, e.output_tokens, e.total):
        assert isinstance(value, int) and not isinstance(value, bool) and value >= 0


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=200), path=PATHS)
def test_estimator_never_raises_anything_but_invalid_on_raw_bytes(body: bytes, path: str) -> None:
    try:
        e = E.estimate(body, path=path, default_max_tokens=16)
    except Invalid:
        return
    assert e.prompt_tokens >= 0 and e.output_tokens >= 0
