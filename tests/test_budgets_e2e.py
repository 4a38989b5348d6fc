"""Spend budgets end to end (issue 31): Envoy, two kvgate replicas sharing the Redis ledger, simulated
vLLM nodes reporting cached prompt tokens — the ``kvgate demo-budgets`` run, checked."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest

from ext_proc.prices import Price, Spent, cost
from kvgate.dev.budgetdemo import LIMIT, PRICE, ledger, post, request_body, run, served_model, stack
from tests.helpers import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.envoy, pytest.mark.redis]  # (run starts the Stack: Envoy, redis-server)


def test_a_tenant_runs_into_its_daily_budget_across_two_replicas(tmp_path: Path) -> None:
    r = run(tmp_path, quiet=True)
    answers, refusal, ledger = r["answers"], r["refusal"], r["ledger"]
    assert len(answers) >= 8 and refusal is not None
    assert refusal["status"] == 429 and refusal["reason"] == "tenant-budget"
    assert int(refusal["retry_after"]) > 0 and "resets" in refusal["message"] and "daily" in refusal["message"]
    assert refusal["headers"]["x-kvgate-budget"] == "daily"
    assert float(refusal["headers"]["x-ratelimit-limit-budget"]) == LIMIT
    # what the nodes reported (each answer's usage, cached tokens at their price) is what the ledger
    # charged — also for completions whose access log reached the other replica — and within the limit
    assert any(a["cached_tokens"] > 0 for a in answers)
    assert ledger["spent"] == pytest.approx(r["node_spend"], rel=1e-6) and r["node_spend"] <= LIMIT
    assert ledger["reserved"] == pytest.approx(0, abs=1e-9)
    # the remaining budget on each answer is the fleet's, so it only goes down
    left = [float(a["remaining"].split("=")[1]) for a in answers]
    assert left == sorted(left, reverse=True)


def test_every_replica_killed_and_restarted_loses_no_spend(tmp_path: Path) -> None:
    st = stack(tmp_path)
    st.start()
    try:
        model, price = served_model(st), Price(**PRICE)
        spent = 0.0

        def one() -> int:
            nonlocal spent
            status, _, raw = post(st.url + "/v1/chat/completions", request_body(model))
            if status == 200:
                u = json.loads(raw)["usage"]
                spent += cost(price, Spent(u["prompt_tokens"], u["completion_tokens"],
                                           (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)))
            return status

        assert [one() for _ in range(4)] == [200] * 4
        wait_for(lambda: asyncio.run(ledger(st))["spent"] == pytest.approx(spent, rel=1e-6), what="the ledger")
        for name in st.replica_names:
            st.stop_process(name, signal.SIGKILL)
        for i in range(len(st.replica_names)):
            st.start_replica(i)
        st.wait_ready()
        assert asyncio.run(ledger(st))["spent"] == pytest.approx(spent, rel=1e-6)  # nothing lost
        statuses = [one() for _ in range(30)]
        assert 429 in statuses  # the restarted replicas enforce what the ledger holds: the budget still ends
        wait_for(lambda: asyncio.run(ledger(st))["spent"] == pytest.approx(spent, rel=1e-6), what="the ledger")
        assert spent <= LIMIT
    finally:
        st.stop()
