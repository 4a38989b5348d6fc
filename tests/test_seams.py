"""The defects found trying to break kvgate's seams, each pinned by a test of the pure parts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from ext_proc.admission import Admission, Placed
from ext_proc.breaker import State
from ext_proc.config import parse_config
from ext_proc.core import Core, Ended, Held, Request, null_logger
from ext_proc.estimate import Estimate
from ext_proc.identity import hash_key
from ext_proc.server import ATTR_AUTH, ATTR_ID, ATTR_NS, Gateway, Undecodable, _decode, poll_nodes
from gpu_probe.snapshot import Snapshot
from tests.helpers import FakeClock
from tests.test_nodes import feed, fleet, snap


def E(prompt: int = 10, out: int = 10) -> Estimate:
    return Estimate(prompt, out, parsed=True)


def test_a_half_open_trial_that_ends_without_a_verdict_gives_its_place_back() -> None:
    f = fleet(2, breaker={"recovery_window_seconds": 1, "half_open_requests": 2})
    n = f.nodes["10.0.0.0:8000"]
    for t in range(3):
        feed(f, t, 0.3, 0.93)
    f.on_snapshot(n.address, snap(0.99), 3)
    feed(f, 4.1, 0.3, 0.93)
    assert n.breaker.state is State.HALF_OPEN
    for i in range(2):
        assert f.place(1, 1, f"t{i}", 4.2).node is n
    assert f.choose(1, 4.2).node is None  # both trials out
    f.completed(n.address, "t0", 0, None, 4.3)  # the client went away: no verdict
    f.completed(n.address, "t1", 0, None, 4.3)
    assert f.place(1, 1, "t2", 4.4).node is n  # today it stayed half-open with no trial left, forever
    assert f.place(1, 1, "t3", 4.4).node is n
    f.completed(n.address, "t2", 1, True, 4.5)
    f.completed(n.address, "t3", 1, True, 4.6)
    assert n.breaker.state is State.CLOSED


def test_no_tier_waits_behind_another_tiers_head_that_cannot_be_placed() -> None:
    """Reproduced: an interactive request got 503 queue-timeout while a node was free — the head the
    pump looked at (another tier's, which its KV reserve or size kept off every node) stopped it."""
    clock = FakeClock()
    cfg = parse_config({"tenants": [{"name": "t"}]})
    a = Admission(cfg, clock, random.Random(1))
    room = {"big": False, "small": True}  # the big one fits nowhere yet

    def pick(est: Estimate, shadow: bool, ticket: str, tier: str, waited: float, guarded: bool = False) -> Placed:
        ok = room["big"] if est.prompt_tokens > 100 else room["small"]
        return Placed("n:1") if ok else Placed(None, "fleet-kv", 1.0)

    hold = {"on": True}

    def gated(est: Estimate, shadow: bool, ticket: str, tier: str, waited: float, guarded: bool = False) -> Placed:
        return Placed(None, "fleet-kv", 1.0) if hold["on"] else pick(est, shadow, ticket, tier, waited)

    a.pick = gated
    interactive = parse_config({"tenants": [{"name": "i", "tier": "interactive"}, {"name": "s"}]})
    a.reconfigure(interactive)
    big = a.decide(interactive.tenant("i"), "r1", E(500, 10), 10)
    small = a.decide(interactive.tenant("s"), "r2", E(10, 10), 10)
    assert big.queued and small.queued
    hold["on"] = False
    released = [o.ticket for o in a.pump()]
    assert small.lease is not None and released == [small.lease.ticket]  # the big head did not block it
    assert a.queued == 1


def test_retry_after_for_a_full_concurrency_cap_says_when_a_slot_frees() -> None:
    """Slots held ~11 s: the Retry-After fell to the 100 ms floor once a lease was older than the mean."""
    clock = FakeClock()
    cfg = parse_config({"tenants": [{"name": "t", "max_concurrent": 2}], "retry": {"jitter": 0}})
    a = Admission(cfg, clock, random.Random(1))
    t = cfg.tenant("t")
    for i in range(2):
        assert a.decide(t, f"r{i}", E(), 10).admitted
    clock.advance(11.0)  # far past the default mean of 2 s
    r = a.decide(t, "r9", E(), 10).rejection
    assert r is not None and r.reason == "tenant-concurrency"
    assert r.retry_after is not None and r.retry_after >= 2.0


def test_a_tenant_named_unknown_keeps_its_quota() -> None:
    clock = FakeClock()
    cfg = parse_config({"tenants": [{"name": "unknown", "api_key_sha256": [hash_key("k")], "max_concurrent": 1}]})
    core = Core(cfg, clock, log=null_logger())
    first = core.decide(Request("/v1/chat/completions", "r1", "Bearer k", estimate=E(), body_bytes=10))
    second = core.decide(Request("/v1/chat/completions", "r2", "Bearer k", estimate=E(), body_bytes=10))
    assert not isinstance(first, Held) and first.decision.admitted
    assert not isinstance(second, Held) and second.decision.rejection is not None
    assert second.decision.rejection.reason == "tenant-concurrency"
    core.reconfigure(cfg)  # and a reload does not wipe it
    third = core.decide(Request("/v1/chat/completions", "r3", "Bearer k", estimate=E(), body_bytes=10))
    assert not isinstance(third, Held) and third.decision.rejection is not None


def test_half_a_request_per_minute_admits_one_then_429() -> None:
    """requests_per_minute: 0.5 without a burst raised on every request (a bucket smaller than one)."""
    clock = FakeClock()
    cfg = parse_config({"tenants": [{"name": "t", "requests_per_minute": 0.5}]})
    a = Admission(cfg, clock, random.Random(1))
    assert a.decide(cfg.tenant("t"), "r1", E(), 10).admitted
    r = a.decide(cfg.tenant("t"), "r2", E(), 10).rejection
    assert r is not None and r.status == 429 and r.retry_after is not None and 60 < r.retry_after < 150
    clock.advance(121.0)
    assert a.decide(cfg.tenant("t"), "r3", E(), 10).admitted


def test_shrinking_the_queue_below_its_depth_neither_asserts_nor_leaks() -> None:
    clock = FakeClock()
    doc: dict[str, Any] = {"tenants": [{"name": "b", "tier": "batch"}, {"name": "i", "tier": "interactive"}],
                           "queue": {"max_size": 6}}
    cfg = parse_config(doc)
    a = Admission(cfg, clock, random.Random(1))
    a.pick = lambda *args: Placed(None, "fleet-kv", 1.0)
    for i in range(6):
        assert a.decide(cfg.tenant("b"), f"r{i}", E(), 10).queued
    small = parse_config({**doc, "queue": {"max_size": 2}})
    a.reconfigure(small)
    d = a.decide(small.tenant("i"), "x", E(), 10)  # would have evicted one and asserted on push
    assert d.rejection is not None and d.rejection.reason == "queue-full"
    assert a.queued == 6
    state = a.tenant_state("i")
    assert state is not None and state.inflight == 0  # nothing held for the refused one


def test_removing_tenants_with_requests_in_flight_keeps_every_gauge_right() -> None:
    from prometheus_client import generate_latest

    clock = FakeClock()
    doc = {"tenants": [{"name": n, "api_key_sha256": [hash_key(n)]} for n in ("a", "b")]}
    core = Core(parse_config(doc), clock, log=null_logger())
    answers = [core.decide(Request("/v1/chat/completions", f"r{i}", f"Bearer {n}", estimate=E(), body_bytes=10))
               for i, n in enumerate(["a", "a", "b", "b", "b"])]
    core.reconfigure(parse_config({"tenants": [doc["tenants"][0]]}))  # b removed, three in flight
    for i, ans in enumerate(answers):
        assert not isinstance(ans, Held) and ans.ticket is not None
        core.ended(Ended(ans.ticket, f"r{i}", 200, None, upstream_answered=True))
    text = generate_latest(core.stats.registry).decode()
    gauges = [line for line in text.splitlines() if line.startswith("kvgate_inflight_requests{")]
    assert gauges and all(line.endswith(" 0.0") for line in gauges), gauges  # was other=-5


def _body_message(auth: bytes, request_id: str = "rid-1") -> bytes:
    """A ProcessingRequest as Envoy would send it, with raw bytes in the authorization attribute."""
    good = ep.ProcessingRequest(request_body=ep.HttpBody(body=b"{}", end_of_stream=True))
    attrs = struct_pb2.Struct()
    attrs.update({ATTR_ID: request_id, ATTR_AUTH: "PLACEHOLDER"})
    good.attributes[ATTR_NS].CopyFrom(attrs)
    return good.SerializeToString().replace(b"PLACEHOLDER", auth)


def test_an_authorization_that_is_not_utf8_is_decoded_leniently_and_answered_401() -> None:
    msg = _decode(_body_message(b"Bearer \xff\xfe\xfd\xfc"))  # 11 bytes, like PLACEHOLDER
    assert isinstance(msg, Undecodable)
    assert msg.bad == [ATTR_AUTH] and msg.request_id == "rid-1"
    reply = msg.answer().immediate_response
    assert reply.status.code == 401
    assert json.loads(reply.body)["error"]["code"] == "invalid_api_key"
    assert not isinstance(_decode(_body_message(b"Bearer abcd")), Undecodable)  # 11 bytes too


class _Probe(BaseHTTPRequestHandler):
    docs: dict[str, Any] = {}

    def do_GET(self) -> None:
        body = json.dumps(self.docs[str(self.server.server_address[1])]).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


async def test_one_probe_talking_nonsense_does_not_stop_polling_the_others() -> None:
    """A probe answering {"at": "x"} killed polling for every node: the fleet went dead, every request
    got a capacity 503 and the scaler scaled up."""
    import time

    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _Probe) for _ in range(2)]
    good, bad = (s.server_address[1] for s in servers)
    _Probe.docs = {str(bad): {"at": "x"},
                   str(good): Snapshot(node="g", at=time.time(), ok=True, kv_usage=0.1).to_json()}
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    cfg = parse_config({"nodes": {"static": [{"address": "10.0.0.1:8000", "probe": f"http://127.0.0.1:{good}"},
                                             {"address": "10.0.0.2:8000", "probe": f"http://127.0.0.1:{bad}"}],
                                  "poll_interval_seconds": 0.05}})
    gw = Gateway(cfg)
    task = asyncio.create_task(poll_nodes(gw))
    try:
        await asyncio.sleep(0.6)
        assert not task.done(), "the poller died"
        _Probe.docs[str(good)] = Snapshot(node="g", at=time.time(), ok=True, kv_usage=0.4).to_json()
        await asyncio.sleep(0.4)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for s in servers:
            s.shutdown()
    assert gw.fleet is not None
    g, b = gw.fleet.nodes["10.0.0.1:8000"], gw.fleet.nodes["10.0.0.2:8000"]
    assert g.snapshot is not None and g.snapshot.kv_usage == 0.4  # still polled after the bad answers
    assert b.snapshot is None  # the bad node alone has nothing (it ages to unknown, then dead)


