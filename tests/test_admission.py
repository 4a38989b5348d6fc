import random
from typing import Any

import pytest

from ext_proc.admission import Admission, Placed, Usage
from ext_proc.config import Config, parse_config
from ext_proc.estimate import Estimate
from tests.helpers import FakeClock


def make(cfg: dict[str, Any]) -> tuple[Admission, FakeClock, Config]:
    clock = FakeClock()
    c = parse_config(cfg)
    return Admission(c, clock, random.Random(1)), clock, c


def E(prompt: int = 10, out: int = 10) -> Estimate:
    return Estimate(prompt, out, parsed=True)


def test_concurrency_cap_is_429_and_frees_on_completion() -> None:
    a, _, c = make({"tenants": [{"name": "t", "max_concurrent": 2}]})
    t = c.tenant("t")
    d1, d2 = a.decide(t, "r1", E(), 100), a.decide(t, "r2", E(), 100)
    assert d1.admitted and d2.admitted
    d3 = a.decide(t, "r3", E(), 100)
    assert not d3.admitted and d3.rejection is not None
    assert (d3.rejection.status, d3.rejection.reason, d3.rejection.klass) == (429, "tenant-concurrency", "policy")
    assert d1.lease is not None
    assert a.complete(d1.lease.ticket, Usage(5, 5), responded=True) is not None
    assert a.decide(t, "r4", E(), 100).admitted


def test_release_happens_exactly_once() -> None:
    a, _, c = make({"tenants": [{"name": "t", "max_concurrent": 1}]})
    d = a.decide(c.tenant("t"), "r1", E(), 10)
    assert d.lease is not None
    assert a.complete(d.lease.ticket, None, responded=True) is not None
    assert a.complete(d.lease.ticket, None, responded=True) is None
    state = a.tenant_state("t")
    assert state is not None and state.inflight == 0 and a.inflight == 0


def test_tokens_reserved_up_front_so_concurrent_requests_cannot_overrun() -> None:
    a, _, c = make({"tenants": [{"name": "t", "tokens_per_minute": 60, "token_burst": 100}]})
    t = c.tenant("t")
    admitted = [a.decide(t, f"r{i}", E(20, 20), 10) for i in range(5)]
    # 100 tokens of budget, 40 reserved each: only two fit, however many arrive at once
    assert [d.admitted for d in admitted] == [True, True, False, False, False]
    r = admitted[2].rejection
    assert r is not None and r.reason == "tenant-tokens" and r.status == 429


def test_reconcile_refunds_unused_reservation_and_charges_overrun() -> None:
    a, _, c = make({"tenants": [{"name": "t", "tokens_per_minute": 60, "token_burst": 100}]})
    t = c.tenant("t")
    s = a.tenant_state("t")
    assert s is not None and s.tokens is not None
    d = a.decide(t, "r", E(10, 50), 10)
    assert d.lease is not None
    assert s.tokens.available(a._clock()) == 40
    a.complete(d.lease.ticket, Usage(10, 5), responded=True)
    assert s.tokens.available(a._clock()) == 85
    d = a.decide(t, "r2", E(10, 10), 10)
    assert d.lease is not None
    a.complete(d.lease.ticket, Usage(10, 90), responded=True)  # 80 more than reserved
    assert s.tokens.available(a._clock()) == -15


def test_cut_stream_is_charged_the_reservation_and_errors_nothing() -> None:
    a, _, c = make({"tenants": [{"name": "t", "tokens_per_minute": 60, "token_burst": 100}]})
    s = a.tenant_state("t")
    assert s is not None and s.tokens is not None
    d = a.decide(c.tenant("t"), "r", E(10, 30), 10)
    assert d.lease is not None
    done = a.complete(d.lease.ticket, None, responded=True)
    assert done is not None and done.charged_tokens == 40
    assert s.tokens.available(a._clock()) == 60
    d = a.decide(c.tenant("t"), "r2", E(10, 30), 10)
    assert d.lease is not None
    done = a.complete(d.lease.ticket, None, responded=False)
    assert done is not None and done.charged_tokens == 0
    assert s.tokens.available(a._clock()) == 60


def test_retry_after_is_when_the_bucket_actually_refills() -> None:
    a, clock, c = make({"retry": {"jitter": 0.2}, "tenants": [{"name": "t", "tokens_per_minute": 600,
                                                                 "token_burst": 100}]})
    t = c.tenant("t")
    assert a.decide(t, "r1", E(50, 50), 10).admitted
    d = a.decide(t, "r2", E(25, 25), 10)  # needs 50, has 0, refills 10/s -> 5 s
    assert d.rejection is not None and d.rejection.retry_after is not None
    assert 5.0 <= d.rejection.retry_after <= 6.0
    assert d.rejection.tokens is not None and d.rejection.tokens.limit == 600
    assert d.rejection.tokens.remaining == 0
    clock.advance(5.0)
    assert a.decide(t, "r3", E(25, 25), 10).admitted


