"""``kvgate top`` shows what the metrics tell and hides what they cannot: no TTFT columns unless a caller
adds TTFT, no table heading with nothing under it, callers with no known key on their own line (not a
tenant called ``unknown`` in the lowest tier), and each frame names where its figures come from."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ext_proc.admission import UNKNOWN_TENANT, Decision
from ext_proc.reasons import reject
from ext_proc.stats import Stats
from kvgate import top


def _scrape(text: str, at: float) -> top.Scrape:
    return top.Scrape(at, [top.Sample(s.name, dict(s.labels), s.value)
                           for f in text_string_to_metric_families(text) for s in f.samples])


def _requests(tenant: str, tier: str, pool: str, decision: str, klass: str, n: int) -> str:
    return (f'kvgate_requests_total{{tenant="{tenant}",tier="{tier}",decision="{decision}",reason="r",'
            f'class="{klass}",pool="{pool}"}} {n}\n')


def _metrics(n: int) -> str:
    return ("# TYPE kvgate_requests_total counter\n"
            + _requests("chat", "interactive", "p1", "admit", "none", 10 * n)
            + _requests("unknown", "none", "none", "reject", "auth", 4 * n)
            + "# TYPE kvgate_inflight_requests gauge\n"
            + 'kvgate_inflight_requests{tenant="chat",pool="p1"} 1\n'
            + 'kvgate_inflight_requests{tenant="unknown",pool="p1"} 0\n'
            + "# TYPE kvgate_queue_depth_requests gauge\n"
            + 'kvgate_queue_depth_requests{tier="interactive",pool="p1"} 0\n'
            + 'kvgate_queue_depth_requests{tier="interactive",pool="p2"} 0\n')


def _view() -> top.View:
    return top.build([_scrape(_metrics(1), 0.0)], [_scrape(_metrics(2), 2.0)])


def test_callers_with_no_known_key_are_not_a_tenant() -> None:
    v = _view()
    assert all(UNKNOWN_TENANT not in p.tenants for p in v.pools.values())
    assert v.pools["none"].unidentified == 2.0
    frame = top.text(v)
    assert "no known key: 2.0/s" in frame
    assert "\n      unknown" not in frame and "\n  unknown" not in frame


def test_no_heading_without_rows_and_no_ttft_columns_without_ttft() -> None:
    frame = top.text(_view())
    assert "TTFT" not in frame
    assert "latency" not in frame  # no request completed: no latency to show
    # pool none has no tenant (only the unknown callers), pool p2 no tenant either: no tenant heading there
    for pool in ("none", "p2"):
        block = frame.split(f"pool {pool}\n")[1].split("\npool ")[0].split("\nsources:")[0]
        assert "tenant" not in block, block
    assert frame.count("tenant ") == 1  # pool p1's heading only


def test_ttft_columns_appear_with_their_source_when_a_caller_adds_them() -> None:
    v = _view()
    v.pools["p1"].tenants["chat"].ttft_p50 = 0.02
    v.ttft_source = "measured by the demo's clients"
    frame = top.text(v)
    assert "TTFT p50" in frame and "TTFT: measured by the demo's clients" in frame


def test_each_frame_says_where_its_figures_come_from() -> None:
    frame = top.text(_view())
    sources = frame.split("\nsources:\n")[1]
    assert "kvgate_requests_total" in sources and "kvgate_queue_depth_requests" in sources
    assert "nodes:" not in sources  # no node in these metrics
    assert 'tenant="unknown"' in sources


def test_a_caller_refused_before_any_tenant_is_labelled_tier_none() -> None:
    """The core files an unidentified caller under the lowest tier (shadow mode runs it there); its refusal
    used to be counted as tier="batch", so a dashboard of the batch tier's refusals counted 401s."""
    stats = Stats()
    stats.set_tenants(["chat"])
    stats.decision(Decision(UNKNOWN_TENANT, "batch", None, reject("unknown-key")), "none")
    stats.decision(Decision("chat", "batch", None, reject("tenant-requests")), "default")
    text = generate_latest(stats.registry).decode()
    assert ('kvgate_requests_total{class="auth",decision="reject",pool="none",reason="unknown-key",'
            'tenant="unknown",tier="none"} 1.0') in text
    assert ('kvgate_requests_total{class="policy",decision="reject",pool="default",reason="tenant-requests",'
            'tenant="chat",tier="batch"} 1.0') in text