class _Ctx:
    def peer(self) -> str:
        return "ipv4:127.0.0.1:5555"


async def _run_stream(gw: Gateway, msgs: list[ep.ProcessingRequest]) -> list[ep.ProcessingResponse]:
    from ext_proc.server import ExtProcServicer

    async def it() -> Any:
        for m in msgs:
            yield m

    return [r async for r in ExtProcServicer(gw).Process(it(), _Ctx())]  # type: ignore[arg-type]


def _headers(auth: str, eos: bool) -> ep.ProcessingRequest:
    from envoy.config.core.v3 import base_pb2

    hs = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key="authorization", raw_value=auth.encode())])
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hs, end_of_stream=eos))


def _with_attributes(msg: ep.ProcessingRequest, auth: str, request_id: str) -> ep.ProcessingRequest:
    """The request attributes Envoy sends with a stream's first message."""
    attrs = struct_pb2.Struct()
    attrs.update({ATTR_ID: request_id, ATTR_AUTH: auth, "request.path": "/v1/chat/completions"})
    msg.attributes[ATTR_NS].CopyFrom(attrs)
    return msg


def _body(auth: str, body: bytes, request_id: str) -> ep.ProcessingRequest:
    return _with_attributes(ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)),
                            auth, request_id)


def _headers_with_attributes(auth: str, request_id: str) -> ep.ProcessingRequest:
    """What a headers-first Envoy sends: the request attributes come with the first message."""
    return _with_attributes(_headers(auth, False), auth, request_id)


