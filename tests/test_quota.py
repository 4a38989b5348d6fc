"""The quota seam (``ext_proc/quota.py``) as the decision sees it: one replica's own quota, leased
from the store, or a local split while the store is away — with no I/O (the store's answers are fed in
as ``store.py`` feeds them). What it guarantees: a 429 only when the tenant is over its quota
fleet-wide; a replica that could not ask the store answers 503 ``quota-unavailable`` (gateway class,
with Retry-After) instead; a request is invalid (400) only against the fleet's whole budget."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ext_proc.admission import Admission
from ext_proc.config import Config, parse_config
from ext_proc.estimate import Estimate
from ext_proc.quota import LeasedQuota, LocalQuota, SplitQuota
from ext_proc.reasons import REASONS
from tests.helpers import FakeClock

ME = "0a0a0a0a"


def make(tenant: dict[str, Any], shared: bool = True) -> tuple[Admission, FakeClock, Config]:
    clock = FakeClock()
    doc: dict[str, Any] = {"tenants": [{"name": "t", **tenant}]}
    if shared:
        doc["store"] = {"redis": {"url": "redis://127.0.0.1:1/0", "expected_replicas": 3}}
    c = parse_config(doc)
    return Admission(c, clock, random.Random(1)), clock, c


def E(prompt: int = 10, out: int = 10) -> Estimate:
    return Estimate(prompt, out, parsed=True)


def test_the_mode_picks_the_quota() -> None:
    a, _, _ = make({"max_concurrent": 2}, shared=False)
    assert isinstance(a.quota, LocalQuota)
    a, _, _ = make({"max_concurrent": 2})
    assert isinstance(a.quota, LeasedQuota) and a.quota is a.leased and a.local_split == 0
    a.share_local([ME], ME, {})
    assert isinstance(a.quota, SplitQuota) and a.local_split == 1
    assert a.share_rejoin() == {} and a.quota is a.leased


def test_the_new_reason_is_a_retryable_gateway_503() -> None:
    r = REASONS["quota-unavailable"]
    assert (r.status, r.klass) == (503, "gateway")


def test_a_request_fitting_the_fleets_budget_is_not_invalid_on_a_split() -> None:
    """Issue 28 §2: on a split of 3 each replica's bucket holds a third of the burst; a request larger
    than the third but within the whole budget was a 400 "can never be admitted" (no client retries a
    400). Now: 503 ``quota-unavailable``, with a Retry-After."""
    a, _, c = make({"tokens_per_minute": 600, "token_burst": 300})
    a.share_local([ME, "!expected-0", "!expected-1"], ME, {})
    d = a.decide(c.tenant("t"), "r1", E(100, 50), 10)  # 150 tokens: over the 100 of the slice, within 300
    assert d.rejection is not None
    assert (d.rejection.status, d.rejection.reason) == (503, "quota-unavailable")
    assert d.rejection.retry_after is not None and d.rejection.retry_after > 0
    d = a.decide(c.tenant("t"), "r2", E(200, 150), 10)  # 350: over the whole budget, fleet-wide
    assert d.rejection is not None and d.rejection.reason == "exceeds-token-budget"


def test_a_split_says_429_only_for_what_this_replica_alone_proves() -> None:
    a, _, c = make({"max_concurrent": 3})
    a.share_local([ME, "!expected-0", "!expected-1"], ME, {})
    t = c.tenant("t")
    assert a.decide(t, "r1", E(), 10).admitted  # its split: 1 of 3
    d = a.decide(t, "r2", E(), 10)
    assert d.rejection is not None and d.rejection.reason == "quota-unavailable", \
        "1 in flight here of a cap of 3: the tenant may be within its quota"
    # one replica holding the whole cap (it held it when the store went away) proves it
    b, _, c = make({"max_concurrent": 1})
    t = c.tenant("t")
    assert b.decide(t, "r1", E(), 10).borrow  # leased: its slice is empty, the fleet may have one
    b.share_slots("t", 1, 0)
    assert b.decide(t, "r1", E(), 10, borrowed=True).admitted
    b.share_local([ME, "!expected-0"], ME, {"t": {ME: 1}})
    d = b.decide(t, "r2", E(), 10)
    assert d.rejection is not None and (d.rejection.status, d.rejection.reason) == (429, "tenant-concurrency")


def test_a_store_that_could_not_be_asked_is_503_not_429() -> None:
    """Issue 28 §2: a borrow that errors (``store.py`` marks the tenant unreached) or a store whose last
    sync failed was a 429 for a tenant that may be inside its fleet-wide quota."""
    a, _, c = make({"tokens_per_minute": 600, "token_burst": 300})
    t = c.tenant("t")
    d = a.decide(t, "r1", E(), 10)
    assert d.borrow, "no credit here yet: borrow first"
    a.leased.unreached.add("t")  # the borrow timed out
    d = a.decide(t, "r1", E(), 10, borrowed=True)
    assert d.rejection is not None and (d.rejection.status, d.rejection.reason) == (503, "quota-unavailable")
    a.leased.unreached.discard("t")  # the store answered: its "no" is the fleet's word
    d = a.decide(t, "r1", E(), 10, borrowed=True)
    assert d.rejection is not None and (d.rejection.status, d.rejection.reason) == (429, "tenant-tokens")
    a.leased.down = True  # syncs fail: not yet on a split
    d = a.decide(t, "r1", E(), 10, borrowed=True)
    assert d.rejection is not None and d.rejection.reason == "quota-unavailable"


def test_one_replica_without_a_store_keeps_its_429s() -> None:
    a, _, c = make({"max_concurrent": 1, "tokens_per_minute": 60, "token_burst": 30}, shared=False)
    t = c.tenant("t")
    assert a.decide(t, "r1", E(), 10).admitted
    d = a.decide(t, "r2", E(), 10)
    assert d.rejection is not None and (d.rejection.status, d.rejection.reason) == (429, "tenant-concurrency")


def test_a_tenant_whose_slots_sit_idle_elsewhere_is_not_told_it_is_over_its_cap() -> None:
    """Issue 29: small caps across replicas — every slot granted, one idle at another replica. The store
    says fewer than the cap run fleet-wide: not over quota, so no 429 (review: the 429 claimed "slots
    idle elsewhere" even when the fleet was at its cap, and a 429 for a tenant within its cap is a false
    claim whatever it says) — a retryable 503 that says how many are in use here."""
    a, _, c = make({"max_concurrent": 2})
    t = c.tenant("t")
    a.share_slots("t", 1, 0, running=1)  # one slot here, the other held idle by another replica
    assert a.decide(t, "r1", E(), 10).admitted
    assert a.decide(t, "r2", E(), 10).borrow  # first: ask the store for it
    a.share_slots("t", 1, 0, running=1)  # its answer: still one running fleet-wide, the slot not moved yet
    d = a.decide(t, "r2", E(), 10, borrowed=True)
    assert d.rejection is not None and (d.rejection.status, d.rejection.reason) == (503, "quota-unavailable")
    assert "1 of them in use here" in d.rejection.message and d.rejection.retry_after is not None


@pytest.mark.parametrize("running", [None, 2], ids=["fleet-unknown", "fleet-at-cap"])
def test_a_tenant_at_its_cap_fleet_wide_gets_the_plain_429(running: int | None) -> None:
    a, _, c = make({"max_concurrent": 2})
    t = c.tenant("t")
    a.share_slots("t", 1, 0, running=running)
    assert a.decide(t, "r1", E(), 10).admitted
    d = a.decide(t, "r2", E(), 10, borrowed=True)
    assert d.rejection is not None and (d.rejection.status, d.rejection.reason) == (429, "tenant-concurrency")
    assert d.rejection.message.startswith("Too many concurrent requests")


@given(level=st.floats(-50, 300), need=st.integers(1, 400), n=st.integers(1, 5))
def test_a_split_never_claims_a_tenant_over_its_token_budget(level: float, need: int, n: int) -> None:
    """Whatever the slice holds, a token refusal on a split is never a 429 nor a 400 for a request
    within the fleet's whole budget (only this replica's own use could prove more, and a slice of a
    bucket cannot)."""
    a, _, c = make({"tokens_per_minute": 600, "token_burst": 300})
    a.share_local([ME, *(f"!expected-{i}" for i in range(n - 1))], ME, {})
    s = a.tenant_state("t")
    assert s is not None and s.tokens is not None
    s.tokens.level = min(level, s.tokens.capacity)
    d = a.decide(c.tenant("t"), "r", E(need // 2, need - need // 2), 10)
    assert d.rejection is None or d.rejection.reason in ("quota-unavailable", "exceeds-token-budget")
    if d.rejection is not None and d.rejection.reason == "exceeds-token-budget":
        assert need > 300


def test_a_slot_idle_at_another_replica_is_borrowed_for_but_no_more_than_are_idle() -> None:
    """Every slot held, fewer requests running than the cap fleet-wide: the slice short here borrows
    (the store's borrow then waits for the idle slot to move), as many times as slots are idle."""
    a, _, c = make({"max_concurrent": 2})
    t = c.tenant("t")
    a.share_slots("t", 0, 0, 0, running=0)  # both slots held elsewhere, neither in use
    assert a.decide(t, "r1", E(), 10).borrow
    assert a.decide(t, "r2", E(), 10).borrow
    d = a.decide(t, "r3", E(), 10)
    assert d.rejection is not None and d.rejection.reason == "tenant-concurrency"
    a.share_slots("t", 0, 0, 0, running=2)  # both in use: over the cap, no borrow
    d = a.decide(t, "r4", E(), 10)
    assert d.rejection is not None and d.rejection.reason == "tenant-concurrency"


def test_a_lease_charged_before_the_split_does_not_shrink_what_the_split_spent() -> None:
    """(review) A request charged on leased credit that ended during the split gave its unused tokens
    back to the split's tally: the store, debited on rejoining, was told less than the split spent."""
    from ext_proc.admission import Usage

    a, _, c = make({"tokens_per_minute": 6000, "token_burst": 3000})
    t = c.tenant("t")
    a.share_credit("t", "tokens", 3000.0, 0.0)  # the whole bucket leased here
    early = a.decide(t, "r0", E(10, 1000), 10, borrowed=True)
    assert early.admitted and early.lease is not None
    a.share_local([ME, "!expected-0", "!expected-1"], ME, {})
    on_split = a.decide(t, "r1", E(10, 90), 10)
    assert on_split.admitted and on_split.lease is not None
    assert isinstance(a.quota, SplitQuota)
    a.complete(early.lease.ticket, Usage(10, 10), True)  # 990 of its 1,010 reserved tokens unused
    assert a.quota.spent["t"] == (1, 100)  # only what the split itself charged
    a.complete(on_split.lease.ticket, Usage(10, 40), True)
    assert a.quota.spent["t"] == (1, 50)  # its real usage
