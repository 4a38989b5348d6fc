"""envoy/kvgate.lua, run in LuaJIT (the lupa wheel) against a fake Envoy stream handle.

The helper is rendered as Envoy gets it (``lua_source``); the fake handle offers what it uses:
headers() (get/replace/remove, pairs), streamInfo():dynamicMetadata() (get/set), body(),
bodyChunks() (chunks with length/getBytes/setBytes) and respond().
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from ext_proc.reasons import REASONS
from kvgate.envoy_config import lua_source

lupa = pytest.importorskip("lupa")

HARNESS = r"""
local function header_map(t)
  local methods = {
    get = function(self, k) return rawget(self, k) end,
    replace = function(self, k, v) rawset(self, k, v) end,
    remove = function(self, k) rawset(self, k, nil) end,
  }
  return setmetatable(t, {__index = methods})
end

function make_handle(headers, md, body, chunks)
  local h = {out = {}, responded = nil}
  local hm = header_map(headers)
  local dm = {
    get = function(self, ns) return md[ns] end,
    set = function(self, ns, k, v) md[ns] = md[ns] or {}; md[ns][k] = v end,
  }
  local si = {dynamicMetadata = function(self) return dm end}
  function h:headers() return hm end
  function h:streamInfo() return si end
  function h:body()
    if body == nil then return nil end
    return {
      length = function(self) return #body end,
      getBytes = function(self, from, n) return string.sub(body, from + 1, from + n) end,
    }
  end
  function h:bodyChunks()
    local i = 0
    return function()
      i = i + 1
      if chunks[i] == nil then return nil end
      local data = chunks[i]
      local idx = i
      h.out[idx] = data
      return {
        length = function(self) return #data end,
        getBytes = function(self, from, n) return string.sub(data, from + 1, from + n) end,
        setBytes = function(self, s) h.out[idx] = s end,
      }
    end
  end
  function h:respond(hdrs, b) h.responded = {headers = hdrs, body = b} end
  function h:clearRouteCache() h.route_cleared = true end
  return h
