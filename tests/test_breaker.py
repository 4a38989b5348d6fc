from ext_proc.breaker import Breaker, BreakerSettings, State, open_cause

S = BreakerSettings(kv_threshold=0.95, latency_multiplier=3.0, recovery_window_s=30, half_open_requests=2,
                    close_kv=0.85, close_latency_multiplier=1.5, baseline_alpha=0.5, min_baseline_samples=3)


def learned() -> tuple[Breaker, list[tuple[State, State, str]]]:
    log: list[tuple[State, State, str]] = []
    b = Breaker(S, lambda old, new, why: log.append((old, new, why)))
    for t in range(3):
        b.observe(0.3, 0.1, float(t))
    return b, log


def test_baseline_is_learned_from_healthy_operation() -> None:
    b, _ = learned()
    assert b.baseline is not None and abs(b.baseline - 0.1) < 1e-9
    b.observe(0.5, 0.14, 3)  # a healthy reading moves it
    assert b.baseline is not None and 0.1 < b.baseline < 0.14
    b.observe(0.5, 0.2, 4)  # 2x the baseline: not healthy, not learned (but no trip below 3x)
    assert b.state is State.CLOSED and b.baseline < 0.14
    unhealthy = Breaker(S)
    unhealthy.observe(0.9, 5.0, 0)  # KV over close_kv: not a healthy reading, not learned
    assert unhealthy.baseline is None


def test_trips_on_kv_and_on_latency() -> None:
    b, log = learned()
    b.observe(0.96, 0.1, 10)
    assert b.state is State.OPEN and not b.allows(10) and "kv 0.96" in log[-1][2]
    b2, log2 = learned()
    for t in (10, 11):  # > 3 x 0.1, but a slow reading or two is noise
        b2.observe(0.3, 0.31, t)
        assert b2.state is State.CLOSED
    b2.observe(0.3, None, 11.5)  # no request finished: no latency news, the count stands
    b2.observe(0.3, 0.31, 12)  # the third slow reading in a row
    assert b2.state is State.OPEN and open_cause(log2[-1][2]) == "latency"
    b3, _ = learned()
    for t in (10, 11, 12):
        b3.observe(0.3, 0.29, t)
    assert b3.state is State.CLOSED
    b4, _ = learned()
    for t, p in ((10, 0.31), (11, 0.31), (12, 0.15), (13, 0.31), (14, 0.31)):  # a normal reading resets it
        b4.observe(0.3, p, t)
    assert b4.state is State.CLOSED


def test_a_node_as_slow_as_its_peers_is_loaded_not_sick() -> None:
    b, log = learned()  # baseline 0.1
    for t in (10, 11, 12):
        b.observe(0.3, 0.5, t, reference=0.4)  # 5x its past, but its peers read 0.4 now
    assert b.state is State.CLOSED
    for t in (13, 14, 15):
        b.observe(0.3, 1.5, t, reference=0.4)  # > 3 x the peers
    assert b.state is State.OPEN and "the peers' 0.40x" in log[-1][2]


def test_no_latency_trip_before_a_baseline_exists() -> None:
    b = Breaker(S)
    b.observe(0.3, 10.0, 0)
    assert b.state is State.CLOSED


def test_half_open_budget_then_close_when_healthy() -> None:
    b, log = learned()
    b.observe(0.99, 0.1, 10)
    assert not b.allows(39.9)
    assert b.allows(40.0) and b.state is State.HALF_OPEN  # recovery window passed
    b.dispatched()
    assert b.allows(40.0)
    b.dispatched()
    assert not b.allows(40.1)  # budget of 2 trial requests spent
    b.observe(0.5, 0.1, 41)
    b.result(True, 42)
    assert b.state is State.HALF_OPEN
    b.result(True, 43)
    assert b.state is State.CLOSED and b.allows(43)
    assert [(o.value, n.value) for o, n, _ in log] == [("closed", "open"), ("open", "half_open"),
                                                       ("half_open", "closed")]


def test_half_open_reopens_on_failure_or_bad_reading_or_still_unhealthy() -> None:
    b, _ = learned()
    b.observe(0.99, 0.1, 10)
    assert b.allows(40)
    b.result(False, 41)
    assert b.state is State.OPEN and b.opened_at == 41

    b.allows(71)
    assert b.state is State.HALF_OPEN
    b.observe(0.97, 0.1, 72)
    assert b.state is State.OPEN

    b.allows(102)
    b.observe(0.9, 0.1, 103)  # below the trip line but above close_kv
    b.result(True, 104)
    b.result(True, 105)
    assert b.state is State.OPEN


def test_a_breaker_opened_by_a_full_kv_cache_alone_goes_half_open_once_it_drained() -> None:
    """A full cache is the node's load: once a reading shows it below ``close_kv`` the node gets its trials at
    once instead of after the whole recovery window (a node of four took nothing for 30 s of a burst while
    the others refused 15% of the demand). A latency trip, a failed trial and a KV reading still above
    ``close_kv`` keep the window."""
    b, log = learned()
    b.observe(0.99, 0.1, 10)
    b.observe(0.90, 0.1, 11)  # below the trip line, above close_kv: still full enough
    assert b.state is State.OPEN and not b.allows(11)
    b.observe(0.80, 0.1, 12)
    assert b.state is State.HALF_OPEN and b.allows(12) and log[-1][2] == "kv 0.80 < 0.85: drained"
    for t in (12.4, 12.5):  # requests running since before the trip (two: its whole trial budget) say nothing
        b.result(True, t, trial=False)
    assert b.state is State.HALF_OPEN
    b.observe(0.97, 0.1, 13)  # full again while half-open: open, and this time for the window (attack95 F4)
    b.observe(0.5, 0.1, 14)
    assert b.state is State.OPEN and not b.allows(42.9) and b.allows(43)
    b.result(False, 44, trial=False)  # any failure while half-open re-opens it, for the window
    b.observe(0.5, 0.1, 45)
    assert b.state is State.OPEN and log[-1][2] == "a request failed while half-open" and b.allows(74)
    for t in (75, 76):  # its trials' results close it
        assert b.dispatched()
        b.result(True, t)
    assert b.state is State.CLOSED

    flap, flips = learned()
    for i in range(40):  # readings alternating about the two lines: one quick half-open, then the window
        flap.observe(0.97 if i % 2 == 0 else 0.84, 0.1, 10 + 0.25 * i)
    assert sum(1 for old, new, _ in flips if new is State.OPEN) == 2

    slow, _ = learned()
    for t in (10, 11, 12):
        slow.observe(0.3, 0.31, t)
    assert slow.state is State.OPEN
    slow.observe(0.1, 0.1, 13)  # a latency trip with an empty cache: the window all the same
    assert slow.state is State.OPEN and not slow.allows(41.9) and slow.allows(42)
    both, _ = learned()
    for t in (10, 11):
        both.observe(0.3, 0.31, t)
    both.observe(0.99, 0.31, 12)  # full and slow at once: not the KV alone
    both.observe(0.5, 0.1, 13)
    assert both.state is State.OPEN
