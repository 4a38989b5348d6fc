"""The first five minutes: `kvgate demo`'s before/after summary, `kvgate top`, the report's plots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate import top
from kvgate.dev.demo import CLIENTS
from kvgate.dev.stack import Stack

from .conftest import KEYS
from .helpers import chat, post


def kvgate(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgate.cli", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_demo_json_is_one_document_and_accounts_for_every_request(tmp_path: Path) -> None:
    r = kvgate("demo", "--seconds", "10", "--json", "--workdir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)  # exactly one JSON document: json.loads rejects anything after it
    tenants = [c.traffic.tenant for c in CLIENTS]
    assert list(doc) == tenants and "chatbot" in doc
    for t in tenants:
        assert set(doc[t]) == {"without", "with"}
        # the same seeded open-loop schedule in both runs
        assert doc[t]["without"]["sent"] == doc[t]["with"]["sent"] > 0
        for side in doc[t].values():
            assert {"ttft_p50_ms", "ttft_p99_ms", "status", "lost", "sent", "retry_after_s"} <= set(side)
            assert side["lost"] == 0
            assert sum(side["status"].values()) + side["lost"] == side["sent"]
    cb = doc["chatbot"]
    for side in cb.values():
        assert side["status"].get("200") == side["sent"]
        assert side["ttft_p99_ms"] >= side["ttft_p50_ms"] > 0
    rag = doc["rag"]
    assert rag["without"]["status"] == {"200": rag["without"]["sent"]}  # shadow mode: nothing refused
    assert rag["with"]["status"].get("429", 0) > 0 and rag["with"]["retry_after_s"]["p50"] > 0
    assert doc["intruder"]["with"]["status"] == {"401": doc["intruder"]["with"]["sent"]}
    assert "before" not in r.stdout.lower() and "tenant" in r.stderr  # the live view went to stderr


@pytest.fixture
def small_stack(tmp_path: Path) -> Stack:
    from .conftest import tenants

    return Stack(tmp_path, {"tenants": tenants()}, token_ms=2.0)


def test_top_once_reads_a_running_stack(small_stack: Stack) -> None:
    with small_stack as st:
        for key in ("open", "tight", "open"):
            post(f"{st.url}/v1/chat/completions", chat(), KEYS[key])
        r = kvgate("top", "--metrics", st.metrics_url, "--metrics", st.metrics_url, "--once", "--interval", "0.3",
                   timeout=30)
        assert r.returncode == 0, r.stderr
        out = r.stdout
        assert "2 source(s)" in out and "admit/s" in out
        for name in ("open", "tight", "tokens", "shadowed"):
            assert f"\n  {name}" in out
        assert "tier" in out


def test_top_unreachable_url_is_a_clear_error() -> None:
    r = kvgate("top", "--metrics", "http://127.0.0.1:9/metrics", "--once", timeout=30)
    assert r.returncode == 2
    assert "kvgate top: http://127.0.0.1:9/metrics: cannot read metrics" in r.stderr
    assert "Traceback" not in r.stderr


def _scrape(text: str, at: float) -> top.Scrape:
    from prometheus_client.parser import text_string_to_metric_families

    return top.Scrape(at, [top.Sample(s.name, dict(s.labels), s.value)
                           for f in text_string_to_metric_families(text) for s in f.samples])


def test_top_rates_add_replicas_and_split_by_pool() -> None:
    def metrics(admits: int, rejects: int, pool: str) -> str:
        return (
            "# TYPE kvgate_requests_total counter\n"
            f'kvgate_requests_total{{tenant="a",tier="standard",decision="admit",reason="",class="none",'
            f'pool="{pool}"}} {admits}\n'
            f'kvgate_requests_total{{tenant="a",tier="standard",decision="reject",reason="tenant-concurrency",'
            f'class="policy",pool="{pool}"}} {rejects}\n'
            "# TYPE kvgate_node_breaker_state gauge\n"
            f'kvgate_node_breaker_state{{node="n1",pool="{pool}"}} 2\n')

    prev = [_scrape(metrics(10, 0, "p1"), 0.0), _scrape(metrics(0, 0, "p2"), 0.0)]
    cur = [_scrape(metrics(30, 4, "p1"), 2.0), _scrape(metrics(10, 0, "p2"), 2.0)]
    v = top.build(prev, cur)
    assert set(v.pools) == {"p1", "p2"}
    assert v.pools["p1"].tenants["a"].admit == pytest.approx(10.0)
    assert v.pools["p1"].tenants["a"].r429 == pytest.approx(2.0)
    assert v.pools["p2"].tenants["a"].admit == pytest.approx(5.0)
    frame = top.text(v)
    assert "pool p1" in frame and "pool p2" in frame and "breaker open" in frame


def test_top_says_how_the_replicas_share_their_store() -> None:
    def metrics(up: int, split: int, borrows: int, version: str) -> str:
        return ("# TYPE kvgate_store_up gauge\n"
                f"kvgate_store_up {up}\n"
                "# TYPE kvgate_store_fallback gauge\n"
                f"kvgate_store_fallback {split}\n"
                "# TYPE kvgate_store_borrows_total counter\n"
                f'kvgate_store_borrows_total{{result="granted"}} {borrows}\n'
                "# TYPE kvgate_config_info gauge\n"
                f'kvgate_config_info{{version="{version}"}} 1\n'
                "# TYPE kvgate_requests_total counter\n")

    prev = [_scrape(metrics(1, 0, 0, "aaa"), 0.0), _scrape(metrics(0, 1, 0, "bbb"), 0.0)]
    cur = [_scrape(metrics(1, 0, 8, "aaa"), 2.0), _scrape(metrics(0, 1, 2, "bbb"), 2.0)]
    v = top.build(prev, cur)
    assert v.store is not None and (v.store.replicas, v.store.up, v.store.local_split) == (2, 1, 1)
    assert v.store.borrows == pytest.approx(5.0)
    assert "store: 1/2 replicas syncing, 1 on their local split, 5.0 borrows/s, config aaa/bbb" in top.text(v)
    assert top.build(prev[:1], cur[:1]).store is not None
    assert top.build([_scrape("kvgate_x 1\n", 0.0)], [_scrape("kvgate_x 1\n", 1.0)]).store is None


def test_the_report_writes_its_plots(tmp_path: Path) -> None:
    """Each plot that has something to show, and a note for each that has not: overload refuses nothing and
    keeps its 3 nodes (its rejections plot was an empty chart, its nodes plot flat lines); diurnal refuses
    and scales. Legends sit under the plots, never inside an axes over the curves."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ext_proc.config import parse_config
    from kvgate.bench.scenarios import report
    from kvgate.bench.scenarios.runner import run, write_report
    from kvgate.bench.scenarios.workloads import get_scenario

    overload, diurnal = run(get_scenario("overload"), scale=0.05), run(get_scenario("diurnal"), scale=0.05)
    md = write_report([overload, diurnal], tmp_path)
    text = md.read_text()
    written = {"overload": ("latency-cdf", "ttft-over-time"),
               "diurnal": ("latency-cdf", "ttft-over-time", "rejections", "nodes")}
    for name, whats in written.items():
        for what in whats:
            png = tmp_path / f"{name}-{what}.png"
            assert png.stat().st_size > 5000, png
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            assert f"]({png.name})" in text
    assert not (tmp_path / "overload-rejections.png").exists() and not (tmp_path / "overload-nodes.png").exists()
    overload_part = text.split("overload-ttft-over-time.png)")[1].split("## ")[0]
    assert "No rejections plot: no policy answered any request 429 or 503." in overload_part
    assert "No fleet-size plot: every policy keeps the same nodes (3) the whole run." in overload_part
    assert "No rejections plot" not in text.split("overload-ttft-over-time.png)")[1].split("## ", 1)[1]

    colors = ["C0", "C1", "C2", "C3", "C4", "C5"]
    config = parse_config({})
    for fig in (report.cdf_figure(overload.summaries, config, plt, colors),
                report.ttft_time_figure(overload.summaries, config, plt, colors),
                report.nodes_figure(diurnal.summaries, plt, colors)):
        assert fig is not None and len(fig.legends) == 1
        assert all(ax.get_legend() is None for ax in fig.axes)
        plt.close(fig)
    assert report.rejections_figure(overload.summaries, plt, colors) is None
    assert report.nodes_figure(overload.summaries, plt, colors) is None
