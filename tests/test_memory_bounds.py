"""Bounded memory (issue 29): what clients and churn can make kvgate remember has a bound that holds
whatever the traffic — model names, ``GET /v1/models/{id}``, the prefix index, tombstones, a silent
node's bookings, breaker series and node indexes of pods that left."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from ext_proc.bounds import Expiring, LruCache, key_bytes, shown
from ext_proc.config import ConfigError, parse_config
from ext_proc.core import MAX_TOMBSTONES, Answer, Core, Ended, null_logger
from ext_proc.identity import hash_key
from ext_proc.pools import _CACHE_BYTES, _CACHE_MAX
from ext_proc.prefix import PrefixIndex
from gpu_probe.snapshot import Snapshot
from tests.helpers import FakeClock
from tests.test_nodes import feed, fleet
from tests.test_pools import ask, core_and_clock, fresh, nodes, pools_config

# -- model names (bug 5) -------------------------------------------------------------------------


def test_a_model_name_longer_than_the_cap_is_400_and_reaches_no_cache() -> None:
    """The docs' own pattern pool (``llama-8b-*``) matched a 1 MB name: admitted, and the name kept
    in the router's caches (200 of them took RSS 157 → 331 MiB)."""
    core, _ = core_and_clock()
    a = ask(core, "llama-8b-" + "x" * 1_000_000, key="k-intern")
    assert isinstance(a, Answer) and a.reply is not None and a.reply.status == 400
    err = orjson.loads(a.reply.body)["error"]
    assert err["param"] == "model" and err["code"] == "invalid_value" and "256" in err["message"]
    assert len(a.reply.body) < 500, "the refusal does not echo the name"
    assert not list(core.router._cache) and not list(core.router._allowed)
    ok = ask(core, "llama-8b-" + "x" * (256 - 9), key="k-intern", rid="r2")
    assert isinstance(ok, Answer) and ok.reply is None, "a name of exactly the cap is served"


def test_the_router_caches_are_bounded_in_bytes_as_well_as_in_entries() -> None:
    """The router itself never holds more than its byte budget of names, however long they are (a
    caller that reaches it without the estimator's cap: a reload raising the cap, a future caller)."""
    core, _ = core_and_clock()
    r = core.router
    tenant = core.config.tenants[1]  # intern: models ["llama-8b*"]
    for i in range(200):
        name = f"llama-8b-{i}-" + "x" * 100_000
        assert r.route(name) is not None and r.allowed(tenant, name)
    for cache in (r._cache, r._allowed):
        assert sum(key_bytes(k) for k in cache) <= _CACHE_BYTES
        assert 0 < len(cache) <= _CACHE_MAX
    for i in range(3 * _CACHE_MAX):
        r.route(f"llama-8b-{i}")
    assert len(r._cache) == _CACHE_MAX


def test_a_404_quotes_at_most_a_short_escaped_prefix_of_the_name() -> None:
    core, _ = core_and_clock()
    a = ask(core, "gpt-\x1b[31m" + "y" * 240)
    assert isinstance(a, Answer) and a.reply is not None and a.reply.status == 404
    msg = orjson.loads(a.reply.body)["error"]["message"]
    assert len(msg) < 200 and "\x1b" not in msg and "249 characters" in msg
    short = ask(core, "gpt-5", rid="r2")
    assert isinstance(short, Answer) and short.reply is not None
    assert "'gpt-5'" in orjson.loads(short.reply.body)["error"]["message"], "a short name is quoted whole"


def test_with_a_larger_cap_a_404_still_does_not_echo_a_39_mb_name() -> None:
    core, _ = core_and_clock(pools_config(limits={"max_model_name_chars": 8_000_000}))
    a = ask(core, "gpt-" + "y" * 3_900_000)
    assert isinstance(a, Answer) and a.reply is not None and a.reply.status == 404 and len(a.reply.body) < 300


def test_a_model_a_tenant_may_not_use_is_quoted_short_too() -> None:
    cfg = pools_config(tenants=[{"name": "x", "api_key_sha256": [hash_key("k-x")], "models": ["llama-70b"]}])
    core, _ = core_and_clock(cfg)
    a = ask(core, "llama-8b-" + "z" * 240, key="k-x")
    assert isinstance(a, Answer) and a.reply is not None and a.reply.status == 403
    err = orjson.loads(a.reply.body)["error"]
    assert err["code"] == "model_not_allowed" and len(err["message"]) < 200