async def test_an_envoy_that_sends_headers_first_still_gets_the_body_decided() -> None:
    """Envoy Gateway sends the headers message before the buffered body: answering the headers must not
    close the stream, or the body would pass undecided (a quota bypass). Its attributes come with the
    headers message."""
    cfg = parse_config({"tenants": [{"name": "t", "api_key_sha256": [hash_key("k")], "max_concurrent": 1}]})
    gw = Gateway(cfg)
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    bare = ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))
    out = await _run_stream(gw, [_headers_with_attributes("Bearer k", "r0"), bare])
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body"]
    assert gw.core.open_leases == 1
    gw.core.ended(Ended(None, "r0", 503))  # (released by id: the id came from the headers message)
    assert gw.core.open_leases == 0
    out = await _run_stream(gw, [_headers("Bearer k", False), _body("Bearer k", body, "r1")])
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body"]
    assert gw.core.open_leases == 1  # the body was decided: the slot is taken
    second = await _run_stream(gw, [_headers("Bearer k", False), _body("Bearer k", body, "r2")])
    assert second[-1].immediate_response.status.code == 429
    # a bodyless request (GET) is decided on its headers and the stream closes
    get = await _run_stream(gw, [_headers("Bearer k", True)])
    assert [r.WhichOneof("response") for r in get] == ["request_headers"]
    refused = await _run_stream(gw, [_headers("Bearer nope", False), _body("Bearer nope", body, "r3")])
    assert len(refused) == 1 and refused[0].immediate_response.status.code == 401


