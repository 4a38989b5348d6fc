"""``document.py``: a large token-id prompt read in place (``_jsonscan.token_ids``) gives the same estimate,
the same prefix chain, the same errors and the same body sent on as the whole parse; and intake's cost
budget refuses what is dear in sum and reads what is dear in one kind only."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ext_proc import document, intake
from ext_proc.bodycost import Counts, cost
from ext_proc.config import Estimation, Limits, parse_config
from ext_proc.core import Answer, Core, Request, null_logger
from ext_proc.document import IDS_MIN, PAUSE_BYTES, TokenIds, dumps, find_ids, loads
from ext_proc.estimate import Estimator, not_json
from ext_proc.identity import hash_key
from ext_proc.intake import DEFAULT_ELEMENTS, Caps, caps_for, scan_and_find
from ext_proc.prefix import chain_of
from ext_proc.reasons import Invalid

COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
CHAT = "/v1/chat/completions"

needs_c = pytest.mark.skipif(document._token_ids is None, reason="unreachable: test_intake requires the extension")


def _estimate(body: bytes, path: str, fast: bool, limits: Limits | None = None) -> Any:
    est = Estimator(Estimation(), limits or Limits())
    if fast:
        return est.estimate(body, path=path, default_max_tokens=16)
    with intake.pure_python():
        return est.estimate(body, path=path, default_max_tokens=16)


def _same(body: bytes, path: str, limits: Limits | None = None) -> None:
    """The estimate (or the 400) with token ids read in place equals the whole parse's."""
    def run(fast: bool) -> Any:
        try:
            e = _estimate(body, path, fast, limits)
        except Invalid as x:
            return ("invalid", x.name, x.message, x.param)
        return (e.prompt_tokens, e.output_tokens, e.stream, chain_of(e.document, 64, 64),
                orjson.loads(dumps(e.document)) if e.document is not None else None)
    assert run(True) == run(False)


ids = st.integers(-(10**18) + 1, 10**18 - 1)


@needs_c
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.one_of(st.lists(ids, min_size=0, max_size=40),
                        st.lists(st.lists(ids, max_size=6), min_size=1, max_size=8)),
       n=st.sampled_from([None, 1, 2, 3]), max_tokens=st.sampled_from([None, 7, 100000]),
       space=st.sampled_from(["", " ", "\n  "]), first=st.booleans(),
       route=st.sampled_from([(COMPLETIONS, "prompt"), (EMBEDDINGS, "input")]))