def test_the_name_cap_is_a_setting_whose_error_names_the_field() -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"limits": {"max_model_name_chars": 3}})
    assert "limits.max_model_name_chars" in str(e.value)
    assert parse_config({}).limits.max_model_name_chars == 256


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300), st.integers(min_value=1, max_value=80))
def test_shown_is_short_and_escaped(name: str, limit: int) -> None:
    out = shown(name, limit)
    assert len(out) <= 10 * limit + 40 and all(c.isprintable() for c in out)
    if len(name) <= limit:
        assert out == repr(name)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcdefgh"), st.integers(0, 300)), max_size=200))
def test_an_lru_cache_never_exceeds_its_bounds_and_keeps_the_most_recent(ops: list[tuple[str, int]]) -> None:
    c: LruCache[str, int] = LruCache(4, 400)
    for i, (k, n) in enumerate(ops):
        key = k * n
        c.put(key, i)
        assert len(c) <= 4 and c.nbytes <= 400 and c.nbytes == sum(key_bytes(x) for x in c)
        if key_bytes(key) <= 400:
            assert c.get(key) == i, "the entry just put is kept (it is the most recent)"


def test_an_lru_cache_evicts_the_least_recently_used() -> None:
    c: LruCache[str, int] = LruCache(3, 10_000)
    for k in "abc":
        c.put(k, 0)
    assert c.get("a") == 0
    c.put("d", 0)
    assert set(c) == {"a", "c", "d"}, "b was the least recently used"


# -- GET /v1/models/{id} (bug 6) ------------------------------------------------------------------


def _slash_pools() -> Any:
    return pools_config(pools=[
        {"name": "big", "models": ["meta-llama/Llama-3.1-70B"], "nodes": nodes(["10.2.0.1:8000"])},
        {"name": "small", "models": ["llama-8b", "llama-8b-*"], "nodes": nodes(["10.1.0.1:8000", "10.1.0.2:8000"])},
    ], tenants=[{"name": "acme", "api_key_sha256": [hash_key("k-acme")]}])


def test_retrieving_a_model_whose_id_has_a_slash_percent_encoded() -> None:
    """The openai SDK's ``models.retrieve("meta-llama/Llama-3.1-70B")`` sends the slash as ``%2F``."""
    core, _ = core_and_clock(_slash_pools())
    listed = core.headers("Bearer k-acme", path="/v1/models")
    assert listed.reply is not None
    ids = [m["id"] for m in orjson.loads(listed.reply.body)["data"]]
    assert "meta-llama/Llama-3.1-70B" in ids
    for path in ("/v1/models/meta-llama%2FLlama-3.1-70B", "/v1/models/meta-llama%2fLlama-3.1-70B",
                 "/v1/models/meta-llama/Llama-3.1-70B"):
        a = core.headers("Bearer k-acme", path=path)
        assert a.reply is not None and a.reply.status == 200, path
        assert orjson.loads(a.reply.body)["id"] == "meta-llama/Llama-3.1-70B"
    twice = core.headers("Bearer k-acme", path="/v1/models/meta-llama%252FLlama-3.1-70B")
    assert twice.reply is not None and twice.reply.status == 404, "decoded once: %25 is a literal %"
    pattern = core.headers("Bearer k-acme", path="/v1/models/llama-8b-%41")
    assert pattern.reply is not None and orjson.loads(pattern.reply.body)["id"] == "llama-8b-A"


def test_retrieving_a_model_id_longer_than_the_cap_is_400() -> None:
    core, _ = core_and_clock(_slash_pools())
    for raw in ("llama-8b-" + "x" * 300, "llama-8b-" + "%78" * 300):
        a = core.headers("Bearer k-acme", path="/v1/models/" + raw)
        assert a.reply is not None and a.reply.status == 400
        err = orjson.loads(a.reply.body)["error"]
        assert err["param"] == "model" and len(a.reply.body) < 400
    assert not list(core.router._cache)


# -- tombstones ----------------------------------------------------------------------------------


def test_expiring_keys_go_after_their_ttl_and_beyond_the_count_oldest_first() -> None:
    e: Expiring[str] = Expiring(60.0, 3)
    for i, k in enumerate("abcd"):
        e.add(k, float(i))
    assert "a" not in e and {"b", "c", "d"} == {k for k in "abcd" if k in e}
    e.add("x", 61.5)
    assert "b" not in e and "c" in e, "b (at 1) expired at 61; c (at 2) lives until 62"
    e.sweep(1_000.0)
    assert not e and len(e) == 0


