"""Intake (ext_proc/intake.py): identity → gates that need no body → bounded parse → valid or 400.

Hostile shapes at ``max_body_bytes`` are refused by the scan naming the problem; bodies orjson refuses
are 400 ``invalid-json`` naming why (never passed on); a tenant over its quota is refused without its
body being parsed; ordinary bodies — including a 4 MB prompt full of commas — read as before.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from pathlib import Path
from typing import Any
from unittest.mock import patch

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ext_proc import intake
from ext_proc.config import Config, parse_config
from ext_proc.core import Answer, Core, Ended, Request, null_logger
from ext_proc.estimate import Estimator
from ext_proc.identity import hash_key
from ext_proc.intake import DEFAULT_ELEMENTS, Caps, caps_for, scan
from ext_proc.reasons import Invalid
from tests.helpers import FakeClock, json_depth

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MAX = 4 * 1024 * 1024


def config(mode: str = "enforce", **tenant: Any) -> Config:
    return parse_config({
        "mode": mode,
        "limits": {"max_n": 4, "max_output_tokens": 4096},
        "tenants": [{"name": "t", "api_key_sha256": [hash_key("k-t")], **tenant}],
    })


def make(cfg: Config | None = None) -> Core:
    return Core(cfg or config(), FakeClock(), log=null_logger())


def decide(core: Core, body: bytes, path: str = CHAT, rid: str = "r") -> Answer:
    a = core.decide(Request(path, rid, "Bearer k-t", body))
    assert isinstance(a, Answer)
    return a


def reason(a: Answer) -> str | None:
    return a.decision.rejection.reason if a.decision.rejection is not None else None


def fill(head: bytes, item: bytes, tail: bytes, size: int = MAX) -> bytes:
    n = (size - len(head) - len(tail)) // (len(item) + 1)
    return head + b",".join([item] * n) + tail


HOSTILE = {
    # the shapes of issue 28, each at max_body_bytes: (path, body, what the C pass names, what the pure-Python
    # pass names) — the C pass stops at the first cap passed, the Python pass checks strings first
    "tools of empty objects": (CHAT, fill(b'{"model":"m","messages":[],"tools":[', b"{}", b"]}"),
                               "objects and arrays", "objects and arrays"),
    "a token-id prompt of 2M ids": (COMPLETIONS, fill(b'{"model":"m","prompt":[', b"1", b"]}"), "elements",
                                    "elements"),
    "content-part messages": (CHAT, fill(b'{"model":"m","messages":[',
                                         b'{"role":"user","content":[{"type":"text","text":"a"}]}', b"]}"),
                              "objects and arrays", "strings"),
    # 9-digit numbers: past the bytes outside strings a 262k-token prompt needs before past the elements
    "numbers": (COMPLETIONS, fill(b'{"model":"m","prompt":[', b"123456789", b"]}"), "bytes outside its strings",
                "elements"),
    "floats": (COMPLETIONS, fill(b'{"model":"m","prompt":[', b"1.5e-300", b"]}"), "non-integer numbers",
               "elements"),
    "strings": (COMPLETIONS, fill(b'{"model":"m","prompt":[', b'"a"', b"]}"), "strings", "strings"),
    # escaped quotes in every string: the Python pass's exact pass would take them out first (18 ms at
    # 4 MB); more quotes than backslashes already says how many strings there are at least
    "objects of strings with escaped quotes": (CHAT, fill(b'{"model":"m","messages":[],"tools":[',
                                                          b'{"a":"\\""}', b"]}"),
                                               "objects and arrays", "at least"),
}


@pytest.mark.parametrize("native", [True, False], ids=["c", "python"])
@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_shapes_are_400_body_too_complex_naming_the_problem(name: str, native: bool) -> None:
    path, body, c_what, py_what = HOSTILE[name]
    assert len(body) <= MAX
    core = make()
    core.intake._estimator = None  # type: ignore[assignment]  # never parsed: the scan refuses first
    with patch.object(intake, "_native", intake._native if native else None):
        a = decide(core, body, path)
    assert reason(a) == "body-too-complex"
    assert a.reply is not None and a.reply.status == 400
    assert (c_what if native else py_what) in a.decision.rejection.message  # type: ignore[union-attr]


def test_a_4mb_prompt_full_of_commas_brackets_and_escaped_quotes_is_admitted() -> None:
    # every structural character a hostile body uses, inside one string: no false 400
    text = b'a, b, {c}, [d], \\" e \\\\ \\n ' * ((MAX - 200) // 28)
    body = b'{"model":"m","messages":[{"role":"user","content":"' + text + b'"}],"max_tokens":4}'
    assert len(body) <= MAX and body.count(b",") > caps_for(config().limits).elements
    a = decide(make(), body)
    assert a.decision.admitted and a.decision.rejection is None


def test_a_long_token_id_prompt_within_the_model_context_is_read() -> None:
    cfg = parse_config({"limits": {"model_context_tokens": 200_000},
                        "tenants": [{"name": "t", "api_key_sha256": [hash_key("k-t")]}]})
    ids = b",".join(b"1234" for _ in range(150_000))
    a = decide(make(cfg), b'{"model":"m","max_tokens":8,"prompt":[' + ids + b"]}", COMPLETIONS)
    assert a.decision.admitted
    # one longer than any context the config allows is refused unparsed
    ids = b",".join(b"1" for _ in range(200_000 + 70_000))
    a = decide(make(cfg), b'{"model":"m","prompt":[' + ids + b"]}", COMPLETIONS)
    assert reason(a) == "body-too-complex"


@pytest.mark.parametrize("body,words", [
    (b'\xef\xbb\xbf{"messages":[{"role":"user","content":"hi"}]}', "byte order mark"),
    (b'{"messages":[{"role":"user","content":"hi"}],"temperature":NaN}', "NaN"),
    (b'{"messages":[{"role":"user","content":"hi"}],"temperature":Infinity}', "Infinity"),
    (b'{"messages":[{"role":"user","content":"hi"}],"temperature":-Infinity}', "-Infinity"),
    (b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":1e999}', "out of range"),
    (b'{"messages":[{"role":"user","content":"\\ud800"}]}', "lone surrogate"),
    (b'{"messages":[{"role":"user","content":"\xed\xa0\x80"}]}', "UTF-8"),
    (b'{"messages":[{"role":"user","content":"\xff"}]}', "UTF-8"),
    (b'{"messages": [oops', "not valid JSON"),
])
def test_bodies_orjson_refuses_are_400_invalid_json_naming_why(body: bytes, words: str) -> None:
    a = decide(make(), body)
    assert reason(a) == "invalid-json" and a.reply is not None and a.reply.status == 400
    assert words in a.decision.rejection.message  # type: ignore[union-attr]
    assert a.decision.lease is None  # nothing taken, nothing passed on


def test_a_bom_can_no_longer_carry_a_request_past_max_n_and_max_output_tokens() -> None:
    doc = b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":100000,"n":16,"stream":true}'
    core = make()
    assert reason(decide(core, doc)) == "invalid-parameter"  # the checks it used to skip
    a = decide(core, b"\xef\xbb\xbf" + doc, rid="bom")
    assert reason(a) == "invalid-json" and not a.decision.admitted


def test_an_empty_body_on_an_inference_route_is_missing_body() -> None:
    assert reason(decide(make(), b"")) == "missing-body"


class Counting(Estimator):
    calls = 0

    def estimate(self, body: bytes, *, path: str, default_max_tokens: int, **kw: Any) -> Any:
        Counting.calls += 1
        return super().estimate(body, path=path, default_max_tokens=default_max_tokens, **kw)


def counted(core: Core) -> Core:
    core.intake._estimator = Counting(core.config.estimation, core.config.limits)
    Counting.calls = 0
    return core


OK = orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
HOSTILE_BODY = HOSTILE["tools of empty objects"][1]


def test_a_tenant_at_its_concurrency_cap_is_refused_without_its_body_being_parsed() -> None:
    core = counted(make(config(max_concurrent=1)))
    assert decide(core, OK, rid="first").decision.admitted
    assert Counting.calls == 1
    a = decide(core, HOSTILE_BODY, rid="second")
    assert reason(a) == "tenant-concurrency" and a.reply is not None and a.reply.status == 429
    assert Counting.calls == 1  # the estimator never saw it
    assert "retry-after" in dict(a.reply.headers)
    assert a.pool == "default"  # one pool: labelled as the full decision labelled it
    assert core.admission.tenant_state("t").inflight == 1  # type: ignore[union-attr]  # took nothing


def test_a_tenant_with_an_empty_request_bucket_is_refused_without_its_body_being_parsed() -> None:
    core = counted(make(config(requests_per_minute=1)))
    first = decide(core, OK, rid="first")
    assert first.decision.admitted
    core.ended(Ended(first.ticket, "first", 200))
    a = decide(core, HOSTILE_BODY, rid="second")
    assert reason(a) == "tenant-requests"
    assert Counting.calls == 1


def test_a_body_over_max_body_bytes_is_413_unparsed() -> None:
    core = counted(make())
    a = decide(core, b" " * (MAX + 1))
    assert reason(a) == "body-too-large" and Counting.calls == 0


@pytest.mark.parametrize("where", ["global", "tenant"])
def test_shadow_mode_refuses_nothing_at_the_cheap_gates(where: str) -> None:
    cfg = config("shadow", max_concurrent=1) if where == "global" else config(max_concurrent=1, mode="shadow")
    core = counted(make(cfg))
    assert decide(core, OK, rid="first").decision.admitted
    a = decide(core, OK, rid="second")
    assert a.decision.admitted and reason(a) == "tenant-concurrency"  # recorded, admitted all the same
    assert Counting.calls == 2


def test_the_gates_refuse_with_the_full_decisions_own_reason_and_message() -> None:
    """What precheck answers is what the full decision answers for the same state."""
    core = make(config(max_concurrent=1, requests_per_minute=600))
    assert decide(core, OK, rid="first").decision.admitted
    tenant = core.config.tenants[0]
    peek = core.admission.precheck(tenant, len(OK))
    full = core.admission.decide(tenant, "x", core.estimator.estimate(OK, path=CHAT, default_max_tokens=16),
                                 len(OK))
    assert peek is not None and full.rejection is not None
    assert (peek.reason, peek.status, peek.message) == (full.rejection.reason, full.rejection.status,
                                                       full.rejection.message)


# -- the scan, against the real counts ---------------------------------------------------------------

def real_counts(doc: Any) -> tuple[int, int, int]:
    """(elements, containers, strings) of a document: commas + containers, containers, keys + strings."""
    elements = containers = strings = 0
    stack = [doc]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            strings += 1
        elif isinstance(v, dict | list):
            containers += 1
            elements += 1 + max(0, len(v) - 1)
            if isinstance(v, dict):
                strings += len(v)
                stack.extend(v.values())
            else:
                stack.extend(v)
    return elements, containers, strings


TEXT = st.text(alphabet=st.sampled_from([*'ab ,{}[]:"\\\n', "é", "\u2028"]), max_size=12)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | TEXT,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(TEXT, children, max_size=4),
    max_leaves=30,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=JSON, elements=st.integers(1, 60), containers=st.integers(1, 20), strings=st.integers(1, 30))
def test_scan_refuses_exactly_the_bodies_over_a_cap(doc: Any, elements: int, containers: int, strings: int) -> None:
    body = orjson.dumps(doc)
    caps = Caps(elements, containers, strings, outside=1 << 20)  # (the number caps: the next test)
    e, c, s = real_counts(doc)
    over = e > elements or c > containers or s > strings
    # the C pass, then the pure-Python one with its strings set apart in place, and by split
    for native, few in ((True, intake._FEW_QUOTES), (False, intake._FEW_QUOTES), (False, 0)):
        with patch.object(intake, "_FEW_QUOTES", few), patch.object(intake, "_native", intake._native if native
                                                                     else None):
            try:
                counted = scan(body, caps)
            except Invalid as exc:
                assert exc.name == "body-too-complex"
                assert over, (body, caps)
            else:
                assert not over, (body, caps, (e, c, s))
                # what the estimate's nesting check trusts: never less than the nesting — the C pass's
                # exact depth (or, for a small body with few brackets, their count, no C call), the Python
                # pass's count of objects and arrays
                assert counted is None or counted >= json_depth(doc)
                assert not native or counted is not None
                assert native or counted is None or counted >= c


NUMBERS = st.recursive(
    st.integers(-(10**12), 10**12) | st.floats(allow_nan=False, allow_infinity=False) | st.booleans() | st.none()
    | TEXT,
    lambda children: st.lists(children, max_size=6) | st.dictionaries(TEXT, children, max_size=3),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=NUMBERS, outside=st.integers(1, 200), fractions=st.integers(0, 8), indent=st.booleans())
def test_the_c_pass_counts_bytes_outside_strings_and_non_integer_numbers_exactly(
        doc: Any, outside: int, fractions: int, indent: bool) -> None:
    """The caps only the C pass counts: bytes outside strings (whitespace an eighth each) and numbers with a
    fraction or an exponent — against the body's own strings set apart by a parse (orjson writes every
    float with a '.' or an exponent; indented, it adds whitespace)."""
    body = orjson.dumps(doc, option=orjson.OPT_INDENT_2 if indent else 0)
    inside = sum(len(orjson.dumps(x)) - 2 for x in _strings_of(doc))
    compact = len(orjson.dumps(doc)) - inside  # (orjson writes no whitespace unless indenting)
    blank = len(body) - inside - compact
    real_outside = compact + blank // 8
    real_fractions = sum(1 for x in _numbers_of(doc) if isinstance(x, float))
    big = 1 << 30
    over = intake._native(body, big, big, big, big, outside, fractions)[4]
    # it stops at the first cap passed, in the order it reads the body: either may be named
    passed = {5} if real_outside > outside else set()
    passed |= {6} if real_fractions > fractions else set()
    assert over in passed if passed else over == 0, (body, real_outside, real_fractions, over)


def _strings_of(doc: Any) -> list[str]:
    if isinstance(doc, str):
        return [doc]
    if isinstance(doc, dict):
        return [*doc, *(x for v in doc.values() for x in _strings_of(v))]
    if isinstance(doc, list):
        return [x for v in doc for x in _strings_of(v)]
    return []


def _numbers_of(doc: Any) -> list[Any]:
    if isinstance(doc, dict):
        return [x for v in doc.values() for x in _numbers_of(v)]
    if isinstance(doc, list):
        return [x for v in doc for x in _numbers_of(v)]
    return [doc] if isinstance(doc, int | float) and not isinstance(doc, bool) else []


def test_the_c_scan_is_built_and_counts_outside_strings_only() -> None:
    """``make`` builds the extension (optional only for an install without a C compiler, which falls back
    to the slower pure-Python scan): here it must be there, or its speed is silently lost."""
    assert intake._native is not None, ("ext_proc/_jsonscan.c was not built (no C compiler or Python headers?): "
                                        "install them, then `make` again")
    assert intake.SCAN_KIND == "c"
    big = 1 << 20

    def run(body: bytes, elements: int = big, containers: int = big, strings: int = big, depth: int = big,
            outside: int = big, fractions: int = big) -> tuple[int, ...]:
        assert intake._native is not None
        return intake._native(body, elements, containers, strings, depth, outside, fractions)

    # what the cost budget reads (``bodycost.Counts``): keys (a string before a colon), escapes (\\u ones
    # apart), non-integer numbers, numbers (a digit or '-' starting one: not a fraction's or an exponent's),
    # arrays, escapes in strings with non-ASCII bytes, bytes of keys with non-ASCII bytes
    counts = run('{"k" : [1, -2, 3.5e-3, true, null, "1\\n\\u00e9"], "o": {"pé": {}}, "x": "é\\t"}'.encode())
    # (... non-ASCII strings: "pé", "é\\t"; bytes of non-ASCII strings with escapes: "é\\t")
    assert counts[5:] == (4, 3, 1, 1, 3, 1, 1, 3, 2, 4)

    body = b'{"a":[1,2,{}],"b":"x,\\\"{[","c":"\\"}'  # an escaped backslash, then a quote
    assert run(body)[:5] == (3, 7, 5, 3, 0)  # (containers, elements, strings, depth, over)
    # it stops at the first cap passed and says which
    assert run(b"[" + b"{}," * 10 + b"{}]", containers=5)[4] == 2
    assert run(b"[" + b"1," * 10 + b"1]", elements=5)[4] == 1
    assert run(b'["a","b","c"]', strings=2)[4] == 3
    assert run(b"[[[[]]]]", depth=3)[4] == 4 and run(b"[[[]],[[]]]", depth=3)[:5] == (5, 6, 0, 3, 0)
    assert run(b"[1,2.5]", outside=6)[4] == 5 and run(b'["      "]', outside=4)[4] == 0
    assert run(b"[\n      1,\n      2\n]", outside=6)[4] == 0  # (whitespace: an eighth of a byte each, 16 -> 2)
    assert run(b"[\n      1,\n      2\n ]", outside=6)[4] == 5
    assert run(b"[1.5,2e3,3.5e-3,true,false,1E9]", fractions=4)[4] == 0
    assert run(b"[1.5,2e3,3.5e-3,true,false,1E9,7.0]", fractions=4)[4] == 6
    # an unterminated string or a lone backslash at the end: counted as far as it goes, no overrun
    assert run(b'["a\\')[:5] == (1, 1, 1, 1, 0)
    assert run(b'["\\"')[:5] == (1, 1, 1, 1, 0)
    with pytest.raises(TypeError):
        run(bytearray(b"[]"))  # type: ignore[arg-type]  # (bytes only: immutable while it is read)
    with pytest.raises(Invalid, match="more than 4 objects and arrays"):
        scan(b"[" + b"{}," * 40 + b"{}]", Caps(1000, 4, 1000))
    with pytest.raises(Invalid, match="nested deeper than 64"):
        scan(b"[" * 65 + b"]" * 65 + b" " * 1000, Caps(1000, 1000, 1000))


MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                 "content": TEXT | st.lists(st.fixed_dictionaries(
                                     {"type": st.just("text"), "text": TEXT}), max_size=3)})
REQUEST = st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=6)}, optional={
    "model": TEXT, "max_tokens": st.integers(1, 4096), "n": st.integers(1, 4), "stream": st.booleans(),
    "tools": st.lists(JSON, max_size=3), "temperature": st.floats(0, 2),
})


def test_a_scanned_body_too_deep_is_still_refused_and_one_at_the_limit_read() -> None:
    """The scan's container count lets the estimate skip its nesting check only when no deeper nesting
    is possible: a body big enough to be scanned, nested 65 levels, is refused; at 64 it is read."""
    core = make()
    pad = b'"' + b"[]{}" * (core.intake.caps.small // 2) + b'"'  # brackets in a string: scanned, not counted
    for levels, refused in ((62, False), (63, True)):  # + the top object and the tools list
        body = (b'{"messages":[],"tools":[' + pad + b"," + b"[" * levels + b"]" * levels + b"]}")
        assert len(body) > core.intake.caps.small
        taken = core.intake.take("Bearer k-t", None, CHAT, body, len(body))
        if refused:
            assert taken.rejection is not None and "nested" in taken.rejection.message
        else:
            assert taken.rejection is None, taken.rejection


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=REQUEST)
def test_the_bounded_parse_agrees_with_the_estimate_on_ordinary_bodies(doc: dict[str, Any]) -> None:
    core = make()
    body = orjson.dumps(doc)
    taken = core.intake.take("Bearer k-t", None, CHAT, body, len(body))
    try:
        want = core.estimator.estimate(body, path=CHAT, default_max_tokens=core.config.estimation.default_max_tokens)
    except Invalid as e:
        assert taken.rejection is not None and taken.rejection.reason == e.name
        return
    assert taken.rejection is None and taken.estimate is not None
    assert (taken.estimate.prompt_tokens, taken.estimate.output_tokens, taken.estimate.stream) == \
        (want.prompt_tokens, want.output_tokens, want.stream)


def test_a_refused_reading_is_charged_to_the_sender_then_its_bodies_go_unread() -> None:
    # a tenant at its own limits sending hostile bodies: each read costs it a request of its bucket,
    # so it gets requests_per_minute readings, then 429s that never reach the parser
    core = counted(make(config(requests_per_minute=3)))
    answers = [reason(decide(core, b'\xef\xbb\xbf{"messages":[]}', rid=f"h{i}")) for i in range(5)]
    assert answers == ["invalid-json"] * 3 + ["tenant-requests"] * 2
    assert Counting.calls == 3
    shadow = counted(make(config(requests_per_minute=3, mode="shadow")))
    assert [reason(decide(shadow, b"\xef\xbb\xbf{}", rid=f"s{i}")) for i in range(5)] == ["invalid-json"] * 5
    # reading costs by the byte: a 4 MB hostile body costs 64 requests of a 600/min bucket
    big = counted(make(config(requests_per_minute=600)))
    answers = [reason(decide(big, HOSTILE_BODY, rid=f"b{i}")) for i in range(12)]
    assert answers == ["body-too-complex"] * 10 + ["tenant-requests"] * 2  # 600 / 64 = 9.4: the 10th goes into debt


def test_with_a_shared_store_a_refused_reading_gates_the_next_reads_too() -> None:
    """(review, red team) With several replicas the charge went into the request credit leased from the
    store, which the gate never reads: every hostile body was scanned. The reading bucket is this
    replica's own, in every quota mode."""
    doc = config(requests_per_minute=3).model_dump(mode="json")
    doc["store"] = {"redis": {"url": "redis://127.0.0.1:1/0", "expected_replicas": 3}}
    core = counted(make(parse_config(doc)))
    assert core.admission.leased is core.admission.quota  # leased from a store (not asked here)
    answers = [reason(decide(core, b'\xef\xbb\xbf{"messages":[]}', rid=f"h{i}")) for i in range(6)]
    assert answers[:3] == ["invalid-json"] * 3 and answers[3:] == ["tenant-requests"] * 3
    assert Counting.calls == 3


