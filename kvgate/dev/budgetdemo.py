"""``kvgate demo-budgets`` (``make demo-budgets``): a tenant runs into a small daily spend budget.

Two kvgate replicas share a local redis-server (the spend ledger, append-only file on), Envoy in front,
simulated vLLM nodes behind. The ``intern`` tenant has a $0.05 daily budget at demo prices; its requests
are sent one after another, alternately through both replicas (Envoy balances its ext_proc calls), each
showing what is left (``x-kvgate-budget-remaining``), until the 429 ``tenant-budget`` — whose body says
when the budget resets — and then ``kvgate spend``'s table of what the ledger holds. The nodes' own usage
reports (each response's ``usage``, cached prompt tokens priced apart) are added up on the client side and
compared with the ledger: the spend the nodes counted never exceeds the limit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.error
import urllib.request
from datetime import date
from pathlib import Path
from typing import Any

from ext_proc.config import parse_config
from ext_proc.identity import hash_key
from ext_proc.prices import Price, Spent, cost

from .stack import Stack

KEY = "sk-demo-intern"
PRICE = {"prompt": 5.0, "cached_prompt": 0.5, "completion": 15.0}
"""Demo prices per million tokens (dear, so that a few requests spend a budget)."""
LIMIT = 0.05


def budget_config() -> dict[str, Any]:
    return {
        "prices": {"*": PRICE},
        "tenants": [{"name": "intern", "api_key_sha256": [hash_key(KEY)],
                     "budgets": [{"name": "daily", "limit": LIMIT, "window": "day", "timezone": "UTC",
                                  "alert_at": [0.5, 0.9]}]}],
    }


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json", "authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def served_model(st: Stack) -> str:
    models = urllib.request.Request(st.url + "/v1/models", headers={"authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(models, timeout=10) as r:
        return str(json.loads(r.read())["data"][0]["id"])


def request_body(model: str) -> dict[str, Any]:
    """The intern's request: the same long prompt each time (the nodes' prefix caches serve most of it)."""
    return {"model": model, "max_tokens": 200, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Summarise the quarterly report. " * 40}]}


def stack(workdir: Path, token_ms: float = 2.0) -> Stack:
    """Envoy, two kvgate replicas sharing a local redis-server, two simulated vLLM nodes."""
    return Stack(workdir, budget_config(), token_ms=token_ms, replicas=2, sim_args=["--profile", "8b-h100"])


def run(workdir: Path, max_requests: int = 80, quiet: bool = False, token_ms: float = 2.0) -> dict[str, Any]:
    """Send the intern's requests until the budget refuses one; what happened, for the caller to print or
    check: each answer's status and remaining budget, the refusal's headers and message, the spend the
    nodes reported and the ledger's."""
    say = (lambda *_: None) if quiet else print
    st = stack(workdir, token_ms)
    st.start()
    try:
        model = served_model(st)
        price = Price(**PRICE)
        answers: list[dict[str, Any]] = []
        refusal: dict[str, Any] | None = None
        node_spend = 0.0
        say(f"kvgate demo-budgets: tenant 'intern', daily budget ${LIMIT} at ${PRICE['prompt']}/M prompt, "
            f"${PRICE['cached_prompt']}/M cached prompt, ${PRICE['completion']}/M completion; 2 kvgate replicas")
        for i in range(max_requests):
            status, headers, raw = post(st.url + "/v1/chat/completions", request_body(model))
            if status == 200:
                usage = json.loads(raw)["usage"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                c = cost(price, Spent(usage["prompt_tokens"], usage["completion_tokens"], cached))
                node_spend += c
                left = headers.get("x-kvgate-budget-remaining", "")
                answers.append({"status": 200, "cost": c, "remaining": left, "cached_tokens": cached})
                say(f"  request {i + 1:>2}: 200  cost ${c:.5f} ({cached} prompt tokens cached)  left: {left}")
                continue
            doc = json.loads(raw)
            refusal = {"status": status, "reason": headers.get("x-kvgate-reject-reason"),
                       "retry_after": headers.get("retry-after"), "message": doc["error"]["message"],
                       "headers": {k: v for k, v in headers.items() if "budget" in k}}
            say(f"  request {i + 1:>2}: {status} {refusal['reason']}  retry-after: {refusal['retry_after']} s")
            say(f"    {refusal['message']}")
            for k, v in sorted(refusal["headers"].items()):
                say(f"    {k}: {v}")
            break
        time.sleep(0.5)  # the last completions reach the ledger (access log, then the settle)
        book = asyncio.run(ledger(st))
        say(f"\nspend the nodes reported ${node_spend:.5f}, the ledger ${book['spent']:.5f} "
            f"(reserved {book['reserved']:.5f}), limit ${LIMIT}")
        say("\n" + book["table"])
        return {"answers": answers, "refusal": refusal, "node_spend": node_spend, "ledger": book}
    finally:
        st.stop()


async def ledger(st: Stack) -> dict[str, Any]:
    import redis.asyncio as aioredis

    from ext_proc.spendreport import read, render
    from ext_proc.spendstore import SpendStore, day_of

    cfg = parse_config(budget_config())
    client = aioredis.Redis.from_url(st.redis_url)
    try:
        store = SpendStore(client, "demo", cfg.prices, {t.name: t.budgets for t in cfg.tenants})
        now = time.time()
        b = cfg.tenants[0].budgets[0]
        spent, reserved = await store.state("intern", b, now)
        today = date.fromisoformat(day_of(now))
        rows, budgets = await read(store, cfg, today, today, now)
        return {"spent": spent, "reserved": reserved, "table": render(rows, budgets, "table")}
    finally:
        await client.aclose()


def main(a: argparse.Namespace) -> int:
    result = run(a.workdir, quiet=a.json)
    if a.json:
        print(json.dumps(result, indent=2))
    return 0 if result["refusal"] is not None else 1