# -- the prefix index (bug 9) --------------------------------------------------------------------


class _Unswept(PrefixIndex):
    """The index as it was: no global cap, nothing swept (expired blocks only ignored by ``match``)."""

    def trim(self, now: float, sweep: int) -> None:
        return None


def _pairs(idx: PrefixIndex) -> int:
    return sum(len(h) for h in idx._holders.values())


def test_the_prefix_index_holds_at_most_max_blocks_across_nodes_oldest_first() -> None:
    """10,000 blocks a node by default, and nothing freed but by a match: ~150 nodes of varied traffic
    filled the chart's 512 Mi. Now the pool's whole index is capped, the least recently sent go first."""
    f = fleet(200, prefix={"max_blocks": 5_000})
    idx = f.prefix
    assert idx.max_total == 5_000
    rng = random.Random(5)
    now = 0.0
    for _ in range(1_000):
        now += 0.01
        node = f"10.0.0.{rng.randrange(200)}:8000"
        idx.record(node, tuple(rng.getrandbits(60) for _ in range(32)), now)
        assert len(idx) <= 5_000 and len(idx) == _pairs(idx) == sum(len(q) for q in idx._lru.values())
    oldest = min(at for h in idx._holders.values() for at in h.values())
    assert oldest > 0.01 * (1_000 - 5_000 / 32 - 2), "what is kept is the most recently sent"
    f.reconfigure(f.cfg.model_copy(update={"prefix": f.cfg.prefix.model_copy(update={"max_blocks": 100})}))
    idx.record("10.0.0.1:8000", (1, 2, 3), now + 1)
    assert len(idx) <= 100, "a lower cap after a reload holds from the next record"


def test_expired_blocks_are_swept_as_new_ones_come_without_a_match() -> None:
    idx = PrefixIndex(10_000, 600.0)
    for i in range(100):
        idx.record("a", tuple(range(i * 32, i * 32 + 32)), float(i))
    assert len(idx) == 3_200
    for i in range(200):
        idx.record("b", (10**9 + i,), 700.0 + i)
    assert len(idx) == 200 and not idx._lru["a"], "a's blocks expired and were swept by b's records"
    assert _pairs(idx) == 200


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(1, 6), st.floats(0, 40),
                          st.booleans()), max_size=80))
def test_sweeping_changes_no_match_and_the_count_stays_exact(ops: list[tuple[int, int, int, float, bool]]) -> None:
    """Sweeping expired blocks frees memory only: every match is the same as without it; with a cap
    the index never holds more than it, and its count is the blocks it holds."""
    swept, unswept = PrefixIndex(6, 30.0, 10_000), _Unswept(6, 30.0)
    capped = PrefixIndex(6, 30.0, 12)
    now = 0.0
    for node, doc, length, dt, forget in ops:
        now += dt
        chain = tuple(hash((doc, i)) for i in range(length))  # (a block's key covers all before it)
        for idx in (swept, unswept, capped):
            if forget:
                idx.forget(f"n{node}")
            else:
                idx.record(f"n{node}", chain, now)
        assert swept.match(chain, now) == unswept.match(chain, now)
        assert swept.match(chain, now, among=["n0", "n3"]) == unswept.match(chain, now, among=["n0", "n3"])
        assert len(capped) <= 12 and len(capped) == _pairs(capped)
        assert len(swept) == _pairs(swept)
        for idx in (swept, capped):  # what a node holds of a chain is still one unbroken run from its start
            for n, held in idx.match(chain, now).items():
                assert all(n in idx._holders.get(h, {}) for h in chain[:held])


def test_tombstones_are_bounded_in_count_the_newest_kept() -> None:
    """One per ticketless access-log entry (every client that leaves before its decision, on every
    replica): without a count bound 10,000 disconnects a second held 600,000 for the minute."""
    core, clock = core_and_clock()
    for i in range(MAX_TOMBSTONES + 5_000):
        core.ended(Ended(None, f"gone-{i}", disconnected=True))
        if i % 1_000 == 0:
            clock.advance(0.01)
    assert len(core._tombstones) <= MAX_TOMBSTONES
    late = ask(core, "llama-8b", rid=f"gone-{MAX_TOMBSTONES + 4_999}")
    assert isinstance(late, Answer) and late.decision.lease is None, "a recent tombstone still grants nothing"
    assert core.open_leases == 0