def test_concurrency_retry_after_follows_observed_durations() -> None:
    a, clock, c = make({"retry": {"jitter": 0.0}, "tenants": [{"name": "t", "max_concurrent": 1}]})
    t = c.tenant("t")
    for i in range(10):  # learn: requests take 3 s
        d = a.decide(t, f"w{i}", E(), 10)
        assert d.lease is not None
        clock.advance(3.0)
        a.complete(d.lease.ticket, Usage(1, 1), responded=True)
    assert a.decide(t, "busy", E(), 10).admitted
    clock.advance(1.0)
    d = a.decide(t, "r", E(), 10)
    assert d.rejection is not None
    assert d.rejection.retry_after == pytest.approx(2.0)


def test_requests_per_minute() -> None:
    a, clock, c = make({"tenants": [{"name": "t", "requests_per_minute": 60, "request_burst": 2}]})
    t = c.tenant("t")
    assert a.decide(t, "1", E(), 1).admitted and a.decide(t, "2", E(), 1).admitted
    d = a.decide(t, "3", E(), 1)
    assert d.rejection is not None and d.rejection.reason == "tenant-requests"
    assert d.rejection.requests is not None and d.rejection.requests.limit == 60
    clock.advance(1.0)
    assert a.decide(t, "4", E(), 1).admitted


def test_policy_is_checked_before_capacity() -> None:
    a, _, c = make({"fleet": {"max_inflight": 1}, "queue": {"enabled": False},
                    "tenants": [{"name": "t", "max_concurrent": 1}, {"name": "u"}]})
    assert a.decide(c.tenant("t"), "1", E(), 1).admitted
    over_quota = a.decide(c.tenant("t"), "2", E(), 1)
    assert over_quota.rejection is not None and over_quota.rejection.status == 429
    fleet_full = a.decide(c.tenant("u"), "3", E(), 1)
    assert fleet_full.rejection is not None
    assert (fleet_full.rejection.status, fleet_full.rejection.reason, fleet_full.rejection.klass) == (
        503, "fleet-inflight", "capacity")
    assert fleet_full.rejection.retry_after is not None and fleet_full.rejection.retry_after > 0


@pytest.mark.parametrize(("quota", "est", "body", "status", "reason"), [
    ({"max_prompt_tokens": 100}, E(101, 1), 10, 400, "prompt-too-long"),
    ({"max_context_tokens": 100}, E(60, 41), 10, 400, "context-too-long"),
    ({"tokens_per_minute": 100}, E(60, 41), 10, 400, "exceeds-token-budget"),
    ({}, E(1, 1), 5 * 1024 * 1024, 413, "body-too-large"),
])
def test_requests_that_can_never_fit(quota: dict[str, Any], est: Estimate, body: int, status: int,
                                     reason: str) -> None:
    a, _, c = make({"tenants": [{"name": "t", **quota}]})
    d = a.decide(c.tenant("t"), "r", est, body)
    assert d.rejection is not None
    assert (d.rejection.status, d.rejection.reason, d.rejection.klass) == (status, reason, "invalid")
    assert d.rejection.retry_after is None


def test_shadow_mode_admits_counts_and_spends_nothing() -> None:
    a, _, c = make({"tenants": [{"name": "t", "max_concurrent": 1, "mode": "shadow"},
                                {"name": "e", "max_concurrent": 1}]})
    t = c.tenant("t")
    first = a.decide(t, "1", E(), 1)
    second = a.decide(t, "2", E(), 1)
    assert first.admitted and not first.shadow
    assert second.admitted and second.shadow
    assert second.rejection is not None and second.rejection.reason == "tenant-concurrency"
    state = a.tenant_state("t")
    assert state is not None and state.inflight == 1  # the shadow admit holds no slot
    assert second.lease is not None
    a.complete(second.lease.ticket, None, responded=True)
    assert state.inflight == 1
    # a tenant without the override still enforces
    e = c.tenant("e")
    assert a.decide(e, "3", E(), 1).admitted
    assert not a.decide(e, "4", E(), 1).admitted