def test_ipv6_addresses_keep_their_brackets() -> None:
    from ext_proc.addresses import join_hostport, split_hostport

    assert join_hostport("::1", 8000) == "[::1]:8000" and join_hostport("10.0.0.1", 8000) == "10.0.0.1:8000"
    assert split_hostport("[::1]:9101") == ("::1", 9101) and split_hostport(":9101") == ("0.0.0.0", 9101)


async def test_a_failing_background_task_restarts_and_only_a_persistent_failure_is_not_serving() -> None:
    from ext_proc.server import TASK_FAILURES, Supervisor

    gw = Gateway(parse_config({}))
    health: list[bool] = []

    async def on_health(ok: bool) -> None:
        health.append(ok)

    sup = Supervisor(gw, on_health, backoff=lambda n: 0.0)
    runs = {"flaky": 0, "broken": 0}

    async def flaky() -> None:
        runs["flaky"] += 1
        if runs["flaky"] < 3:
            raise ValueError("probe said nonsense")
        await asyncio.sleep(3600)

    async def broken() -> None:
        runs["broken"] += 1
        raise RuntimeError("cannot recover")

    sup.start("flaky", flaky)
    await asyncio.sleep(0.05)
    assert runs["flaky"] == 3 and health == []  # restarted twice, then ran on: health untouched
    sup.start("broken", broken)
    for _ in range(200):
        if health:
            break
        await asyncio.sleep(0.01)
    await sup.stop()
    assert runs["broken"] >= TASK_FAILURES and health == [False]  # it kept failing: NOT_SERVING
    from prometheus_client import generate_latest

    text = generate_latest(gw.stats.registry).decode()
    assert 'kvgate_task_restarts_total{task="flaky"} 2.0' in text


def test_a_request_larger_than_every_nodes_kv_cache_is_400_not_a_503() -> None:
    """It can never run anywhere: a 503 queue-timeout would make clients retry it and the scaler buy GPUs."""
    clock = FakeClock()
    cfg = parse_config({"tenants": [{"name": "t", "api_key_sha256": [hash_key("k")]}],
                        "nodes": {"static": [{"address": "10.0.0.1:8000", "probe": "http://p"}]}})
    core = Core(cfg, clock, log=null_logger())
    core.snapshot("10.0.0.1:8000", Snapshot(node="n", at=0, ok=True, kv_usage=0.1, blocks_total=100,
                                            block_size=16), 0.0)  # 1,600 tokens of KV
    big = core.decide(Request("/v1/chat/completions", "r1", "Bearer k", estimate=E(1500, 500), body_bytes=10))
    assert not isinstance(big, Held) and big.reply is not None
    assert big.reply.status == 400 and big.decision.rejection is not None
    assert big.decision.rejection.reason == "context-too-long" and big.decision.rejection.param == "max_tokens"
    fits = core.decide(Request("/v1/chat/completions", "r2", "Bearer k", estimate=E(100, 100), body_bytes=10))
    assert not isinstance(fits, Held) and fits.decision.admitted