def test_a_valid_body_refused_after_the_parse_is_charged_too() -> None:
    """(red team) Bodies that parse but can never succeed — too long for the tenant, a model nobody
    serves — were refused after a full parse and never charged: 674 4 MB bodies in 9 s, 11 ms each."""
    core = counted(make(config(requests_per_minute=3, max_prompt_tokens=10)))
    long = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "word " * 200}]})
    answers = [reason(decide(core, long, rid=f"l{i}")) for i in range(5)]
    assert answers == ["prompt-too-long"] * 3 + ["tenant-requests"] * 2
    assert Counting.calls == 3


@pytest.mark.parametrize("ids", [[1] * 70_000, list(range(70_000)), [7] * 10])
def test_the_prefix_chain_of_a_token_id_prompt_reads_only_its_head_with_the_same_result(ids: list[int]) -> None:
    from ext_proc.prefix import chain_of, text_chain

    doc = {"model": "m", "prompt": ids}
    seed = hash(("m", "None"))
    assert chain_of(doc, 512, 128) == text_chain(",".join(map(str, ids)), 512, 128, seed)


def test_the_prefix_chain_is_computed_only_for_requests_that_are_placed(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from ext_proc import core as core_module
    from gpu_probe.snapshot import Snapshot

    nodes = ["10.0.0.0:8000", "10.0.0.1:8000"]
    cfg = parse_config({"nodes": {"static": [{"address": a, "probe": f"http://p{i}"} for i, a in enumerate(nodes)]},
                        "tenants": [{"name": "t", "api_key_sha256": [hash_key("k-t")], "tokens_per_minute": 2500}]})
    core = Core(cfg, time.monotonic, log=null_logger())
    for a in nodes:
        core.snapshot(a, Snapshot(node="n", at=time.time(), ok=True, kv_usage=0.2, blocks_total=1000, block_size=16))
    calls: list[int] = []
    real = core_module.chain_of
    monkeypatch.setattr(core_module, "chain_of", lambda *a: calls.append(1) or real(*a))
    body = orjson.dumps({"messages": [{"role": "user", "content": "x" * 4000}], "max_tokens": 8})
    first = decide(core, body, rid="1")
    assert first.decision.admitted and calls == [1]
    core.ended(Ended(first.ticket, "1", 200))
    second = decide(core, body, rid="2")
    assert second.decision.admitted and calls == [1, 1]
    assert second.metadata["endpoint"] == first.metadata["endpoint"]  # the chain still steers it
    larger = orjson.dumps({"messages": [{"role": "user", "content": "x" * 8000}], "max_tokens": 8})
    third = decide(core, larger, rid="3")
    assert reason(third) == "tenant-tokens"
    assert calls == [1, 1]  # refused by its token bucket before placement: no chain


def test_a_batch_of_prompts_is_reserved_and_capped_as_that_many_sequences() -> None:
    """(red team) A list of prompts on /v1/completions runs one sequence per prompt: 100 prompts with
    max_tokens 1000 were reserved as 1,000 output tokens and passed max_n as one sequence."""
    core = make(config(tokens_per_minute=1e9))
    ok = orjson.dumps({"model": "m", "prompt": ["x" * 40] * 4, "max_tokens": 100})
    a = decide(core, ok, path="/v1/completions", rid="b0")
    assert a.decision.admitted and a.decision.lease is not None
    assert a.decision.lease.reserved_tokens - a.decision.lease.prompt_estimate == 400  # 4 x 100
    many = orjson.dumps({"model": "m", "prompt": ["x" * 40] * 100, "max_tokens": 1000})
    r = decide(core, many, path="/v1/completions", rid="b1").decision.rejection
    assert r is not None and r.reason == "invalid-parameter" and r.param == "prompt" and "100 sequences" in r.message
    ids = orjson.dumps({"model": "m", "prompt": [[1, 2, 3]] * 3, "n": 2, "max_tokens": 10})
    r = decide(core, ids, path="/v1/completions", rid="b2").decision.rejection
    assert r is not None and "6 sequences" in r.message  # 3 token-id prompts x n=2 > max_n 4
    one = orjson.dumps({"model": "m", "prompt": list(range(50)), "max_tokens": 10})  # one token-id prompt
    assert decide(core, one, path="/v1/completions", rid="b3").decision.admitted


def test_a_request_without_an_output_cap_gets_the_gateways() -> None:
    """(red team) With no max_tokens vLLM generates up to the model's context: 4,700 tokens went past
    limits.max_output_tokens 4,096. kvgate writes the cap into such a body; min_tokens above it is a 400."""
    core = make(config())
    for path, doc, field in (
            (CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
            ("/v1/completions", {"model": "m", "prompt": "hi"}, "max_tokens"),
            ("/v1/responses", {"model": "m", "input": "hi"}, "max_output_tokens")):
        a = decide(core, orjson.dumps(doc), path=path, rid=path)
        assert a.decision.admitted and a.body is not None, path
        assert orjson.loads(a.body)[field] == 4096
        core.ended(Ended(a.ticket, path, 200, None))
    own = decide(core, orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                     "max_completion_tokens": 9}), rid="own")
    assert own.body is None or "max_tokens" not in orjson.loads(own.body)  # the client's own cap stands
    r = decide(core, orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                   "min_tokens": 5000}), rid="min").decision.rejection
    assert r is not None and r.param == "min_tokens"


