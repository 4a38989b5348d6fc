"""An open-loop load generator for the real stack: tenants sending at fixed rates, every request recorded.

Open loop (arrivals on a seeded Poisson schedule, whatever the answers) because a closed loop slows
down when the server does and hides overload. Streaming requests record the time to the first token
as the client sees it. Every request ends as a ``Result`` — a status, or ``status=0`` for a transport
error — so a test can count that nothing was lost.
"""

from __future__ import annotations

import http.client
import itertools
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


@dataclass(frozen=True)
class Traffic:
    tenant: str
    key: str
    rate: float
    """Requests per second (Poisson)."""
    prompt_chars: int
    max_tokens: int
    stream: bool = True
    model: str | None = None
    """Sent as the body's model (vLLM answers 404 for a name it does not serve); None: left out."""


@dataclass
class Result:
    tenant: str
    sent_at: float
    status: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    retry_after: str | None = None
    retry_after_ms: str | None = None
    reason: str | None = None
    completion_tokens: int = 0
    error: str | None = None


_SEQ = itertools.count()


def _one(host: str, port: int, t: Traffic, res: Result, timeout: float) -> None:
    # every prompt is its own (a request number first): like a RAG pipeline's retrieved context, it
    # shares no prefix with the others, so no node can answer it from its prefix cache
    head = f"request {next(_SEQ)} of {t.tenant}: "
    doc = {"prompt": head + "x " * max(0, (t.prompt_chars - len(head)) // 2), "max_tokens": t.max_tokens,
           "ignore_eos": True, "stream": t.stream}
    if t.model is not None:
        doc["model"] = t.model
    body = json.dumps(doc).encode()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    t0 = time.monotonic()
    try:
        conn.request("POST", "/v1/completions", body=body, headers={
            "content-type": "application/json", "authorization": f"Bearer {t.key}"})
        r = conn.getresponse()
        res.status = r.status
        res.retry_after, res.retry_after_ms = r.getheader("retry-after"), r.getheader("retry-after-ms")
        res.reason = r.getheader("x-kvgate-reject-reason")
        if r.status != 200 or not t.stream:
            data = r.read()
            if r.status == 200:
                res.completion_tokens = int(json.loads(data).get("usage", {}).get("completion_tokens", 0))
                res.ttft_s = time.monotonic() - t0
        else:
            while line := r.readline():
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                doc = json.loads(line[6:])
                if doc.get("choices") and res.ttft_s is None:
                    res.ttft_s = time.monotonic() - t0
                if doc.get("choices"):
                    res.completion_tokens += 1
        res.e2e_s = time.monotonic() - t0
    except (OSError, http.client.HTTPException, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def schedule(traffic: list[Traffic], seconds: float, seed: int = 0) -> list[tuple[float, Traffic]]:
    """The seeded open-loop arrivals (seconds from the start, traffic), in time order: the same seed and
    traffic give the very same schedule, so two runs can be given the same load."""
    rng = random.Random(seed)
    out: list[tuple[float, Traffic]] = []
    for t in traffic:
        at = rng.expovariate(t.rate)
        while at < seconds:
            out.append((at, t))
            at += rng.expovariate(t.rate)
    out.sort(key=lambda x: x[0])
    return out


def run(host: str, port: int, traffic: list[Traffic], seconds: float, seed: int = 0, workers: int = 256,
        timeout: float = 60.0, results: list[Result] | None = None,
        arrivals: list[tuple[float, Traffic]] | None = None) -> list[Result]:
    """Send ``traffic`` for ``seconds``; return one Result per request sent, after all have ended.

    ``results``: a list to append each Result to as it is sent (to watch a run in progress);
    ``arrivals``: a ready-made :func:`schedule` to send instead of drawing one from ``traffic``."""
    plan = arrivals if arrivals is not None else schedule(traffic, seconds, seed)
    results = results if results is not None else []
    lock = threading.Lock()
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for at, t in plan:
            delay = start + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            res = Result(t.tenant, at)
            with lock:
                results.append(res)
            pool.submit(_one, host, port, t, res, timeout)
    return results


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of a non-empty list."""
    xs = sorted(values)
    k = max(0, min(len(xs) - 1, int(-(-p * len(xs) // 100)) - 1))
    return xs[k]
