"""The gRPC shell: Envoy's ExternalProcessor and AccessLogService around the pure decision core.

Per HTTP request, Envoy opens one ext_proc stream. On inference routes (POST) Envoy skips the
headers message and sends a single buffered body message carrying the few request attributes kvgate
needs (authorization, path, request id): one round trip per request. Other routes send headers only.

Completion is accounted without any per-chunk Python work: a Lua filter in Envoy reads the final
usage of the response (JSON body or last SSE chunk, stripping that chunk again when kvgate added it)
into dynamic metadata, and Envoy's gRPC access log delivers it here when the stream ends, whether it
ended normally, on an upstream error or by a client disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2, struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from gpu_probe.snapshot import Snapshot

from . import logs
from .admission import UNKNOWN_KEY, Admission, Decision, Outcome, Usage
from .breaker import STATE_VALUE, State
from .config import Config, ConfigError, load_config
from .estimate import Estimate, Estimator
from .identity import Identifier
from .nodes import Fleet
from .stats import Stats
from .wire import REASON_HEADER, Reply, reject_reply

log = logs.get("kvgate.extproc")

ATTR_NS = "envoy.filters.http.ext_proc"
META_NS = "kvgate"
USAGE_NS = "kvgate.usage"
ATTR_AUTH = "request.headers['authorization']"
ATTR_PATH = "request.path"
ATTR_ID = "request.id"
SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
PUMP_INTERVAL_S = 0.05
"""How often the queue is looked at besides completions and probe readings (deadlines, doomed requests)."""
MESSAGE_TIMEOUT_CEILING_S = 59.0
"""Below the generated filter's max_message_timeout (60 s)."""


Held = asyncio.Future[tuple[ep.ProcessingResponse, Decision]]
"""What the stream of a queued request awaits: the reply once the queue has decided it."""


def trusted_attr(header: str) -> str:
    return f"request.headers['{header}']"


def _attr(msg: ep.ProcessingRequest, name: str) -> str:
    attrs = msg.attributes.get(ATTR_NS)
    if attrs is None:
        return ""
    v = attrs.fields.get(name)
    return v.string_value if v is not None else ""


def _immediate(reply: Reply) -> ep.ProcessingResponse:
    reason = next((v for k, v in reply.headers if k == REASON_HEADER), "reject")
    headers = ep.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()))
            for k, v in reply.headers
        ]
    )
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=reply.status),
            headers=headers,
            body=reply.body,
            details="kvgate_" + reason.replace("-", "_"),
        ),
        # tagged so Envoy's local-reply mappers leave kvgate's own replies alone
        dynamic_metadata=_metadata({"rejected": reason}),
    )