def test_a_batch_of_embedding_inputs_is_read_whatever_the_models_context() -> None:
    """(review) With model_context_tokens 8,192 the element cap was 73,728: a batch of 2,048 embedding
    inputs of 64 token ids (131k elements) was refused as body-too-complex, and charged."""
    doc = config().model_dump(mode="json")
    doc["limits"]["model_context_tokens"] = 8192
    core = make(parse_config(doc))
    body = orjson.dumps({"model": "m", "input": [list(range(64))] * 2048})
    a = decide(core, body, path="/v1/embeddings", rid="e")
    assert a.decision.admitted, a.decision.rejection  # (each input is its own sequence: 64 tokens of 8k)
    long = orjson.dumps({"model": "m", "input": [[1] * 9000, [2] * 10]})
    r = decide(core, long, path="/v1/embeddings", rid="e2").decision.rejection
    assert r is not None and r.reason == "context-too-long"  # one input longer than the context
    batch = orjson.dumps({"model": "m", "prompt": [[1] * 3000] * 3, "max_tokens": 100})  # 9,000 in all
    assert decide(core, batch, path="/v1/completions", rid="c").decision.admitted



@pytest.mark.parametrize("odd", [None, True, 1.5, "1", [1], {}, -7, 2**63 - 1],
                         ids=["ints", "bool", "float", "str", "list", "object", "negative", "int64-max"])
