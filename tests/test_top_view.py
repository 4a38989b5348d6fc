"""``kvgate top`` shows what the metrics tell and hides what they cannot: no TTFT columns unless a caller
adds TTFT, no table heading with nothing under it, callers with no known key on their own line (not a
tenant called ``unknown`` in the lowest tier), and each frame names where its figures come from."""

from __future__ import annotations

import io
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ext_proc.admission import UNKNOWN_TENANT
from ext_proc.config import ConfigError, parse_config
from ext_proc.core import Core, Request, null_logger
from ext_proc.estimate import Estimate
from ext_proc.identity import hash_key
from kvgate import top
from tests.helpers import FakeClock


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
    """The core files an unidentified caller under the lowest tier as a placeholder; its refusal was
    counted as tier="batch", so a dashboard of the batch tier's refusals counted 401s. A configured
    tenant that happens to be named ``unknown`` keeps its own tier."""
    cfg = parse_config({"tenants": [{"name": "unknown", "tier": "standard", "api_key_sha256": [hash_key("k")],
                                     "max_concurrent": 1}]})
    core = Core(cfg, FakeClock(), log=null_logger())
    for rid, key in (("r1", "Bearer nobody"), ("r2", "Bearer k"), ("r3", "Bearer k")):
        core.decide(Request("/v1/chat/completions", rid, key, estimate=Estimate(10, 10, parsed=True), body_bytes=10))
    text = generate_latest(core.stats.registry).decode()
    assert ('kvgate_requests_total{class="auth",decision="reject",pool="none",reason="unknown-key",'
            'tenant="unknown",tier="none"} 1.0') in text
    assert 'reason="tenant-concurrency",tenant="unknown",tier="standard"} 1.0' in text


def test_a_tenant_named_unknown_is_a_tenant_in_top() -> None:
    text = ("# TYPE kvgate_requests_total counter\n"
            + _requests("unknown", "standard", "default", "reject", "policy", 0)
            + _requests("unknown", "none", "default", "reject", "auth", 0))
    later = ("# TYPE kvgate_requests_total counter\n"
             + _requests("unknown", "standard", "default", "reject", "policy", 6)
             + _requests("unknown", "none", "default", "reject", "auth", 2))
    v = top.build([_scrape(text, 0.0)], [_scrape(later, 2.0)])
    (pool,) = v.pools.values()
    assert pool.tenants["unknown"].r429 == 3.0 and pool.unidentified == 1.0


def test_a_tier_cannot_be_named_none() -> None:
    """``tier="none"`` labels callers refused before any tenant was found: a real tier of that name would
    have its refusals counted with theirs (and hidden by ``top`` as callers with no known key)."""
    with pytest.raises(ConfigError, match=r"tiers\.none: 'none' is reserved"):
        parse_config({"tiers": {"none": {"priority": 0, "max_queue_wait_ms": 1000}}})


def _render(v: top.View) -> str:
    from rich.console import Console

    out = io.StringIO()
    Console(file=out, force_terminal=True, width=160).print(top.rich_view(v))
    return out.getvalue()


ROW = {"tier": "standard", "decision": "admit", "reason": "ok", "class": "none", "pool": "default"}


@pytest.mark.parametrize("sample", [
    top.Sample("kvgate_node_breaker_state", {"node": "n1", "pool": "default"}, math.nan),
    top.Sample("kvgate_node_breaker_state", {"node": "n1", "pool": "default"}, math.inf),
    top.Sample("kvgate_store_up", {}, math.nan),
    top.Sample("kvgate_store_fallback", {}, -math.inf),
    top.Sample("kvgate_request_duration_seconds_bucket", {"tier": "standard", "le": "soon", "pool": "default"}, 1.0),
    top.Sample("kvgate_requests_total", {"tenant": "[/]", **ROW}, 1.0),
    top.Sample("kvgate_node_kv_usage_ratio", {"node": "[bold", "pool": "[/x]"}, 0.5),
], ids=["nan-breaker", "inf-breaker", "nan-store-up", "inf-fallback", "bad-le", "markup-tenant", "markup-node"])
def test_odd_metrics_never_crash_a_frame(sample: top.Sample) -> None:
    """``top`` reads whatever page its URL serves: a NaN or infinite gauge, a bucket bound that is no
    number, a label that reads as rich markup each crashed the view (ValueError, OverflowError,
    MarkupError) instead of showing it."""
    base = [top.Sample("kvgate_requests_total", {"tenant": "a", **ROW}, 1.0)]
    v = top.build([top.Scrape(0.0, base)], [top.Scrape(1.0, [*base, sample])])
    frame = top.text(v)
    assert "tenant" in frame
    assert _render(v)


def test_a_label_cannot_write_to_the_terminal() -> None:
    """A control character in a label (an escape sequence, a newline forging a row) is printed as ``?``."""
    hostile = {"tenant": "\x1b[2Jx\nfake row", **ROW}
    sample = top.Sample("kvgate_requests_total", hostile, 1.0)
    v = top.build([top.Scrape(0.0, [sample])], [top.Scrape(1.0, [sample])])
    frame = top.text(v)
    assert "\x1b" not in frame and "\nfake row" not in frame
    assert "?[2Jx?fake row" in frame


labels = st.dictionaries(st.sampled_from(["tenant", "tier", "pool", "node", "le", "decision", "class", "version"]),
                         st.text(max_size=8), max_size=6)
samples = st.lists(st.builds(top.Sample, st.sampled_from([
    "kvgate_requests_total", "kvgate_request_duration_seconds_bucket", "kvgate_inflight_requests",
    "kvgate_queue_depth_requests", "kvgate_node_kv_usage_ratio", "kvgate_node_breaker_state",
    "kvgate_node_inflight_requests", "kvgate_store_up", "kvgate_store_fallback", "kvgate_config_info",
    "kvgate_store_borrows_total"]), labels, st.floats()), max_size=12)


@settings(max_examples=150, deadline=None)
@given(samples, samples)
def test_any_metrics_page_gives_a_frame(before: list[top.Sample], after: list[top.Sample]) -> None:
    """Whatever the samples (any label text, any float), both renderings produce a frame whose only
    control character is the line break between its rows."""
    v = top.build([top.Scrape(0.0, before)], [top.Scrape(1.0, after)])
    frame = top.text(v)
    assert all(c.isprintable() for line in frame.split("\n") for c in line)
    assert _render(v)


def test_a_request_envoy_gave_up_on_is_not_a_caller_with_no_known_key() -> None:
    """kvgate labels a decision that came after Envoy gave up (a tombstone) ``tenant="unknown"``,
    ``tier="none"``, class ``gateway``: whose it was is not looked up. ``top`` counted it on the "no known
    key (401)" line, blaming a key that may be fine; it has its own line."""
    text = ("# TYPE kvgate_requests_total counter\n"
            'kvgate_requests_total{tenant="unknown",tier="none",decision="reject",reason="gateway-unavailable",'
            'class="gateway",pool="none"} %d\n')
    v = top.build([_scrape(text % 0, 0.0)], [_scrape(text % 4, 2.0)])
    (pool,) = v.pools.values()
    assert pool.unidentified == 0.0 and pool.late == 2.0 and not pool.tenants
    frame = top.text(v)
    assert "no known key" not in frame
    assert f"{top.LATE}: 2.0/s" in frame
    assert 'class="gateway"' in frame.split("sources:")[1]
    assert top.LATE in _render(v)
