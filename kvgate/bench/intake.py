"""``kvgate bench intake``: what hostile request bodies cost kvgate, through the production ``Core``.

Two measurements, in one run:

* **CPU per decision, per body kind** — each hostile shape of issue 28 at ``limits.max_body_bytes``
  (and a few bodies orjson refuses, and the legit large bodies that must still be read), decided by a
  fresh :class:`~ext_proc.core.Core` as the gRPC shell would: the minimum and median of the
  process's CPU time over ``reps`` decisions, and the answer. One row is a hostile body from a tenant
  already at its concurrency cap; the last rows are the costliest bodies the scan lets through (just
  under each of its caps).
* **A victim beside a hostile tenant** — a serial event loop, as kvgate's one event loop is: a victim
  tenant's requests (Poisson arrivals) wait behind whatever the core is deciding; a hostile tenant at
  its own limits (``max_concurrent: 4``, 600 requests/min) keeps 8 requests of the worst body in
  flight, each resent ``rtt_s`` after its answer (the client's round trip through Envoy). Virtual
  time advances by the CPU each decision really took. The victim's decision latency (wait + its own
  decision) with and without the hostile tenant, from the same arrivals, in the same run.

Figures depend on the machine (CPU time of this process; other load on the cores inflates them).
"""

from __future__ import annotations

import contextlib
import heapq
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from ext_proc import intake as intake_mod
from ext_proc.config import Config, parse_config
from ext_proc.core import Answer, Core, Ended, Request, null_logger
from ext_proc.identity import hash_key
from ext_proc.intake import caps_for
from ext_proc.reasons import Invalid

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"