def test_the_long_token_id_check_is_exact_in_c_and_without_it(odd: Any) -> None:
    """A long prompt list is checked for integers only in C (``_jsonscan.all_ints``) or, without the
    extension, by orjson writing it back: the estimate is the same either way. (orjson reads an integer
    beyond 64 bits as a float: no list of its making holds one.)"""
    from ext_proc import estimate

    value = [12345] * 1000 + ([] if odd is None else [odd]) + [67890] * 1000
    exact = all(type(x) is int for x in value)
    assert estimate._all_ints is not None and estimate._all_ints(value) is exact
    assert estimate._only_ints_bytes(value) is exact
    body = b'{"model":"m","max_tokens":1,"prompt":' + orjson.dumps(value) + b"}"
    answers = []
    for native in (True, False):
        with patch.object(estimate, "_all_ints", estimate._all_ints if native else None):
            try:
                answers.append(Estimator(parse_config({}).estimation).estimate(
                    body, path="/v1/completions", default_max_tokens=16).prompt_tokens)
            except Invalid as e:
                answers.append(e.name)
    assert answers[0] == answers[1] == (len(value) if exact else "invalid-body")


PART_KIND = TEXT | st.integers(-99, 99) | st.sampled_from(["text", "image_url", "input_audio"])
ODD_MESSAGE = st.one_of(
    MESSAGE,
    st.dictionaries(st.sampled_from(["role", "content", "name", "type", "image_url", "tool_calls", "x"]),
                    JSON | PART_KIND | st.lists(st.fixed_dictionaries({"type": PART_KIND}, optional={
                        "text": TEXT, "image_url": JSON}), max_size=3), max_size=4),
    JSON,
)
ODD_REQUEST = st.fixed_dictionaries({}, optional={
    "messages": st.lists(ODD_MESSAGE, max_size=8) | JSON,
    "input": st.lists(ODD_MESSAGE, max_size=6) | st.lists(TEXT, max_size=20)
    | st.lists(st.lists(st.integers(0, 99) | st.booleans(), max_size=20), max_size=20) | JSON,
    "prompt": st.lists(TEXT, max_size=20) | st.lists(st.lists(st.integers(0, 99), max_size=20), max_size=20) | JSON,
    "tools": st.lists(JSON, max_size=3), "instructions": TEXT | JSON, "model": TEXT,
})