def test_a_node_that_gives_no_readings_keeps_no_more_than_its_dead_after_of_bookings() -> None:
    """``Node.pending`` emptied only at a reading: another replica's dispatches booked on a node that
    gave none grew it without end."""
    f = fleet(2)
    feed(f, 0.0, 0.1, 0.1)
    n = f.nodes["10.0.0.0:8000"]
    for i in range(10_000):
        f.booked_elsewhere(n.address, 100, 50, 0, 1.0 + i * 0.1)
    horizon = f.cfg.dead_after_seconds / 0.1 + 1
    assert len(n.pending) <= horizon and n.pending_tokens == 100 * len(n.pending)
    assert n.pending_prompt == 50 * len(n.pending)


def test_a_live_nodes_bookings_are_not_aged_out() -> None:
    f = fleet(2)
    for i in range(100):
        now = i * 1.0
        feed(f, now - 0.5 if i else 0.0, 0.1, 0.1)  # a reading every second, half a second old
        f.booked_elsewhere("10.0.0.0:8000", 100, 50, 0, now)
    assert len(f.nodes["10.0.0.0:8000"].pending) == 1, "what the last reading could not show"


def test_nodes_that_leave_take_their_breaker_series_and_index_entries_with_them() -> None:
    a, b = "10.9.0.1:8000", "10.9.0.2:8000"
    clock = FakeClock()
    core = Core(parse_config({"tenants": [{"name": "t", "api_key_sha256": [hash_key("k-t")]}],
                              "nodes": nodes([a, b])}), clock, log=null_logger())
    fresh(core, clock, [a, b])
    clock.advance(1.0)
    core.snapshot(a, Snapshot(node=a, at=clock(), ok=True, kv_usage=0.99, blocks_total=20000, block_size=16,
                              waiting=0.0, running=0.0))
    text = generate_latest(core.stats.registry).decode()
    assert f'kvgate_node_breaker_transitions_total{{from="closed",node="{a}"' in text, "a's breaker opened"
    for i in range(300):  # pods replaced under new addresses, as DNS discovery sees them
        core.set_nodes([(b, f"http://{b}", None), (f"10.8.{i // 200}.{i % 200}:8000", "http://p", None)])
    text = generate_latest(core.stats.registry).decode()
    assert f'node="{a}"' not in text
    assert set(core._fleet_of) == {b, "10.8.1.99:8000"}
    core.reconfigure(parse_config({"tenants": [{"name": "t", "api_key_sha256": [hash_key("k-t")]}],
                                   "nodes": nodes(["10.7.0.1:8000"])}))
    assert set(core._fleet_of) == {"10.7.0.1:8000"}


def test_an_unauthenticated_end_leaves_no_tombstone_while_enforcing() -> None:
    """A tombstone exists so that a decision still on its way grants nothing: a caller whose key names
    no tenant is refused 401 by that decision anyway, so its end (a client that left before its body
    was read) needs none — and is not forwarded to every replica."""
    core, _ = core_and_clock()
    core.ended(Ended(None, "anon-1", disconnected=True, credentials=(None, None)))
    core.ended(Ended(None, "anon-2", disconnected=True, credentials=("Bearer not-a-key", None)))
    core.ended(Ended(None, "anon-3", disconnected=True, credentials=("Basic Zm9v", None)))
    assert not core.tombstoned("anon-1") and not core.tombstoned("anon-2") and not core.tombstoned("anon-3")
    late = ask(core, "llama-8b", key="not-a-key", rid="anon-2")
    assert isinstance(late, Answer) and late.reply is not None and late.reply.status == 401
    core.ended(Ended(None, "known", disconnected=True, credentials=("Bearer k-acme", None)))
    core.ended(Ended(None, "unknown-credentials", disconnected=True))
    assert core.tombstoned("known") and core.tombstoned("unknown-credentials"), "what may admit keeps one"
    assert isinstance(a := ask(core, "llama-8b", rid="known"), Answer) and a.decision.lease is None


def test_without_enforcement_an_unauthenticated_end_still_leaves_a_tombstone() -> None:
    core, _ = core_and_clock(pools_config(mode="shadow"))
    core.ended(Ended(None, "anon", disconnected=True, credentials=(None, None)))
    assert core.tombstoned("anon"), "shadow mode admits callers without a key: their decision may hold a lease"