def _metadata(values: dict[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update({META_NS: values})
    return s


class Gateway:
    """Holds the live config and the core; both servicers share one instance."""

    def __init__(self, config: Config, config_path: Path | None = None) -> None:
        self.config_path = config_path
        self.admission = Admission(config, time.monotonic)
        self.stats = Stats(max_tenant_labels=config.metrics.max_tenant_labels)
        self.fleet: Fleet | None = None
        self._waiters: dict[str, tuple[Held, Estimate, str]] = {}
        """Queued requests: ticket → (what their stream awaits, their estimate, request id)."""
        self._apply(config)
        self._mtime = _mtime(config_path)
        self.open_streams = 0

    def _apply(self, config: Config) -> None:
        self.config = config
        self.identifier = Identifier(config)
        self.estimator = Estimator(config.estimation)
        self._trusted_attr = trusted_attr(config.identity.trusted_header) if config.identity.trusted_header else None
        if config.nodes is None:
            self.fleet = None
        elif self.fleet is None:
            self.fleet = Fleet(config.nodes, on_transition=self._transition)
        else:
            self.fleet.reconfigure(config.nodes)
        self.admission.pick = self._pick if self.fleet is not None else None
        self.stats.set_tenants([t.name for t in config.tenants], config.metrics.max_tenant_labels)

    def reload(self, reason: str) -> bool:
        """Load the config file again; a bad file keeps the running config and says why."""
        if self.config_path is None:
            return False
        self._mtime = _mtime(self.config_path)
        try:
            new = load_config(self.config_path)
        except ConfigError as e:
            self.stats.reloads.labels("error").inc()
            log.error("config_reload_failed", reason=reason, error=str(e), kept="previous config")
            return False
        if new.server != self.config.server:
            log.warning("config_server_changed", note="server.* settings take effect on restart only")
        self.admission.reconfigure(new)
        self._apply(new)
        self.stats.reloads.labels("ok").inc()
        log.info("config_reloaded", reason=reason, tenants=len(new.tenants), mode=new.mode)
        return True

    def file_changed(self) -> bool:
        return self.config_path is not None and _mtime(self.config_path) != self._mtime

    # -- nodes -----------------------------------------------------------------------------------

    def _transition(self, node: str, old: State, new: State, why: str) -> None:
        self.stats.node_transitions.labels(node, old.value, new.value).inc()
        self.stats.node_breaker.labels(node).set(STATE_VALUE[new])
        log.warning("breaker_transition", node=node, old=old.value, new=new.value, why=why)

    def _pick(
        self, est: Estimate, shadow: bool, ticket: str, reserve: float, caps: bool
    ) -> tuple[str | None, str | None, float | None]:
        assert self.fleet is not None
        c = self.fleet.place(est.total, est.prompt_tokens, ticket, time.monotonic(), force=shadow, reserve=reserve,
                             queue_caps=caps)
        return (c.node.address if c.node else None), c.reason, c.retry_after

    def export_nodes(self) -> None:
        if self.fleet is None:
            return
        now = time.monotonic()
        cfg = self.config.nodes
        discovery = "+".join(k for k, on in (("static", bool(cfg and cfg.static)), ("dns", bool(cfg and cfg.dns)))
                             if on)
        self.stats.nodes_total.clear()
        self.stats.nodes_total.labels(discovery or "static").set(len(self.fleet.nodes))
        for n in self.fleet.nodes.values():
            st = self.stats
            if n.snapshot is not None and n.snapshot.kv_usage is not None:
                st.node_kv.labels(n.address).set(n.snapshot.kv_usage)
                st.node_projected_kv.labels(n.address).set(n.projected_kv() or 0.0)
            st.node_inflight.labels(n.address).set(n.inflight)
            st.node_breaker.labels(n.address).set(STATE_VALUE[n.breaker.state])
            if n.fresh_at is not None:
                st.node_age.labels(n.address).set(now - n.fresh_at)

    # -- decisions -------------------------------------------------------------------------------

    def on_body(self, msg: ep.ProcessingRequest) -> tuple[ep.ProcessingResponse | Held, Decision]:
        """Decide one inference request: the reply, or for a queued request the future that gets it."""
        t0 = time.perf_counter()
        body = msg.request_body.body
        path = _attr(msg, ATTR_PATH)
        request_id = _attr(msg, ATTR_ID)
        trusted = _attr(msg, self._trusted_attr) if self._trusted_attr else None
        who = self.identifier.resolve(_attr(msg, ATTR_AUTH), trusted)
        quota = who.tenant
        default_max = (quota.default_max_tokens if quota else None) or self.config.estimation.default_max_tokens
        est = self.estimator.estimate(
            body, generates=path.split("?", 1)[0].endswith("/completions"), default_max_tokens=default_max
        )
        d = self.admission.decide(quota, request_id, est, len(body))
        if not est.parsed:
            self.stats.unparsed_bodies.inc()
            log.info("body_not_json", request_id=request_id, tenant=d.tenant, bytes=len(body),
                     note="decided on request size alone")
        if d.queued:
            assert d.lease is not None
            fut: Held = asyncio.get_running_loop().create_future()
            self._waiters[d.lease.ticket] = (fut, est, request_id)
            log.debug("queued", request_id=request_id, tenant=d.tenant, tier=d.tier, queued=self.admission.queued)
            self.deliver(self.admission.pump())  # an eviction it caused (or its own release, at once)
            self.export_queue()
            self.stats.decision_seconds.observe(time.perf_counter() - t0)
            return fut, d
        resp = self.respond(d, est, request_id)
        self.stats.decision_seconds.observe(time.perf_counter() - t0)
        return resp, d

    def respond(self, d: Decision, est: Estimate, request_id: str) -> ep.ProcessingResponse:
        """The ext_proc reply for a final decision (right away, or after a wait in the queue)."""
        self.stats.decision(d)
        self._log_decision(d, request_id, est.total)
        if d.lease is None:
            assert d.rejection is not None
            return _immediate(reject_reply(d.rejection))
        doc = est.document
        strip = est.stream and not est.include_usage and doc is not None
        common = ep.CommonResponse()
        mutated = False
        if strip:
            assert doc is not None
            opts = doc.get("stream_options")
            doc["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
            mutated = True
        tier = self.config.tiers.get(d.tier)
        if self.config.queue.inject_priority and doc is not None and tier is not None:
            doc["priority"] = tier.vllm_priority if tier.vllm_priority is not None else tier.priority
            mutated = True
        if mutated:
            common.body_mutation.body = orjson.dumps(doc)
        meta: dict[str, Any] = {"ticket": d.lease.ticket, "strip_usage": strip, "tenant": d.tenant}
        if d.lease.node is not None:
            meta["endpoint"] = d.lease.node  # the Lua helper turns it into the ORIGINAL_DST header
        return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common), dynamic_metadata=_metadata(meta))

    # -- the queue -------------------------------------------------------------------------------

    def hold_timeout(self, d: Decision) -> duration_pb2.Duration:
        """How long Envoy must wait for the reply to a queued request: its tier's deadline and a margin."""
        tier = self.config.tiers.get(d.tier)
        wait = tier.max_queue_wait_ms / 1000.0 if tier else 5.0
        out = duration_pb2.Duration()
        out.FromMilliseconds(int(min(MESSAGE_TIMEOUT_CEILING_S, wait + 1.0) * 1000))
        return out

    def pump(self) -> None:
        if self.admission.queued:
            self.deliver(self.admission.pump())
            self.export_queue()

    def deliver(self, outcomes: list[Outcome]) -> None:
        """Answer the queued requests the core has decided."""
        for o in outcomes:
            w = self._waiters.pop(o.ticket, None)
            d = o.decision
            self.stats.queue_wait.labels(d.tier, "admitted" if d.admitted else "rejected").observe(o.waited)
            if d.rejection is not None:
                self.stats.queue_rejections.labels(d.tier, d.rejection.reason).inc()
            if w is None:
                continue
            fut, est, request_id = w
            resp = self.respond(d, est, request_id)
            if not fut.done():
                fut.set_result((resp, d))

    def cancel(self, ticket: str) -> None:
        """The stream of a queued request ended before it was answered (the client went away)."""
        self._waiters.pop(ticket, None)
        lease_tier = self.admission.held_tier(ticket)
        if self.admission.cancel(ticket):
            self.export_queue()
            self.stats.queue_cancelled.labels(lease_tier or "unknown").inc()
            log.info("queued_request_cancelled", ticket=ticket, note="client went away while queued")

    def export_queue(self) -> None:
        q = self.admission.queue
        for tier in q.tiers():
            self.stats.queue_depth.labels(tier).set(q.depth(tier))

    def on_headers(self, msg: ep.ProcessingRequest) -> ep.ProcessingResponse:
        """Non-inference routes (GET /v1/models, ...): identity only, no quota."""
        auth = trusted_value = None
        for h in msg.request_headers.headers.headers:
            if h.key == "authorization":
                auth = h.raw_value.decode(errors="replace")
            elif h.key == self.config.identity.trusted_header:
                trusted_value = h.raw_value.decode(errors="replace")
        who = self.identifier.resolve(auth, trusted_value)
        if who.tenant is None and self.config.mode == "enforce":
            return _immediate(reject_reply(UNKNOWN_KEY))
        name = who.tenant.name if who.tenant else "unknown"
        meta: dict[str, Any] = {"tenant": name}
        if self.fleet is not None:
            c = self.fleet.choose(0, time.monotonic(), force=True)
            if c.node is None:
                return _immediate(reject_reply(self.admission.no_node(c.reason, c.retry_after)))
            meta["endpoint"] = c.node.address
        return ep.ProcessingResponse(request_headers=ep.HeadersResponse(), dynamic_metadata=_metadata(meta))

    def _log_decision(self, d: Decision, request_id: str, tokens: int) -> None:
        r = d.rejection
        if r is None:
            return
        log.info(
            "shadow_reject" if d.admitted else "reject",
            request_id=request_id, tenant=d.tenant, tier=d.tier, status=r.status, reason=r.reason,
            cls=r.klass, retry_after_s=None if r.retry_after is None else round(r.retry_after, 3),
            estimated_tokens=tokens,
        )

    # -- completions -----------------------------------------------------------------------------

    def on_access_log(self, entry: Any) -> None:
        common = entry.common_properties
        md = common.metadata.filter_metadata
        kv = md.get(META_NS)
        ticket = kv.fields["ticket"].string_value if kv is not None and "ticket" in kv.fields else ""
        flags = common.response_flags
        if not ticket:
            # No ticket: Envoy never applied an admit reply (client gone first). Release by id.
            c = self.admission.complete_request_id(entry.request.request_id)
            if c is not None:
                self.stats.completion(c, "aborted")
                self._node_done(c.lease.node, c.lease.ticket, 0, None)
                self.pump()
            return
        usage = None
        u = md.get(USAGE_NS)
        if u is not None and "completion_tokens" in u.fields:
            usage = Usage(int(u.fields["prompt_tokens"].number_value), int(u.fields["completion_tokens"].number_value))
        code = entry.response.response_code.value
        upstream_answered = common.HasField("time_to_first_upstream_rx_byte")
        responded = upstream_answered and 200 <= code < 300
        c = self.admission.complete(ticket, usage, responded)
        if c is None:
            return
        if usage is not None:
            outcome = "ok"
        elif flags.downstream_connection_termination:
            outcome = "disconnect"
        elif responded:
            outcome = "no_usage"
        else:
            outcome = "upstream_error"
        self.stats.completion(c, outcome)
        # the node's verdict for its breaker: it answered (below 500), it failed, or we cannot tell
        verdict: bool | None
        if upstream_answered:
            verdict = code < 500
        else:
            verdict = None if flags.downstream_connection_termination else False
        self._node_done(c.lease.node, c.lease.ticket, c.charged_tokens, verdict)
        self.pump()
        log.debug("complete", ticket=ticket, tenant=c.lease.tenant.name, outcome=outcome,
                  tokens=c.charged_tokens, seconds=round(c.seconds, 4), status=code)

    def _node_done(self, node: str | None, ticket: str, tokens: int, ok: bool | None) -> None:
        if node is not None and self.fleet is not None:
            self.fleet.completed(node, ticket, tokens, ok, time.monotonic())

    def reclaim(self) -> None:
        for c in self.admission.reclaim_expired():
            self.stats.completion(c, "reclaimed")
            self._node_done(c.lease.node, c.lease.ticket, 0, None)
            log.warning("lease_reclaimed", ticket=c.lease.ticket, tenant=c.lease.tenant.name,
                        age_s=round(c.seconds, 1), note="no completion arrived from Envoy's access log")


def _mtime(p: Path | None) -> float | None:
    if p is None:
        return None
    try:
        return p.stat().st_mtime
    except OSError:
        return None


class ExtProcServicer(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ep.ProcessingResponse]:
        gw = self.gw
        gw.open_streams += 1
        ticket = held = None
        clean = False
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("request")
                if kind == "request_body":
                    out, d = gw.on_body(msg)
                    if isinstance(out, asyncio.Future):  # queued: tell Envoy to wait longer, then wait
                        assert d.lease is not None
                        held = d.lease.ticket
                        if not out.done():
                            yield ep.ProcessingResponse(override_message_timeout=gw.hold_timeout(d))
                        resp, d = await out
                        held = None
                    else:
                        resp = out
                    if d.lease is not None:
                        ticket = d.lease.ticket
                    yield resp
                elif kind == "request_headers":
                    yield gw.on_headers(msg)
                elif kind is not None:
                    # A phase kvgate did not ask for (a misconfigured Envoy): let it through unchanged.
                    yield ep.ProcessingResponse(**{kind: _EMPTY[kind]()})
            clean = True
        except Exception:
            # Envoy turns the broken stream into a 500 → its local-reply mapper answers 503 + retry-after
            log.exception("extproc_stream_failed")
            raise
        finally:
            gw.open_streams -= 1
            if held is not None:
                gw.cancel(held)
            elif ticket is not None and not clean:
                gw.admission.mark_uncertain(ticket)


_EMPTY: dict[str, Any] = {
    "request_headers": ep.HeadersResponse,
    "response_headers": ep.HeadersResponse,
    "request_body": ep.BodyResponse,
    "response_body": ep.BodyResponse,
    "request_trailers": ep.TrailersResponse,
    "response_trailers": ep.TrailersResponse,
}


class AccessLogServicer(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def StreamAccessLogs(
        self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: grpc.aio.ServicerContext
    ) -> als_pb2.StreamAccessLogsResponse:
        async for msg in request_iterator:
            for entry in msg.http_logs.log_entry:
                try:
                    self.gw.on_access_log(entry)
                except Exception:
                    log.exception("access_log_entry_failed")
        return als_pb2.StreamAccessLogsResponse()


async def serve(config: Config, config_path: Path | None, ready: asyncio.Event | None = None) -> None:
    gw = Gateway(config, config_path)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    ep_grpc.add_ExternalProcessorServicer_to_server(ExtProcServicer(gw), server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLogServicer(gw), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(config.server.grpc_address)
    if port == 0:
        raise ConfigError(f"server.grpc_address: cannot listen on {config.server.grpc_address}")
    mhost, _, mport = config.server.metrics_address.rpartition(":")
    try:
        start_http_server(int(mport), addr=mhost or "0.0.0.0", registry=gw.stats.registry)
    except OSError as e:
        raise ConfigError(f"server.metrics_address: cannot listen on {config.server.metrics_address}: {e}") from None
    await server.start()
    for svc in ("", SERVICE_NAME):
        await health_servicer.set(svc, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving", grpc=config.server.grpc_address, metrics=config.server.metrics_address,
             tenants=len(config.tenants), mode=config.mode, pid=os.getpid())

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: gw.reload("SIGHUP"))
    if ready is not None:
        ready.set()

    async def housekeeping() -> None:
        n = 0
        while True:
            await asyncio.sleep(PUMP_INTERVAL_S)
            gw.pump()
            n += 1
            if n % 20 == 0 and gw.file_changed():
                gw.reload("file changed")
            if n % 200 == 0:
                gw.reclaim()

    task = asyncio.create_task(housekeeping())
    pollers = [asyncio.create_task(poll_nodes(gw)), asyncio.create_task(discover_nodes(gw))]
    await stop.wait()
    log.info("draining", open_streams=gw.open_streams, grace_s=config.server.drain_seconds)
    for svc in ("", SERVICE_NAME):
        await health_servicer.set(svc, health_pb2.HealthCheckResponse.NOT_SERVING)
    deadline = loop.time() + config.server.drain_seconds
    while gw.open_streams > 0 and loop.time() < deadline:
        await asyncio.sleep(0.05)
    for t in (task, *pollers):
        t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await t
    await server.stop(grace=0.5)
    log.info("stopped", open_streams=gw.open_streams, open_leases=gw.admission.open_leases)


async def poll_nodes(gw: Gateway) -> None:
    """Fetch every probe's snapshot in the background; a request never waits on this."""
    import aiohttp

    async def one(session: aiohttp.ClientSession, address: str, probe: str, timeout: float) -> None:
        assert gw.fleet is not None
        try:
            async with session.get(probe.rstrip("/") + "/snapshot", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                doc = await r.json()
            snap = Snapshot.from_json(doc)
        except Exception as e:  # a dead or confused probe only makes its node age
            log.debug("probe_failed", node=address, error=f"{type(e).__name__}: {e}")
            return
        gw.fleet.on_snapshot(address, snap, time.monotonic(), max(0.0, time.time() - snap.at))

    async with aiohttp.ClientSession() as session:
        while True:
            fleet, nodes_cfg = gw.fleet, gw.config.nodes
            if fleet is None or nodes_cfg is None:
                await asyncio.sleep(1.0)
                continue
            interval = nodes_cfg.poll_interval_seconds
            timeout = max(0.2, min(1.0, 2 * interval))
            await asyncio.gather(*(one(session, n.address, n.probe, timeout) for n in list(fleet.nodes.values())))
            gw.pump()
            gw.export_nodes()
            await asyncio.sleep(interval)


async def discover_nodes(gw: Gateway) -> None:
    """DNS of a headless Service: every address it resolves to is a node (with its probe beside it)."""
    import socket

    loop = asyncio.get_running_loop()
    while True:
        cfg = gw.config.nodes
        if cfg is None or cfg.dns is None or gw.fleet is None:
            await asyncio.sleep(5.0)
            continue
        dns = cfg.dns
        try:
            infos = await loop.getaddrinfo(dns.name, dns.port, type=socket.SOCK_STREAM)
            ips = sorted({str(i[4][0]) for i in infos})
            entries: list[tuple[str, str, float | None]] = [
                (f"{ip}:{dns.port}", f"http://{ip}:{dns.probe_port}", None) for ip in ips]
            entries += [(n.address, n.probe, n.kv_admit_threshold) for n in cfg.static]
            if set(e[0] for e in entries) != set(gw.fleet.nodes):
                log.info("nodes_discovered", name=dns.name, nodes=[e[0] for e in entries])
            gw.fleet.set_nodes(entries)
        except OSError as e:
            log.warning("node_discovery_failed", name=dns.name, error=str(e), kept=len(gw.fleet.nodes))
        await asyncio.sleep(dns.refresh_seconds)


def run(config_path: str, log_level: str = "info") -> int:
    logs.setup(log_level)
    path = Path(config_path)
    config = load_config(path)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(config, path))
    return 0