def _fill(head: bytes, item: bytes, tail: bytes, size: int) -> bytes:
    n = max(1, (size - len(head) - len(tail)) // (len(item) + 1))
    return head + b",".join([item] * n) + tail


def kinds(max_bytes: int) -> list[tuple[str, str, bytes]]:
    """(name, path, body): the hostile shapes at ``max_bytes``, bodies orjson refuses, legit big ones."""
    text = b'a, b, {c}, [d], \\" e \\n '
    return [
        ("tools: [{}] * n", CHAT, _fill(b'{"model":"m","messages":[],"tools":[', b"{}", b"]}", max_bytes)),
        ("prompt: token ids", COMPLETIONS, _fill(b'{"model":"m","prompt":[', b"1", b"]}", max_bytes)),
        ("content-part messages", CHAT, _fill(
            b'{"model":"m","messages":[', b'{"role":"user","content":[{"type":"text","text":"a"}]}', b"]}",
            max_bytes)),
        ("numbers", COMPLETIONS, _fill(b'{"model":"m","prompt":[', b"123456789", b"]}", max_bytes)),
        ("strings", COMPLETIONS, _fill(b'{"model":"m","prompt":[', b'"a"', b"]}", max_bytes)),
        # escaped quotes: the scan's quick bound is over the caps and the body has ``\"``, so it takes the
        # exact pass (removing the escapes) before it is refused — the costliest refusal
        ("tools: escaped quotes", CHAT, _fill(b'{"model":"m","messages":[],"tools":[', b'{"a":"\\""}', b"]}",
                                              max_bytes)),
        # number-heavy bodies under the element cap: what orjson's number parsing costs (the C pass's
        # caps on bytes outside strings and on non-integer numbers)
        ("floats", COMPLETIONS, _fill(b'{"model":"m","prompt":[', b"1.2345678901234567e-300", b"]}", max_bytes)),
        ("20-digit integers", COMPLETIONS, _fill(b'{"model":"m","prompt":[', b"18446744073709551615", b"]}",
                                                 max_bytes)),
        ("whitespace", CHAT, b'{"model":"m","messages":[' + b" " * (max_bytes - 40) + b"]}"),
        ("BOM + n=16, stream", CHAT, b'\xef\xbb\xbf{"model":"m","messages":[{"role":"user","content":"hi"}],'
                                     b'"max_tokens":100000,"n":16,"stream":true}'),
        ("NaN", CHAT, b'{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":NaN}'),
        ("legit: 4 MB text, commas", CHAT, b'{"model":"m","messages":[{"role":"user","content":"'
         + text * ((max_bytes - 100) // len(text)) + b'"}],"max_tokens":8}'),
        # one string of escaped quotes (a quote every two bytes), beside 70 messages (past the 64 objects and
        # arrays under which the nesting check is skipped without the C pass)
        # (a string of 2M escapes costs orjson ~2.5 ms beside the rest: past the cost budget since it was set)
        ("4 MB of escaped quotes, 70 messages", CHAT, b'{"model":"m","messages":[{"role":"user","content":"'
         + b'\\"' * ((max_bytes - 3000) // 2) + b'"}' + b',{"role":"user","content":"x"}' * 70 + b"]}"),
        # 4,096 numbers set off the search for a token-id prompt, a pass over every other member: a string of
        # escapes is where it is slowest (attack44: 7.6-7.9 ms admitted when the search was under-priced)
        ("4,096 ids beside a 3 MB string of escapes", COMPLETIONS, b'{"model":"m","prompt":['
         + b",".join([b"1"] * 4096) + b'],"x":"' + "😀\\n".encode() * ((max_bytes * 3 // 4) // 6) + b'"}'),
        ("legit: 2,000 messages", CHAT, b'{"model":"m","messages":['
         + b",".join([b'{"role":"user","content":"Tell me, in a few words, what you think."}'] * 2000)
         + b'],"max_tokens":8}'),
        ("legit: 100k token ids", COMPLETIONS, b'{"model":"m","max_tokens":8,"prompt":['
         + b",".join([b"12345"] * 100_000) + b"]}"),
    ]


def at_caps(cfg: Config) -> list[tuple[str, str, bytes]]:
    """The costliest bodies the scan lets through: just under each of its caps (``intake.Caps``)."""
    caps = caps_for(cfg.limits)
    part = b'{"role":"user","content":[{"type":"text","text":"a"}]}'
    return [
        ("at the caps: tools [{}] x containers", CHAT,
         b'{"model":"m","messages":[],"tools":[' + b",".join([b"{}"] * (caps.containers - 3)) + b"]}"),
        ("at the caps: content parts", CHAT,
         b'{"model":"m","messages":[' + b",".join([part] * (caps.containers // 3 - 2)) + b"]}"),
        ("at the caps: tools, strings", CHAT,
         b'{"model":"m","messages":[],"tools":[' + b",".join([b'"a"'] * (caps.strings - 8)) + b"]}"),
        ("at the caps: token ids", COMPLETIONS,
         b'{"model":"m","prompt":[' + b",".join([b"123456"] * (caps.elements - 10)) + b"]}"),
        # messages the estimate cannot count on its fast path (each walked): null content, a third key
        ("at the caps: messages of null content", CHAT,
         b'{"model":"m","messages":[' + b",".join([b'{"role":"u","content":null}'] * (caps.containers - 4)) + b"]}"),
        ("at the caps: embedding strings", EMBEDDINGS,
         b'{"model":"m","input":[' + b",".join([b'"a"'] * (caps.strings - 4)) + b"]}"),
        ("at the caps: embedding token-id lists", EMBEDDINGS,
         b'{"model":"m","input":[' + b",".join([b"[" + b",".join([b"1"] * 15) + b"]"] * (caps.containers - 4))
         + b"]}"),
    ]


_PARTS: dict[str, Callable[[int], bytes]] = {
    # what a body may hold a lot of, n at a time: the dearest mixes the budget lets through
    "numbers": lambda n: b",".join([b"123456"] * n),
    "lists of 15 numbers": lambda n: b",".join([b"[" + b",".join([b"123456"] * 15) + b"]"] * max(1, n // 16)),
    "distinct keys": lambda n: b"{" + b",".join(b'"%016d":1' % i for i in range(max(1, n // 2))) + b"}",
    "\\n escapes": lambda n: b'"' + b"\\n" * (4 * n) + b'"',
    "\\u escapes": lambda n: b'"' + b"\\u6f22" * (2 * n) + b'"',
    "messages": lambda n: b",".join([b'{"role":"user","content":"hello there"}'] * max(1, n // 3)),
    "non-ASCII strings": lambda n: b",".join(['"😀"'.encode()] * max(1, min(n, 60_000))),
    "non-ASCII text, escapes": lambda n: b'"' + "é漢😀\\n".encode() * n + b'"',
}
_MIXES = (("numbers", "lists of 15 numbers"), ("lists of 15 numbers", "distinct keys"), ("\\n escapes", "\\u escapes"),
          ("distinct keys", "\\u escapes"), ("messages", "\\u escapes"),
          ("non-ASCII strings", "non-ASCII text, escapes"))


def _mix(a: str, na: int, b: str, nb: int) -> bytes:
    return (b'{"model":"m","messages":[{"role":"user","content":"x"}],"a":[' + _PARTS[a](na) + b'],"b":['
            + _PARTS[b](nb) + b"]}")


def at_budget(cfg: Config) -> list[tuple[str, str, bytes]]:
    """The costliest bodies the cost budget lets through: two kinds of element mixed, as many of each as
    fits just under ``bodycost.cost`` (the production function), and two bodies under two caps at once
    that cost 7.5-12.7 ms before the budget (now refused)."""
    caps = caps_for(cfg.limits)
    rows = []
    for a, b in _MIXES:
        lo, hi = 1, 4_000_000
        while hi - lo > max(8, lo // 200):
            mid = (lo + hi) // 2
            body = _mix(a, mid, b, mid)
            try:
                fits = len(body) <= cfg.limits.max_body_bytes and intake_mod.scan(body, caps, "chat") is not None
            except Invalid:
                fits = False
            lo, hi = (mid, hi) if fits else (lo, mid)
        rows.append((f"at the budget: {a} + {b}", CHAT, _mix(a, lo, b, lo)))
    keys64 = b",".join(b'"%064d":1' % i for i in range(32_000))
    rows.append(("two caps: 16k lists of ids, 32k distinct keys", EMBEDDINGS, b'{"model":"m","input":['
                 + b",".join([b"[" + b",".join([b"123456"] * 15) + b"]"] * 16_000) + b'],"x":{' + keys64 + b"}}"))
    rows.append(("two caps: 200k ids, 1.8 MB of escaped quotes", COMPLETIONS, b'{"model":"m","prompt":['
                 + b",".join([b"12345678"] * 200_000) + b'],"user":"' + b'\\"' * 900_000 + b'"}'))
    return rows


def _config(hostile_limits: bool = True) -> Config:
    h: dict[str, Any] = {"name": "hostile", "api_key_sha256": [hash_key("k-hostile")]}
    if hostile_limits:
        h.update(max_concurrent=4, requests_per_minute=600)
    return parse_config({"tenants": [h, {"name": "victim", "api_key_sha256": [hash_key("k-victim")]}]})


def per_kind(reps: int = 5, max_bytes: int | None = None) -> list[dict[str, Any]]:
    """CPU per decision for each body kind (ms), and what kvgate answered."""
    rows = []
    clock = [0.0]
    for name, path, body in kinds(max_bytes or _config().limits.max_body_bytes) + at_caps(_config()) + \
            (at_budget(_config()) if intake_mod._native is not None else []):
        rows.append(_measure(name, path, body, reps, clock, over_quota=False))
    name, path, body = kinds(max_bytes or _config().limits.max_body_bytes)[0]
    rows.append(_measure(name + ", tenant over quota", path, body, reps, clock, over_quota=True))
    return rows


def _measure(name: str, path: str, body: bytes, reps: int, clock: list[float], over_quota: bool) -> dict[str, Any]:
    core = Core(_config(hostile_limits=over_quota), lambda: clock[0], log=null_logger())
    if over_quota:  # the tenant's 4 slots are taken by requests in flight
        for i in range(4):
            core.decide(Request(CHAT, f"busy{i}", "Bearer k-hostile", b'{"messages":[],"max_tokens":1}'))
    costs, answer = [], None
    for i in range(reps):
        clock[0] += 1.0
        t0 = time.process_time()
        a = core.decide(Request(path, f"r{i}", "Bearer k-hostile", body))
        cost = time.process_time() - t0
        costs.append(cost)
        answer = a
        if isinstance(a, Answer) and a.decision.lease is not None:
            core.ended(Ended(a.ticket, f"r{i}", 200))
    r = answer.decision.rejection if isinstance(answer, Answer) else None
    return {"kind": name, "bytes": len(body), "cpu_ms_min": min(costs) * 1e3,
            "cpu_ms_median": statistics.median(costs) * 1e3,
            "answer": f"{r.status} {r.reason}" if r is not None else "admitted"}


def victim(seconds: float = 30.0, rate: float = 20.0, clients: int = 8, service_s: float = 1.0,
           max_bytes: int | None = None, seed: int = 7, rtt_s: float = 0.01) -> dict[str, Any]:
    """The victim's decision latency with and without the hostile tenant (same arrivals)."""
    body = kinds(max_bytes or _config().limits.max_body_bytes)[0][2]
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            break
        arrivals.append(t)
    out: dict[str, Any] = {"seconds": seconds, "victim_rate": rate, "hostile_clients": clients,
                           "hostile_body_bytes": len(body), "hostile_rtt_s": rtt_s}
    for label, hostile in (("alone", False), ("beside_hostile", True)):
        lat, answers = _serial(arrivals, hostile, clients, body, seconds, service_s, rtt_s)
        lat.sort()
        out[label] = {"victim_p50_ms": _pct(lat, 0.50) * 1e3, "victim_p99_ms": _pct(lat, 0.99) * 1e3,
                      "victim_max_ms": lat[-1] * 1e3, "victim_decisions": len(lat),
                      "victim_over_1ms": sum(1 for x in lat if x > 1e-3),
                      "hostile_answers": dict(answers)}
    return out


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _serial(arrivals: list[float], hostile: bool, clients: int, body: bytes, seconds: float,
            service_s: float, rtt_s: float) -> tuple[list[float], Counter[str]]:
    """One event loop: each event starts when the core is free, and occupies it for the CPU it took."""
    clock = [0.0]
    core = Core(_config(), lambda: clock[0], log=null_logger())
    events: list[tuple[float, int, str, str]] = []
    seq = 0

    def push(at: float, kind: str, what: str) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (at, seq, kind, what))

    for i, at in enumerate(arrivals):
        push(at, "victim", f"v{i}")
    if hostile:
        for c in range(clients):
            push(0.001 * c, "hostile", f"h{c}")
    victim_body = b'{"model":"m","messages":[{"role":"user","content":"Say hello in five words."}],"max_tokens":8}'
    free_at = 0.0
    latencies: list[float] = []
    answers: Counter[str] = Counter()
    sent = 0
    while events:
        at, _, kind, what = heapq.heappop(events)
        if kind == "hostile" and at >= seconds:
            continue
        clock[0] = start = max(at, free_at)
        if kind == "end":
            t0 = time.process_time()
            core.ended(Ended(what, "", 200))
            free_at = start + time.process_time() - t0
            continue
        sent += 1
        rid = f"{what}-{sent}"
        key, b = ("k-victim", victim_body) if kind == "victim" else ("k-hostile", body)
        t0 = time.process_time()
        a = core.decide(Request(CHAT, rid, f"Bearer {key}", b))
        free_at = start + time.process_time() - t0
        if isinstance(a, Answer) and a.decision.lease is not None:
            push(free_at + service_s, "end", a.ticket or "")
        if kind == "victim":
            latencies.append(free_at - at)
        else:
            r = a.decision.rejection if isinstance(a, Answer) else None
            answers[r.reason if r is not None else "admitted"] += 1
            push(free_at + rtt_s, "hostile", what)  # resent once its answer is back
    return latencies, answers


def intake_bench(reps: int = 5, seconds: float = 30.0, quiet: bool = False, pure_python: bool = False,
                 ) -> dict[str, Any]:
    """Both measurements; ``pure_python``: as an install without the C extension runs (its Python loops)."""
    with intake_mod.pure_python() if pure_python else contextlib.nullcontext():
        rows = per_kind(reps)
        v = victim(seconds)
    if not quiet:
        print(f"kvgate bench intake: CPU per decision through the production Core ({reps} decisions per row; "
              f"scan: {'pure Python' if pure_python else intake_mod.SCAN_KIND})")
        print(f"{'body':<52} {'bytes':>9} {'min ms':>8} {'median ms':>10}  answer")
        for r in rows:
            print(f"{r['kind']:<52} {r['bytes']:>9} {r['cpu_ms_min']:>8.2f} {r['cpu_ms_median']:>10.2f}  {r['answer']}")
        print(f"\nvictim tenant ({v['victim_rate']:g} req/s, {v['seconds']:g} s) beside a hostile tenant at its limits "
              f"(max_concurrent 4, 600/min; {v['hostile_clients']} requests of {v['hostile_body_bytes']} bytes "
              f"in flight), one serial event loop:")
        for label in ("alone", "beside_hostile"):
            x = v[label]
            print(f"  {label:<15} victim p50 {x['victim_p50_ms']:.3f} ms  p99 {x['victim_p99_ms']:.3f} ms  "
                  f"max {x['victim_max_ms']:.3f} ms  ({x['victim_decisions']} decisions, "
                  f"{x['victim_over_1ms']} over 1 ms)"
                  + (f"  hostile answers: {x['hostile_answers']}" if x["hostile_answers"] else ""))
    return {"kinds": rows, "victim": v, "scan": "python" if pure_python else intake_mod.SCAN_KIND}