def test_the_access_log_names_the_headers_it_sends_and_the_server_reads_them() -> None:
    from envoy.data.accesslog.v3 import accesslog_pb2

    from ext_proc.server import Gateway, logged_headers
    from kvgate.envoy_config import EnvoyParams, access_log_for

    al = access_log_for(EnvoyParams(trusted_header="X-Tenant"))["typed_config"]
    assert al["additional_request_headers_to_log"] == ["authorization", "x-tenant"]
    assert logged_headers(al["common_config"]["log_name"]) == {"authorization", "x-tenant"}
    assert logged_headers("kvgate") == frozenset(), "an older Envoy config: credentials unknown"

    gw = Gateway(pools_config())
    entry = accesslog_pb2.HTTPAccessLogEntry()
    entry.request.request_id = "anon"
    entry.common_properties.response_flags.downstream_connection_termination = True
    entry.request.request_headers["authorization"] = "Bearer nobody"
    gw.on_access_log(entry, logged_headers("kvgate;headers=authorization"))
    assert not gw.core.tombstoned("anon")
    gw.on_access_log(entry, frozenset())  # the same entry from an Envoy that does not say what it logs
    assert gw.core.tombstoned("anon")


def test_only_a_tombstone_is_forwarded_to_the_other_replicas() -> None:
    """With several replicas a ticketless end goes to every replica (the decision may be another's):
    not when it left none here — an unauthenticated caller's end used to reach every replica."""
    from envoy.data.accesslog.v3 import accesslog_pb2

    from ext_proc.server import Gateway

    class Store:
        def __init__(self) -> None:
            self.sent: list[str] = []

        def forward(self, e: Ended, tenant: str = "", budget: str = "") -> None:
            self.sent.append(e.request_id)

    gw = Gateway(pools_config())
    store = Store()
    gw.store = store  # type: ignore[assignment]
    for rid, key in (("anon", "Bearer nobody"), ("acme", "Bearer k-acme")):
        entry = accesslog_pb2.HTTPAccessLogEntry()
        entry.request.request_id = rid
        entry.common_properties.response_flags.downstream_connection_termination = True
        entry.request.request_headers["authorization"] = key
        gw.on_access_log(entry, frozenset({"authorization"}))
    assert store.sent == ["acme"]


def test_a_pool_model_longer_than_the_name_cap_is_a_config_error_naming_it() -> None:
    pool = {"name": "p", "models": ["m-*", "m" * 40], "nodes": nodes(["10.1.0.1:8000"])}
    with pytest.raises(ConfigError) as e:
        pools_config(pools=[pool], tenants=[], limits={"max_model_name_chars": 32})
    assert "pools[0].models[1]" in str(e.value) and "limits.max_model_name_chars" in str(e.value)
    pools_config(pools=[pool], tenants=[], limits={"max_model_name_chars": 40})


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.floats(0, 30)), max_size=100))
@example([(0, 5.120010564860823e-249), (1, 20.0)])  # an age of exactly ttl after rounding: it goes
def test_expiring_holds_at_most_its_count_and_nothing_older_than_its_ttl(ops: list[tuple[int, float]]) -> None:
    e: Expiring[int] = Expiring(20.0, 8)
    now, added = 0.0, {}
    for key, dt in ops:
        now += dt
        e.add(key, now)
        added.pop(key, None)  # (added again: the newest, also among equal times)
        added[key] = now
        kept = [k for k in added if k in e]
        assert len(e) == len(kept) <= 8 and key in e, "the newest is always kept"
        assert all(now - added[k] < 20.0 for k in kept)
        newest = sorted(added, key=lambda k: added[k])[-len(kept):]
        assert set(kept) == set(newest), "what goes is always the oldest"


def test_a_model_id_longer_than_the_cap_is_400_with_one_pool_too() -> None:
    """(red team) With a single pool GET /v1/models/{id} goes to the node: the cap did not apply."""
    from ext_proc.config import parse_config
    from ext_proc.core import Core, null_logger

    core = Core(parse_config({"tenants": [{"name": "acme", "api_key_sha256": [hash_key("k-acme")]}]}),
                lambda: 0.0, log=null_logger())
    a = core.headers("Bearer k-acme", path="/v1/models/" + "x" * 300)
    assert a.reply is not None and a.reply.status == 400
    ok = core.headers("Bearer k-acme", path="/v1/models/llama-8b")
    assert ok.reply is None  # a name within the cap: the node answers it