def test_a_token_id_prompt_read_in_place_estimates_as_the_whole_parse(
        prompt: list[Any], n: int | None, max_tokens: int | None, space: str, first: bool,
        route: tuple[str, str]) -> None:
    path, key = route
    # as many copies as make it long enough to be read in place (fewer ids are parsed whole: IDS_MIN)
    per = sum(len(x) for x in prompt) if prompt and isinstance(prompt[0], list) else len(prompt)
    prompt = prompt * (-(-IDS_MIN // per) if per else 1)
    value = orjson.dumps(prompt).decode().replace(",", "," + space)
    doc: dict[str, Any] = {"model": "m", "pad": "x" * PAUSE_BYTES}  # (large enough to be read in place)
    if n is not None:
        doc["n"] = n
    if max_tokens is not None:
        doc["max_tokens"] = max_tokens
    rest = orjson.dumps(doc).decode()[1:-1]
    body = ("{" + f'"{key}":{space}{value},{rest}' + "}" if first else "{" + f'{rest},"{key}":{value}{space}' + "}")
    raw = body.encode()
    assert (find_ids(raw, "completions" if path == COMPLETIONS else "embeddings") is not None) == (per > 0)
    _same(raw, path)
    _same(raw, path, Limits(model_context_tokens=30, max_n=4))


@needs_c
@pytest.mark.parametrize("value", [
    b"[1,2.0,3]", b"[01,2]", b"[1,2,]", b"[1 2]", b"[1,[2]]", b"[[1],2]", b"[1234567890123456789]",
    b"[true,1]", b'["a",1]', b"[-]", b"[1e3]", b"[NaN]",
])
def test_what_is_not_strictly_token_ids_is_parsed_whole(value: bytes) -> None:
    body = b'{"model":"m","pad":"' + b"x" * PAUSE_BYTES + b'","prompt":' + value + b"}"
    assert find_ids(body, "completions") is None
    _same(body, COMPLETIONS)


@needs_c
@pytest.mark.parametrize("body", [
    b'{"prompt":[1,2],"prompt":[3]}',  # twice: which one a parser keeps is its own choice
    b'{"pr\\u006fmpt":[1,2]}',  # a key written with escapes
    b'{"x":"\\"prompt\\":[1]","prompt":"text"}',  # a key inside a string is no key
    b'\xef\xbb\xbf{"prompt":[1,2]}',  # a BOM: orjson's 400
    b'[{"prompt":[1,2]}]',  # not an object
])
def test_odd_bodies_are_left_to_the_whole_parse(body: bytes) -> None:
    padded = body.replace(b'"prompt"', b'"pad":"' + b"x" * PAUSE_BYTES + b'","prompt"', 1) \
        if not body.startswith(b"[") else body + b" " * PAUSE_BYTES
    assert find_ids(padded, "completions") is None
    _same(padded, COMPLETIONS)


@needs_c
@pytest.mark.parametrize("head", [b"", "é漢😀".encode() * 3000])  # (orjson's position counts characters)
@pytest.mark.parametrize("tail", [b'"max_tokens":01}', b'"max_tokens":1} x', b'"max_tokens":NaN}', b'"m":"\\ud800"}'])
def test_an_error_after_the_ids_is_named_where_it_is_in_the_body_sent(head: bytes, tail: bytes) -> None:
    body = b'{"model":"m","user":"' + head + b'","prompt":[' + b",".join([b"123"] * 30_000) + b"]," + tail
    assert find_ids(body, "completions") is not None
    with pytest.raises(orjson.JSONDecodeError) as whole:
        orjson.loads(body)
    with pytest.raises(orjson.JSONDecodeError) as in_place:
        loads(body, "completions")
    assert in_place.value.pos == whole.value.pos
    assert not_json(body, in_place.value).message == not_json(body, whole.value).message


@needs_c
def test_the_body_sent_on_keeps_the_ids_as_the_client_wrote_them() -> None:
    """A streamed request is rewritten (usage asked for, the tier's priority): the ids go on byte for
    byte, the rest as orjson writes it."""
    ids_text = b"[ 1,2 ,\n 3" + b",7" * 40_000 + b"]"
    body = b'{"model":"m","stream":true,"prompt":' + ids_text + b',"max_tokens":4}'
    cfg = parse_config({"tenants": [{"name": "t", "api_key_sha256": [hash_key("k")]}]})
    a = Core(cfg, lambda: 0.0, log=null_logger()).decide(Request(COMPLETIONS, "r", "Bearer k", body))
    assert isinstance(a, Answer) and a.decision.admitted and a.body is not None
    assert ids_text in a.body
    sent = orjson.loads(a.body)
    assert sent["prompt"] == orjson.loads(ids_text) and sent["stream_options"] == {"include_usage": True}


def test_token_ids_head_gives_the_first_ids_whatever_the_spacing() -> None:
    t = TokenIds(b"[ 5,\n -6 , 7,8]", -1, 4, 4)
    assert t.head(2) == [5, -6] and t.head(4) == [5, -6, 7, 8] and t.head(9) == [5, -6, 7, 8]
    assert TokenIds(b"[[1],[2]]", 2, 2, 1).head(5) == [] and t.prompts == 1
    wide = list(range(5000))
    raw = ("[" + ",".join(" " * 40 + str(i) for i in wide) + "]").encode()  # (more than 20 bytes an id)
    assert TokenIds(raw, -1, len(wide), len(wide)).head(1000) == wide[:1000]


@needs_c
def test_a_short_id_prompt_in_a_large_body_is_parsed_whole() -> None:
    """Kept raw, a few ids would save less than the body's copies cost (review45)."""
    body = b'{"model":"m","pad":"' + b"x" * PAUSE_BYTES + b'","prompt":[1,2,3]}'
    assert find_ids(body, "completions") is None
    _same(body, COMPLETIONS)


# -- the cost budget ---------------------------------------------------------------------------------------

def _mix(n: int) -> bytes:
    """n integers outside any prompt beside n/2 distinct keys: each kind far under its cap."""
    keys = b",".join(b'"%016d":1' % i for i in range(n // 2))
    return b'{"model":"m","messages":[],"tools":[' + b",".join([b"123456"] * n) + b'],"x":{' + keys + b"}}"


@needs_c
def test_a_body_dear_in_sum_is_refused_naming_what_it_holds() -> None:
    caps = caps_for(Limits())
    cheap, dear = _mix(20_000), _mix(120_000)
    assert scan_and_find(cheap, caps, "chat")[0] == 2
    with pytest.raises(intake.Costly) as e:
        scan_and_find(dear, caps, "chat")
    assert e.value.name == "body-too-complex" and "60004 keys" in e.value.message
    assert "limits.max_body_bytes" in e.value.message
    # each kind alone is under its cap: only their sum is refused
    assert dear.count(b",") < caps.elements and dear.count(b'"') // 2 < caps.strings


@needs_c
def test_the_budget_follows_max_body_bytes_and_counts_ids_read_in_place_cheaply() -> None:
    assert caps_for(Limits(max_body_bytes=16 << 20)).cost_ns == 4 * caps_for(Limits()).cost_ns
    assert caps_for(Limits(max_body_bytes=1 << 20)).cost_ns == caps_for(Limits()).cost_ns  # (never less)
    body = b'{"model":"m","prompt":[' + b",".join([b"123456"] * 262_000) + b"]}"
    caps = caps_for(Limits())
    _, found = scan_and_find(body, caps, "completions")
    assert found is not None and found[3] == 262_000
    assert intake._native is not None
    counts = Counts._make(intake._native(body, 1 << 40, 1 << 40, 1 << 40, 64, 1 << 40, 1 << 40))
    # the same ids parsed into Python ints would be past the budget; read in place they are not
    assert cost(counts, len(body)) > caps.cost_ns > cost(counts, len(body), found, searched=True)
    # a longer context raises the element cap: the prompt's ids past the default cap are not charged
    long = b'{"model":"m","prompt":[' + b",".join([b"7"] * 1_500_000) + b"]}"
    assert scan_and_find(long, caps_for(Limits(model_context_tokens=2_000_000)), "completions")[1] is not None
    with pytest.raises(intake.Costly):
        scan_and_find(long.replace(b"[7,", b"[[7],", 1), caps_for(Limits(model_context_tokens=2_000_000)),
                      "completions")  # (a list and ids mixed: no token-id prompt, every number parsed)
    # on the chat route the same list is no prompt: parsed, and refused
    tools = body.replace(b'"prompt"', b'"messages":[],"tools"')
    with pytest.raises(intake.Costly):
        scan_and_find(tools, caps, "chat")


@needs_c
def test_off_the_inference_routes_a_dear_body_is_not_read() -> None:
    """A hand-written route (the body may not be JSON): passing the budget gives the size-only estimate,
    as the other caps only the C pass counts do."""
    cfg = parse_config({"tenants": [{"name": "t", "api_key_sha256": [hash_key("k")]}]})
    a = Core(cfg, lambda: 0.0, log=null_logger()).decide(Request("/v1/other", "r", "Bearer k", _mix(120_000)))
    assert isinstance(a, Answer) and a.decision.admitted


@needs_c
def test_when_unicode_escapes_are_the_cost_the_400_says_to_send_utf8() -> None:
    """Python's json.dumps writes every non-ASCII character as a \\u escape by default: the remedy a
    client can act on is ensure_ascii=False."""
    caps = Caps(elements=DEFAULT_ELEMENTS, cost_ns=1e6)  # (a small budget: a smaller body shows it)
    text = "漢字かな" * 60_000
    escaped = orjson.dumps({"model": "m", "prompt": text}).decode().encode("ascii", "backslashreplace")
    escaped = escaped.replace(b"\\x", b"\\u00")  # (backslashreplace writes \\x for Latin-1)
    with pytest.raises(intake.Costly) as e:
        scan_and_find(escaped, caps, "completions")
    assert "ensure_ascii=False" in e.value.message
    with pytest.raises(intake.Costly) as e:
        scan_and_find(_mix(120_000), caps, "chat")
    assert "ensure_ascii" not in e.value.message and "fewer elements" in e.value.message
