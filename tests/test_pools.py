"""Model pools in the gateway core: routing by ``model``, 404/403, per-model budgets, a queue per pool.

The end-to-end checks (through Envoy, counting at simulated nodes) are in ``test_pools_e2e.py``; here
the core is driven directly, with a fake clock and probe readings.
"""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest
from prometheus_client import generate_latest

from ext_proc.config import ConfigError, parse_config
from ext_proc.core import Answer, Core, Ended, Held, Request, null_logger
from ext_proc.identity import hash_key
from ext_proc.pools import Router
from gpu_probe.snapshot import Snapshot
from tests.helpers import FakeClock

SMALL = ["10.1.0.1:8000", "10.1.0.2:8000"]
BIG = ["10.2.0.1:8000"]


def nodes(addrs: list[str]) -> dict[str, Any]:
    return {"static": [{"address": a, "probe": f"http://{a}"} for a in addrs]}


def pools_config(**extra: Any) -> Any:
    doc: dict[str, Any] = {
        "tenants": [
            {"name": "acme", "api_key_sha256": [hash_key("k-acme")], "tier": "standard",
             "model_budgets": {"llama-70b": {"tokens_per_minute": 600, "token_burst": 600}}},
            {"name": "intern", "api_key_sha256": [hash_key("k-intern")], "models": ["llama-8b*"]},
            {"name": "bulk", "api_key_sha256": [hash_key("k-bulk")], "tier": "standard"},
        ],
        "pools": [
            {"name": "small", "models": ["llama-8b", "llama-8b-*"], "adapters": ["sql-lora"], "nodes": nodes(SMALL)},
            {"name": "big", "models": ["llama-70b"], "nodes": nodes(BIG), "queue": {"max_size": 4}},
        ],
    }
    doc.update(extra)
    return parse_config(doc)


def fresh(core: Core, clock: FakeClock, addrs: list[str], kv: float = 0.1) -> None:
    for a in addrs:
        core.snapshot(a, Snapshot(node=a, at=clock(), ok=True, kv_usage=kv, blocks_total=20000, block_size=16,
                                  waiting=0.0, running=0.0))


def core_and_clock(cfg: Any = None) -> tuple[Core, FakeClock]:
    clock = FakeClock()
    core = Core(cfg or pools_config(), clock, rng=random.Random(7), log=null_logger())
    fresh(core, clock, SMALL + BIG)
    return core, clock


def ask(core: Core, model: str | None, key: str = "k-acme", prompt: int = 100, output: int = 50,
        rid: str = "r") -> Answer | Held:
    body = {"messages": [{"role": "user", "content": "hi " * prompt}], "max_tokens": output}
    if model is not None:
        body["model"] = model
    out = core.decide(Request("/v1/chat/completions", rid, f"Bearer {key}", orjson.dumps(body)))
    assert isinstance(out, (Answer, Held)), out  # one replica: never a Borrow
    return out


def test_each_model_goes_to_its_pools_nodes() -> None:
    core, _ = core_and_clock()
    seen: dict[str, set[str]] = {"small": set(), "big": set()}
    for i, model in enumerate(["llama-8b", "llama-8b-instruct", "sql-lora", "llama-70b"] * 3):
        a = ask(core, model, rid=f"r{i}")
        assert isinstance(a, Answer) and a.reply is None, a
        assert a.decision.lease is not None and a.decision.lease.node is not None
        seen[a.pool].add(a.decision.lease.node)
        assert a.decision.lease.pool == a.pool
    assert seen["small"] <= set(SMALL) and seen["small"]
    assert seen["big"] == set(BIG)