def test_global_shadow_mode_lets_unknown_keys_through_and_counts_them() -> None:
    a, _, _ = make({"mode": "shadow"})
    d = a.decide(None, "r", E(), 1)
    assert d.admitted and d.shadow and d.rejection is not None and d.rejection.status == 401
    a2, _, _ = make({})
    d2 = a2.decide(None, "r", E(), 1)
    assert not d2.admitted and d2.rejection is not None and d2.rejection.reason == "unknown-key"


def test_uncertain_lease_is_released_by_request_id() -> None:
    """An admit Envoy never applied: the access log names the request id, not the ticket (the gateway
    core keeps that index now; Admission's own copy of it is gone)."""
    from ext_proc.core import Core, Ended, Held, Request, null_logger
    from ext_proc.identity import hash_key

    core = Core(parse_config({"tenants": [{"name": "t", "max_concurrent": 1, "api_key_sha256": [hash_key("k")]}]}),
                FakeClock(), log=null_logger())
    d = core.decide(Request("/v1/chat/completions", "req-1", "Bearer k", estimate=E(), body_bytes=1))
    assert not isinstance(d, Held) and d.ticket is not None
    assert core.ended(Ended(None, "other")) is None
    done = core.ended(Ended(None, "req-1"))
    assert done is not None and done.charged_tokens == 0
    assert core.admission.inflight == 0
    assert core.admission.complete(d.ticket, None, responded=True) is None


def test_lost_completions_are_reclaimed_after_the_lease_timeout() -> None:
    a, clock, c = make({"server": {"lease_timeout_seconds": 60}, "tenants": [{"name": "t", "max_concurrent": 1}]})
    d = a.decide(c.tenant("t"), "r", E(), 1)
    assert d.lease is not None
    clock.advance(59)
    assert a.reclaim_expired() == []
    clock.advance(2)
    assert [x.lease.ticket for x in a.reclaim_expired()] == [d.lease.ticket]
    assert a.inflight == 0 and a.open_leases == 0


def test_reload_keeps_in_flight_and_spent_budget() -> None:
    a, _, c = make({"tenants": [{"name": "t", "max_concurrent": 3, "tokens_per_minute": 100}]})
    d = a.decide(c.tenant("t"), "r", E(20, 20), 1)
    assert d.lease is not None
    new = parse_config({"tenants": [{"name": "t", "max_concurrent": 1, "tokens_per_minute": 100}, {"name": "n"}]})
    a.reconfigure(new)
    state = a.tenant_state("t")
    assert state is not None and state.inflight == 1
    assert state.tokens is not None and state.tokens.available(a._clock()) == 60
    blocked = a.decide(new.tenant("t"), "r2", E(1, 1), 1)
    assert blocked.rejection is not None and blocked.rejection.reason == "tenant-concurrency"
    a.complete(d.lease.ticket, Usage(1, 1), responded=True)
    assert state.inflight == 0
    assert a.decide(new.tenant("n"), "r3", E(), 1).admitted


def test_node_choice_is_the_last_check_and_its_refusal_is_a_503() -> None:
    a, _, c = make({"queue": {"enabled": False},
                    "tenants": [{"name": "t", "max_concurrent": 1}, {"name": "s", "mode": "shadow"}]})
    calls: list[bool] = []

    def full(est: Estimate, shadow: bool, ticket: str, tier: str, waited: float, guarded: bool = False) -> Placed:
        calls.append(shadow)
        return Placed("10.0.0.9:8000") if shadow else Placed(None, "fleet-kv", 4.0)

    a.pick = full
    d = a.decide(c.tenant("t"), "r", E(), 1)
    assert d.rejection is not None and (d.rejection.status, d.rejection.reason, d.rejection.klass) == (
        503, "fleet-kv", "capacity")
    assert d.rejection.retry_after is not None and 4.0 <= d.rejection.retry_after <= 4.8
    assert a.inflight == 0 and calls == [False]
    a.pick = lambda est, shadow, ticket, tier, waited, guarded=False: Placed("10.0.0.1:8000")
    ok = a.decide(c.tenant("t"), "r2", E(), 1)
    assert ok.lease is not None and ok.lease.node == "10.0.0.1:8000"
    calls.clear()
    a.pick = full
    over = a.decide(c.tenant("t"), "r3", E(), 1)  # over its quota: 429, the picker is not asked
    assert over.rejection is not None and over.rejection.status == 429 and calls == []
    sh = a.decide(c.tenant("s"), "r4", E(), 1)  # shadow: counted as a 503, sent to a node anyway
    assert sh.shadow and sh.rejection is not None and sh.rejection.reason == "fleet-kv"
    assert sh.lease is not None and sh.lease.node == "10.0.0.9:8000" and calls == [False, True]