def test_an_entry_without_ticket_or_request_id_releases_nothing() -> None:
    core = Core(parse_config({"tenants": [{"name": "t", "api_key_sha256": [hash_key("k")]}]}), FakeClock(),
                log=null_logger())
    for _ in range(2):
        a = core.decide(Request("/v1/chat/completions", "", "Bearer k", estimate=E(), body_bytes=10))
        assert not isinstance(a, Held) and a.decision.admitted
    assert core.ended(Ended(None, "", 503)) is None
    assert core.open_leases == 2


async def test_streams_the_queue_refused_leave_nothing_behind() -> None:
    """A queued request refused by the queue has no lease: its waiter was once found by request id and
    the ticket entry stayed forever — one Future per queue timeout, under overload."""
    cfg = parse_config({"tenants": [{"name": "t", "api_key_sha256": [hash_key("k")], "tier": "interactive"}],
                        "tiers": {"interactive": {"priority": 0, "max_queue_wait_ms": 50}},
                        "nodes": {"static": [{"address": "10.0.0.1:8000", "probe": "http://p"}]}})
    gw = Gateway(cfg)  # the node never reported: nothing can be placed, the request waits its 50 ms
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()

    async def ticker() -> None:
        for _ in range(40):
            await asyncio.sleep(0.01)
            gw.core.tick()
            gw.flush()

    t = asyncio.create_task(ticker())
    out = await _run_stream(gw, [_body("Bearer k", body, "q1")])
    await t
    assert out[-1].immediate_response.status.code == 503
    assert gw._waiters == {} and gw.core.queued == 0 and gw.core.open_leases == 0


def test_a_request_too_large_for_the_admit_threshold_alone_goes_to_an_idle_node() -> None:
    """95k tokens on a 100k-token node with a 0.9 threshold: it fits the cache, never the threshold, so it
    would have waited for a 503 forever; an idle node takes it, a busy one does not."""
    f = fleet(1, kv_admit_threshold=0.9)
    f.on_snapshot("10.0.0.0:8000", snap(0.0, blocks=6250), 0.0)  # 100,000 tokens of KV
    assert f.place(95_000, 90_000, "big", 0.1).node is not None
    assert f.choose(95_000, 0.2).node is None  # not beside another request
    f.completed("10.0.0.0:8000", "big", 95_000, True, 1.0)
    f.on_snapshot("10.0.0.0:8000", snap(0.0, blocks=6250), 1.05)  # the next reading: idle again
    assert f.choose(95_000, 1.1).node is not None
    assert f.choose(101_000, 1.1).node is None  # larger than the cache: never (400 at the core)


def test_an_answer_out_of_the_queue_for_a_request_already_ended_is_released() -> None:
    """The client left while queued and Envoy's log of it arrived before the stream's cancellation: the
    admit out of the queue must not hold the slot until lease_timeout_seconds."""
    clock = FakeClock()
    cfg = parse_config({"tenants": [{"name": "t", "api_key_sha256": [hash_key("k")], "max_concurrent": 1}],
                        "nodes": {"static": [{"address": "10.0.0.1:8000", "probe": "http://p"}]}})
    core = Core(cfg, clock, log=null_logger())
    held = core.decide(Request("/v1/chat/completions", "r1", "Bearer k", estimate=E(), body_bytes=10))
    assert isinstance(held, Held)
    assert core.ended(Ended(None, "r1", 0, disconnected=True)) is None  # logged first: a tombstone
    core.snapshot("10.0.0.1:8000", Snapshot(node="n", at=0, ok=True, kv_usage=0.1, blocks_total=1000,
                                            block_size=16), 0.0)
    [a] = core.answers()
    assert a.held == held.ticket
    assert core.open_leases == 0 and core.admission.tenant_state("t").inflight == 0  # type: ignore[union-attr]