def test_unknown_model_is_404_model_not_found_and_never_capacity() -> None:
    core, _ = core_and_clock()
    a = ask(core, "gpt-5")
    assert isinstance(a, Answer) and a.reply is not None
    assert a.reply.status == 404 and a.decision.rejection is not None
    assert a.decision.rejection.klass == "invalid" and a.pool == "none"
    err = orjson.loads(a.reply.body)["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and "gpt-5" in err["message"]
    assert ("x-kvgate-reject-reason", "model-not-found") in a.reply.headers
    assert not any(k == "retry-after" for k, _ in a.reply.headers)
    text = _sorted_labels(generate_latest(core.stats.registry).decode())
    assert 'kvgate_requests_total{class="invalid",decision="reject",pool="none",reason="model-not-found"' in text


def _sorted_labels(text: str) -> str:
    """The exposition with each sample's labels in name order (the client keeps declaration order)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.append(s.name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items())) + "}")
    return "\n".join(out)


def test_a_model_outside_the_tenants_list_is_403_model_not_allowed() -> None:
    core, _ = core_and_clock()
    a = ask(core, "llama-70b", key="k-intern")
    assert isinstance(a, Answer) and a.reply is not None and a.reply.status == 403
    assert orjson.loads(a.reply.body)["error"]["code"] == "model_not_allowed"
    assert a.decision.rejection is not None and a.decision.rejection.klass == "auth"
    ok = ask(core, "llama-8b-chat", key="k-intern")  # its pattern allows this one
    assert isinstance(ok, Answer) and ok.reply is None


def test_several_pools_need_a_model_one_pool_does_not() -> None:
    core, _ = core_and_clock()
    a = ask(core, None)
    assert isinstance(a, Answer) and a.reply is not None and a.reply.status == 400
    assert orjson.loads(a.reply.body)["error"]["param"] == "model"
    junk = core.decide(Request("/v1/chat/completions", "j", "Bearer k-acme", b"\xff not json"))
    assert isinstance(junk, Answer) and junk.reply is not None and junk.reply.status == 400
    # without pools, the model is not looked at: every request goes to the one pool, as before
    clock = FakeClock()
    single = Core(parse_config({"tenants": [{"name": "acme", "api_key_sha256": [hash_key("k-acme")]}],
                                "nodes": nodes(SMALL)}), clock, log=null_logger())
    fresh(single, clock, SMALL)
    for model in (None, "anything-at-all"):
        b = ask(single, model)
        assert isinstance(b, Answer) and b.reply is None and b.pool == "default"


def test_models_listing_is_what_the_caller_may_use() -> None:
    core, _ = core_and_clock()
    a = core.headers("Bearer k-intern", path="/v1/models")
    assert a.reply is not None and a.reply.status == 200
    ids = [m["id"] for m in orjson.loads(a.reply.body)["data"]]
    assert ids == ["llama-8b"]  # patterns name no model; sql-lora and llama-70b are not its to use
    everyone = core.headers("Bearer k-acme", path="/v1/models?x=1")
    data = orjson.loads(everyone.reply.body)["data"] if everyone.reply else []
    assert [m["id"] for m in data] == ["llama-8b", "sql-lora", "llama-70b"]
    assert data[1]["parent"] == "llama-8b"
    assert core.headers("Bearer nobody", path="/v1/models").reply.status == 401  # type: ignore[union-attr]
    health = core.headers("Bearer k-acme", path="/health")
    assert health.reply is None and health.metadata["endpoint"] in SMALL + BIG


def test_a_per_model_budget_limits_that_model_only_and_is_reconciled() -> None:
    core, clock = core_and_clock()
    a = ask(core, "llama-70b", prompt=200, output=300, rid="a")  # ~ 200 + 4 + 300 of the 600 budget
    assert isinstance(a, Answer) and a.reply is None
    b = ask(core, "llama-70b", prompt=200, output=300, rid="b")
    assert isinstance(b, Answer) and b.reply is not None and b.reply.status == 429
    assert b.decision.rejection is not None and b.decision.rejection.reason == "tenant-tokens"
    assert "on model llama-70b" in orjson.loads(b.reply.body)["error"]["message"]
    assert any(k == "retry-after" for k, _ in b.reply.headers)
    c = ask(core, "llama-8b", prompt=200, output=300, rid="c")  # the tenant's own quota has no cap
    assert isinstance(c, Answer) and c.reply is None
    budget = core.admission.tenant_state("acme/llama-70b")
    assert budget is not None and budget.inflight == 1 and budget.tokens is not None
    before = budget.tokens.available(clock())
    assert a.ticket is not None
    from ext_proc.admission import Usage

    core.ended(Ended(a.ticket, "a", 200, Usage(150, 20), upstream_answered=True))
    assert budget.inflight == 0
    # the reservation (~500) gives way to the real usage (170): the difference comes back
    assert budget.tokens.available(clock()) == pytest.approx(before + a.decision.lease.reserved_tokens - 170, abs=1)
    d = ask(core, "llama-70b", prompt=100, output=100, rid="d")  # ~180 of the ~430 now left
    assert isinstance(d, Answer) and d.reply is None


def test_a_saturated_pool_queues_and_refuses_while_the_other_admits() -> None:
    core, clock = core_and_clock()
    fresh(core, clock, BIG, kv=0.99)  # the big pool's only node is full
    held = [ask(core, "llama-70b", key="k-bulk", rid=f"b{i}") for i in range(6)]
    assert sum(isinstance(h, Held) for h in held) == 4  # its own queue holds 4 (queue.max_size is 1024)
    full = [h for h in held if isinstance(h, Answer)]
    assert [h.decision.rejection.reason for h in full if h.decision.rejection] == ["queue-full"] * 2
    assert all(h.pool == "big" and h.reply is not None and h.reply.status == 503 for h in full)
    assert len(core.admission.queues["big"]) == 4 and len(core.admission.queues["small"]) == 0
    small = ask(core, "llama-8b", key="k-bulk", rid="s")
    assert isinstance(small, Answer) and small.reply is None, "a flooded pool never holds another pool's requests"
    clock.advance(10.0)
    core.tick()
    late = core.answers()
    assert len(late) == 4 and all(x.reply is not None and x.reply.status == 503 for x in late)
    text = _sorted_labels(generate_latest(core.stats.registry).decode())
    assert 'kvgate_requests_total{class="capacity",decision="reject",pool="big"' in text
    assert 'kvgate_requests_total{class="capacity",decision="reject",pool="small"' not in text
    assert 'kvgate_node_kv_usage_ratio{node="10.2.0.1:8000",pool="big"}' in text


def test_weights_split_a_model_between_pools() -> None:
    cfg = parse_config({
        "tenants": [{"name": "acme", "api_key_sha256": [hash_key("k-acme")]}],
        "pools": [{"name": "h100", "models": ["m"], "weight": 3, "nodes": nodes(SMALL)},
                  {"name": "a100", "models": ["m"], "weight": 1, "nodes": nodes(BIG)}],
    })
    r = Router(cfg, random.Random(1))
    picks = [r.route("m").name for _ in range(4000)]  # type: ignore[union-attr]
    assert 0.70 < picks.count("h100") / len(picks) < 0.80


@pytest.mark.parametrize("doc, where", [
    ({"pools": [{"name": "a", "models": ["m"], "nodes": nodes(SMALL)},
                {"name": "b", "models": ["m"], "nodes": nodes(BIG)}]},
     "pools[1].models[0]: model 'm' is also served by pool 'a'"),
    ({"pools": [{"name": "a", "models": ["m"], "nodes": nodes(SMALL)},
                {"name": "a", "models": ["n"], "nodes": nodes(BIG)}]}, "pools[1].name"),
    ({"pools": [{"name": "a", "models": ["m"], "nodes": nodes(SMALL)},
                {"name": "b", "models": ["n"], "nodes": nodes(SMALL[:1])}]}, "is also in pool 'a'"),
    ({"nodes": nodes(SMALL), "pools": [{"name": "a", "models": ["m"], "nodes": nodes(BIG)}]}, "nodes: with pools"),
    ({"pools": [{"name": "none", "models": ["m"], "nodes": nodes(SMALL)}]}, "pools[0].name: 'none' is reserved"),
    ({"pools": [{"name": "a", "models": ["m"], "nodes": {"dns": {"name": "vllm.svc"}}},
                {"name": "b", "models": ["n"], "nodes": {"dns": {"name": "vllm.svc"}}}]},
     "pools[1].nodes.dns: vllm.svc:8000 is also pool 'a''s"),
    ({"pools": [{"name": "a", "models": [], "nodes": nodes(SMALL)}]}, "pools[0].models"),
    ({"pools": [{"name": "a", "models": ["m"], "adapters": ["x*"], "nodes": nodes(SMALL)}]}, "pools[0].adapters"),
    ({"pools": [{"name": "a", "models": ["m"], "nodes": nodes(SMALL)}],
      "tenants": [{"name": "t", "models": ["q"]}]}, "tenants[0].models: no pool serves a model 'q'"),
    ({"pools": [{"name": "a", "models": ["m", "n"], "nodes": nodes(SMALL)}],
      "tenants": [{"name": "t", "models": ["m"], "model_budgets": {"n": {"tokens_per_minute": 5}}}]},
     "tenants[0].model_budgets.n: not among the tenant's models"),
    ({"pools": [{"name": "a", "models": ["m"], "nodes": nodes(SMALL)}],
      "tenants": [{"name": "t", "model_budgets": {"m": {"tokens_per_minte": 5}}}]},
     "tenants[0].model_budgets.m.tokens_per_minte: unknown setting"),
])
def test_pool_config_errors_name_the_field(doc: dict[str, Any], where: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(doc)
    assert where in str(e.value)


def test_a_reload_that_removes_a_pool_refuses_what_waited_there() -> None:
    core, clock = core_and_clock()
    fresh(core, clock, BIG, kv=0.99)
    h = ask(core, "llama-70b", rid="w")
    assert isinstance(h, Held)
    cfg = pools_config(pools=[{"name": "small", "models": ["llama-8b"], "nodes": nodes(SMALL)}],
                       tenants=[{"name": "acme", "api_key_sha256": [hash_key("k-acme")]}])
    core.reconfigure(cfg)
    clock.advance(0.1)
    core.tick()
    assert [a.reply.status for a in core.answers() if a.reply] == [503]
    assert core.admission.queued == 0 and "big" not in core.admission.queues
    a = ask(core, "llama-70b", rid="x")
    assert isinstance(a, Answer) and a.reply is not None and a.reply.status == 404


def test_resolutions_are_cached_but_not_for_unknown_names() -> None:
    """Resolved model names are cached; names nobody serves are not (a client could fill the cache)."""
    core, _ = core_and_clock()
    r = core.router
    for i in range(100):
        assert r.route(f"junk-{i}") is None
    assert r.route("llama-8b-x") is not None
    assert set(r._cache) == {"llama-8b-x"}


def test_a_node_another_pool_already_has_is_left_out() -> None:
    """DNS answering with another pool's node: it stays that pool's (one copy, its readings, its bookings)."""
    core, _ = core_and_clock()
    core.set_nodes([(BIG[0], f"http://{BIG[0]}", None), ("10.2.0.9:8000", "http://10.2.0.9:8000", None)], "small")
    assert set(core.fleets["small"].nodes) == {"10.2.0.9:8000"}
    assert set(core.fleets["big"].nodes) == set(BIG)


def test_a_shadow_tenant_is_admitted_for_a_model_it_may_not_use_and_counted() -> None:
    cfg = pools_config(tenants=[{"name": "intern", "api_key_sha256": [hash_key("k-intern")],
                                 "models": ["llama-8b"], "mode": "shadow"}])
    core, _ = core_and_clock(cfg)
    a = ask(core, "llama-70b", key="k-intern")
    assert isinstance(a, Answer) and a.reply is None and a.decision.admitted
    assert a.decision.rejection is not None and a.decision.rejection.reason == "model-not-allowed"
    assert a.decision.lease is not None and a.decision.lease.node in BIG
    text = _sorted_labels(generate_latest(core.stats.registry).decode())
    assert 'decision="shadow_reject",pool="big",reason="model-not-allowed"' in text


def test_without_pools_a_tenant_with_a_models_list_gets_its_own_listing() -> None:
    clock = FakeClock()
    core = Core(parse_config({"tenants": [{"name": "t", "api_key_sha256": [hash_key("k-t")], "models": ["a", "b*"]},
                                          {"name": "u", "api_key_sha256": [hash_key("k-u")]}],
                              "nodes": nodes(SMALL)}), clock, log=null_logger())
    fresh(core, clock, SMALL)
    listed = core.headers("Bearer k-t", path="/v1/models")
    assert listed.reply is not None and [m["id"] for m in orjson.loads(listed.reply.body)["data"]] == ["a"]
    assert core.headers("Bearer k-u", path="/v1/models").reply is None  # no list: the node answers, as before
    one = core.headers("Bearer k-t", path="/v1/models/a")
    assert one.reply is not None and orjson.loads(one.reply.body)["id"] == "a"
    nope = core.headers("Bearer k-t", path="/v1/models/zzz")
    assert nope.reply is not None and nope.reply.status == 404


def test_retrieving_a_model_with_pools() -> None:
    core, _ = core_and_clock()
    ok = core.headers("Bearer k-acme", path="/v1/models/llama-70b")
    assert ok.reply is not None and ok.reply.status == 200 and orjson.loads(ok.reply.body)["id"] == "llama-70b"
    assert core.headers("Bearer k-intern", path="/v1/models/llama-70b").reply.status == 404  # type: ignore[union-attr]
    assert core.headers("Bearer k-acme", path="/v1/models/llama-8b-x").reply.status == 200  # type: ignore[union-attr]


def test_a_slow_pool_does_not_make_another_pools_429_the_fleets_doing() -> None:
    """A concurrency-cap 429 counts as the fleet's (demand for the scaler) only for the pool that holds
    the tenant's slots: a tenant slowed on the 70B says nothing about the 8B pool."""
    cfg = pools_config(tenants=[{"name": "t", "api_key_sha256": [hash_key("k-t")], "max_concurrent": 2}])
    core, clock = core_and_clock(cfg)
    from ext_proc.admission import Usage

    def run(model: str, seconds: float, n: int) -> None:
        for i in range(n):
            a = ask(core, model, key="k-t", rid=f"{model}{i}{seconds}")
            assert isinstance(a, Answer) and a.ticket is not None
            clock.advance(seconds)
            core.ended(Ended(a.ticket, "x", 200, Usage(10, 10), upstream_answered=True))
            fresh(core, clock, SMALL + BIG)

    run("llama-8b", 1.0, 30)
    run("llama-70b", 10.0, 5)
    held = [ask(core, "llama-70b", key="k-t", rid=f"h{i}") for i in range(2)]
    assert all(isinstance(h, Answer) and h.decision.admitted for h in held)
    refused = ask(core, "llama-8b", key="k-t", rid="s")
    assert isinstance(refused, Answer) and refused.decision.rejection is not None
    assert refused.decision.rejection.reason == "tenant-concurrency" and not refused.decision.rejection.fleet_caused
    on_big = ask(core, "llama-70b", key="k-t", rid="b")
    assert isinstance(on_big, Answer) and on_big.decision.rejection is not None
    assert on_big.decision.rejection.fleet_caused, "on the pool that holds its slots it is the fleet's doing"