end
"""


@dataclass
class Run:
    out: list[str] = field(default_factory=list)
    usage: dict[str, int] | None = None
    respond: tuple[dict[str, str], str] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    route_cleared: bool = False
    metadata: dict[str, dict[str, Any]] = field(default_factory=dict)


def lua(fail_open: bool = False) -> Any:
    rt = lupa.LuaRuntime(unpack_returned_tuples=True)
    rt.execute(HARNESS)
    rt.execute(lua_source(fail_open))
    return rt


def _table(rt: Any, d: dict[str, Any] | None) -> Any:
    if d is None:
        return None
    return rt.table_from({k: (_table(rt, v) if isinstance(v, dict) else v) for k, v in d.items()})


def on_response(chunks: list[str] | None = None, body: str | None = None, strip: bool = False,
                sse: bool = True, ticket: bool = True) -> Run:
    rt = lua()
    md: dict[str, Any] = {"kvgate": {"ticket": "t1", "strip_usage": strip}} if ticket else {}
    mdt = rt.table_from({k: _table(rt, v) for k, v in md.items()})
    headers = rt.table_from({"content-type": "text/event-stream" if sse else "application/json"})
    h = rt.globals().make_handle(headers, mdt, body, rt.table_from(chunks or []))
    rt.globals().envoy_on_response(h)
    out = [h.out[i + 1] for i in range(len(chunks or []))]
    u = mdt["kvgate.usage"]
    return Run(out=out, usage=None if u is None else dict(u.items()))


def on_request(headers: dict[str, str], md: dict[str, Any] | None, fail_open: bool = False) -> Run:
    rt = lua(fail_open)
    mdt = rt.table_from({} if md is None else {"kvgate": _table(rt, md)})
    ht = rt.table_from(headers)
    h = rt.globals().make_handle(ht, mdt, None, rt.table_from([]))
    rt.globals().envoy_on_request(h)
    resp = None
    if h.responded is not None:
        resp = (dict(h.responded.headers.items()), h.responded.body)
    md = {ns: dict(t.items()) for ns, t in mdt.items()}
    return Run(respond=resp, headers=dict(ht.items()), route_cleared=bool(h.route_cleared), metadata=md)


def ev(obj: dict[str, Any], sep: str = "\n\n") -> str:
    return "data: " + json.dumps(obj) + sep


USAGE = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}
CONTENT = ev({"choices": [{"delta": {"content": "hi"}}]})
FINAL = ev({"choices": [], "usage": USAGE})
DONE = "data: [DONE]\n\n"


def test_usage_chunk_is_recorded_and_stripped_when_kvgate_asked_for_it() -> None:
    r = on_response([CONTENT, FINAL + DONE], strip=True)
    assert r.usage == {"prompt_tokens": 11, "completion_tokens": 7}
    assert r.out == [CONTENT, DONE]


def test_usage_chunk_is_kept_when_the_client_asked_for_it() -> None:
    r = on_response([CONTENT, FINAL + DONE], strip=False)
    assert r.usage == {"prompt_tokens": 11, "completion_tokens": 7}
    assert r.out == [CONTENT, FINAL + DONE]


@pytest.mark.parametrize("cut", [1, 10, 25, len(FINAL) - 2, len(FINAL) - 1])
def test_a_usage_event_split_across_chunks(cut: int) -> None:
    stream = CONTENT + FINAL + DONE
    at = len(CONTENT) + cut
    r = on_response([stream[:at], stream[at:]], strip=True)
    assert r.usage == {"prompt_tokens": 11, "completion_tokens": 7}
    assert "".join(r.out) == CONTENT + DONE
    r = on_response([stream[:at], stream[at:]], strip=False)
    assert "".join(r.out) == stream


def test_every_chunk_boundary_gives_the_same_stream() -> None:
    stream = CONTENT + CONTENT + FINAL + DONE
    for at in range(1, len(stream)):
        r = on_response([stream[:at], stream[at:]], strip=True)
        assert r.usage == {"prompt_tokens": 11, "completion_tokens": 7}, at
        assert "".join(r.out) == CONTENT + CONTENT + DONE, at


def test_an_unterminated_last_event_is_flushed_by_the_empty_end_of_stream_chunk() -> None:
    r = on_response([CONTENT, "data: [DO", "NE]", ""], strip=True)
    assert "".join(r.out) == CONTENT + "data: [DONE]"


def test_crlf_separated_events_pass_unchanged_and_are_parsed() -> None:
    content, final, done = (ev({"choices": [{"delta": {"content": "x"}}]}, "\r\n\r\n"),
                            ev({"choices": [], "usage": USAGE}, "\r\n\r\n"), "data: [DONE]\r\n\r\n")
    r = on_response([content + final, done], strip=False)
    assert r.out == [content + final, done]
    assert r.usage == {"prompt_tokens": 11, "completion_tokens": 7}
    r = on_response([content, final[:20], final[20:] + done], strip=True)
    assert "".join(r.out) == content + done and r.usage == {"prompt_tokens": 11, "completion_tokens": 7}


def test_continuous_usage_stats_keeps_the_content_and_records_the_last_usage() -> None:
    chunks = [ev({"choices": [{"delta": {"content": f"t{i}"}}],
                  "usage": {"prompt_tokens": 11, "completion_tokens": i, "total_tokens": 11 + i}}) for i in (1, 2, 3)]
    r = on_response([*chunks, FINAL + DONE], strip=True)
    assert r.out == [*chunks, DONE]  # only the usage-only chunk kvgate asked for goes
    assert r.usage == {"prompt_tokens": 11, "completion_tokens": 7}
    r = on_response(chunks, strip=True)  # (no final chunk: the last usage seen)
    assert r.out == chunks and r.usage == {"prompt_tokens": 11, "completion_tokens": 3}


def test_embeddings_usage_has_no_completion_tokens() -> None:
    body = json.dumps({"object": "list", "data": [{"embedding": [0.1] * 3000}],
                       "usage": {"prompt_tokens": 9, "total_tokens": 9}})
    assert on_response(body=body, sse=False).usage == {"prompt_tokens": 9, "completion_tokens": 0}


def test_responses_api_json_usage() -> None:
    body = json.dumps({"object": "response", "output": [{"type": "message"}],
                       "usage": {"input_tokens": 21, "input_tokens_details": {"cached_tokens": 0},
                                 "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0},
                                 "total_tokens": 26}})
    assert on_response(body=body, sse=False).usage == {"prompt_tokens": 21, "completion_tokens": 5,
                                                       "cached_tokens": 0, "reasoning_tokens": 0}


def test_cached_and_reasoning_tokens_are_carried_for_spend_budgets() -> None:
    usage = {"prompt_tokens": 300, "completion_tokens": 40, "total_tokens": 340,
             "prompt_tokens_details": {"cached_tokens": 256}, "completion_tokens_details": {"reasoning_tokens": 30}}
    r = on_response([CONTENT, ev({"choices": [], "usage": usage}) + DONE], strip=True)
    assert r.usage == {"prompt_tokens": 300, "completion_tokens": 40, "cached_tokens": 256, "reasoning_tokens": 30}


def test_the_remaining_budget_kvgate_attached_goes_on_the_response() -> None:
    rt = lua()
    md = {"kvgate": _table(rt, {"ticket": "t1", "budget_remaining": "monthly=12.5"})}
    headers = rt.table_from({"content-type": "application/json"})
    h = rt.globals().make_handle(headers, rt.table_from(md), "{}", rt.table_from([]))
    rt.globals().envoy_on_response(h)
    assert headers["x-kvgate-budget-remaining"] == "monthly=12.5"
    assert on_response(body="{}", sse=False).usage is None  # no budget: no header, nothing recorded


def test_responses_api_stream_usage() -> None:
    created = 'event: response.created\ndata: {"type":"response.created","response":{"usage":null}}\n\n'
    delta = 'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"hi"}\n\n'
    done = ('event: response.completed\ndata: {"type":"response.completed","response":{"output":[],'
            '"usage":{"input_tokens":21,"output_tokens":5,"total_tokens":26}}}\n\n')
    r = on_response([created, delta, done[:40], done[40:]], strip=False)
    assert "".join(r.out) == created + delta + done
    assert r.usage == {"prompt_tokens": 21, "completion_tokens": 5}


def test_chat_json_usage_and_no_ticket_no_work() -> None:
    body = json.dumps({"choices": [{"message": {"content": "x"}}], "usage": USAGE})
    assert on_response(body=body, sse=False).usage == {"prompt_tokens": 11, "completion_tokens": 7}
    assert on_response(body=body, sse=False, ticket=False).usage is None


def test_json_usage_before_a_large_trailing_field_is_found() -> None:
    """vLLM puts prompt_logprobs (and kv_transfer_params) after usage: the last 8 KiB held no usage and
    the whole reservation was charged instead of the real usage."""
    body = json.dumps({"choices": [{"message": {"content": "x"}}], "usage": USAGE,
                       "prompt_logprobs": [{"1": {"logprob": -0.5, "rank": 1, "decoded_token": "a"}}] * 1000})
    assert len(body) > 3 * 8192
    assert on_response(body=body, sse=False).usage == {"prompt_tokens": 11, "completion_tokens": 7}


def test_a_request_kvgate_never_saw_gets_the_missing_body_400() -> None:
    r = on_request({":method": "POST", ":path": "/v1/chat/completions"}, None)
    assert r.respond is not None
    headers, body = r.respond
    missing = REASONS["missing-body"]
    assert headers[":status"] == str(missing.status) and headers["x-kvgate-reject-reason"] == "missing-body"
    err = json.loads(body)["error"]
    assert (err["code"], err["type"], err["message"]) == (missing.code, missing.type, missing.message)
    assert on_request({":method": "POST"}, None, fail_open=True).respond is None


def test_client_kvgate_headers_and_destination_are_dropped() -> None:
    r = on_request({":path": "/v1/chat/completions", "x-kvgate-ticket": "forged", "x-kvgate-reject-reason": "x",
                    "x-gateway-destination-endpoint": "10.0.0.1:22", "x-other": "kept"}, {"ticket": "t1"})
    assert r.respond is None
    assert r.headers == {":path": "/v1/chat/completions", "x-other": "kept"}


def test_kvgates_endpoint_becomes_the_destination_header() -> None:
    r = on_request({"x-gateway-destination-endpoint": "10.0.0.1:22"}, {"ticket": "t1", "endpoint": "[::1]:8000"})
    assert r.headers["x-gateway-destination-endpoint"] == "[::1]:8000"


def test_a_response_that_is_not_streamed_moves_to_the_buffered_route() -> None:
    """Its first byte is its whole answer: the streaming first-byte timeout would cut long generations."""
    r = on_request({":path": "/v1/chat/completions", "x-kvgate-buffered": "1"}, {"ticket": "t", "buffered": True})
    assert r.headers.get("x-kvgate-buffered") == "1" and r.route_cleared
    streamed = on_request({":path": "/v1/chat/completions", "x-kvgate-buffered": "1"}, {"ticket": "t"})
    assert "x-kvgate-buffered" not in streamed.headers and not streamed.route_cleared  # a client's own is dropped