@functools.cache
def _word_tokenizer() -> str:
    """A small real tokenizer.json (words of the test alphabet, whitespace-split), made once."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "ab": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = Path(tempfile.mkdtemp()) / "tokenizer.json"
    tok.save(str(path))
    return str(path)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=ODD_REQUEST, path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                                              "/v1/responses"]), tokenizer=st.booleans())
def test_the_estimate_is_the_same_with_its_c_loops_and_without(doc: dict[str, Any], path: str,
                                                               tokenizer: bool) -> None:
    """The estimate's per-element loops in C (``walk_tokens``, ``bad_message``, ``all_ints``) answer what
    its Python loops answer — the same tokens, or the same 400 naming the same field — on well-formed
    and odd messages, content parts, media parts, input lists and token-id lists alike; with a tokenizer
    too (the C walk then gathers the strings: these bodies are within its exact budget)."""
    body = orjson.dumps(doc)
    cfg = parse_config({"estimation": {"tokenizer_json": _word_tokenizer()}} if tokenizer else {})
    answers = []
    for native in (True, False):
        with contextlib.nullcontext() if native else intake.pure_python():
            try:
                e = Estimator(cfg.estimation).estimate(body, path=path, default_max_tokens=16)
                answers.append((e.prompt_tokens, e.output_tokens))
            except Invalid as exc:
                answers.append((exc.name, str(exc)))
    assert answers[0] == answers[1], (body, path)


def test_a_bad_message_is_named_without_walking_the_ones_before_it() -> None:
    """The C check finds the first bad message and only it is checked again in Python (before, the Python
    loop walked every message ahead of it: 11 ms for 16k and a bad last one)."""
    est = Estimator(parse_config({}).estimation)
    doc = {"messages": [{"role": "u", "content": None}] * 1000 + [{"role": 5, "content": "x"}]}
    with patch.object(Estimator, "_walk", side_effect=AssertionError("walked")), \
            pytest.raises(Invalid, match=r"'messages\[1000\]\.role' must be a string"):
        est.estimate(orjson.dumps(doc), path=CHAT, default_max_tokens=16)


def test_the_c_loops_leave_keys_that_are_not_strings_to_python() -> None:
    """A key of another type whose hash equals "role" or "type" would have its ``__eq__`` run by a lookup,
    which could free what the C walk holds borrowed: the C loops look up nothing in such a dict and leave
    it to Python (orjson makes no such key; a caller handing over its own objects could)."""
    from ext_proc import estimate

    assert estimate._bad_message is not None and estimate._walk_tokens is not None
    victims: list[Any] = []

    class Colliding:
        def __init__(self, like: str) -> None:
            self.like = like

        def __hash__(self) -> int:
            return hash(self.like)

        def __eq__(self, other: object) -> bool:
            victims.clear()  # (what a hostile __eq__ could do to the tree being walked)
            return False

    for like in ("role", "type", "content"):
        victims[:] = [{"role": "user", "content": "hi"}, {Colliding(like): 1, "role": "user", "content": "x"}]
        assert estimate._bad_message(victims, True) == 1
        victims[:] = [{"role": "user", "content": [{Colliding(like): 1, "type": "text", "text": "x"}]}]
        assert estimate._bad_message(victims, True) == 0
        victims[:] = [{"a": "xxxx"}, {Colliding(like): "y", "b": "zzzz"}]
        assert estimate._walk_tokens(victims, 4.0, estimate._OPAQUE_PARTS, estimate._SKIPPED_KEYS, 768) is None


def test_the_longest_input_of_a_batch_is_its_longest_string_or_list() -> None:
    cfg = parse_config({"limits": {"model_context_tokens": 1000}})
    est = Estimator(cfg.estimation, cfg.limits)
    words = ["a" * n for n in (3, 4000, 17, 4001, 5)]
    assert est._longest(words) == max(est.text_tokens(len(w)) for w in words) == 1001
    assert est._longest([[1] * 7, [2] * 900, [3]]) == 900
    assert est._longest("x" * 40) == est.text_tokens(40)
    # and through the estimate: an embeddings batch whose longest input passes the context is refused
    with pytest.raises(Invalid, match="about 1001 tokens"):
        est.estimate(orjson.dumps({"model": "m", "input": words}), path="/v1/embeddings", default_max_tokens=16)


def test_a_body_past_the_number_caps_on_another_route_is_not_read() -> None:
    """The caps only the C pass counts, passed on a path that is not an inference route (a hand-written
    ``--route``, whose body may not be JSON: plain text full of dots): neither refused for that nor parsed
    at the cost the caps avoid (review43 F1: 20-digit integers cost 7.5 ms there) — the size-only
    estimate, as for a body that is not JSON. On an inference route, a 400."""
    core = make()
    for body in (b"Lorem. " * 70_000,  # 490 kB of text, 70k dots
                 b'{"x":[' + b",".join([b"18446744073709551615"] * 190_000) + b"]}"):
        taken = core.intake.take("Bearer k-t", None, "/v1/score", body, len(body))
        assert taken.rejection is None and taken.estimate is not None and not taken.estimate.parsed
        assert taken.estimate.prompt_tokens == core.estimator.text_tokens(len(body))
    body = b'{"model":"m","prompt":[' + b",".join([b"1.5"] * 70_000) + b"]}"
    taken = core.intake.take("Bearer k-t", None, COMPLETIONS, body, len(body))
    assert taken.rejection is not None and "non-integer numbers" in taken.rejection.message



def test_a_pretty_printed_262k_token_prompt_is_read() -> None:
    """Whitespace is not counted against the bytes outside strings: ``json.dumps(indent=2)`` of a
    262k-token prompt of 7-digit ids (3.4 MB) is read and admitted, as the pure-Python pass admits it
    (review42 F1: refused when whitespace counted)."""
    import json

    body = json.dumps({"model": "m", "max_tokens": 1, "prompt": [1234567] * (DEFAULT_ELEMENTS - 16)},
                      indent=2).encode()
    assert len(body) <= MAX
    core = make()
    for native in (True, False):
        with patch.object(intake, "_native", intake._native if native else None):
            taken = core.intake.take("Bearer k-t", None, COMPLETIONS, body, len(body))
        assert taken.rejection is None, taken.rejection
        assert taken.estimate is not None and taken.estimate.prompt_tokens == DEFAULT_ELEMENTS - 16
