"""The gRPC shell: Envoy's ExternalProcessor and AccessLogService around the gateway core (``core.py``).

Per inference request Envoy opens one ext_proc stream and sends a single buffered body message
carrying the few request attributes kvgate needs (authorization, path, request id). kvgate answers
and **closes the stream cleanly** right away: per Envoy's ext_proc contract the request then proceeds
without the server, so a kvgate restart or crash never cuts a request it already admitted, and an
open request holds no slot of Envoy's circuit breaker towards kvgate. A request that waits in the
gateway queue keeps its stream until its answer.

Completion comes through Envoy's gRPC access log: a Lua filter copies the response's final usage into
dynamic metadata and the log entry delivers it when the stream ends (normally, on an upstream error,
by a client disconnect). Each lease remembers which Envoy asked for it (the gRPC peer's address without
its port, which survives a reconnect); when an Envoy's access-log connections all end and none comes
back, its leases are released (``core.py``).

Everything that is not transport lives in the core; this module turns protobuf into core events and
core answers into protobuf, and runs the supervised background tasks (probe polling, discovery, the
tick, the config watcher).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import descriptor_pb2, descriptor_pool, duration_pb2, message_factory, struct_pb2
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import Counter, Gauge, start_http_server

from . import cpuparts, intake, logs
from .addresses import join_hostport, peer_host, split_hostport
from .admission import Usage
from .config import Config, ConfigError, load_config
from .core import Answer, Borrow, Core, Ended, Held, Request
from .reasons import reject
from .sizes import grpc_receive_bytes
from .stats import Stats

if TYPE_CHECKING:
    from .spendgate import SpendGate
    from .store import SharedStore
from .wire import REASON_HEADER, Reply, reject_reply

log = logs.get("kvgate.extproc")

ATTR_NS = "envoy.filters.http.ext_proc"
META_NS = "kvgate"
USAGE_NS = "kvgate.usage"
ATTR_AUTH = "request.headers['authorization']"
ATTR_PATH = "request.path"
ATTR_ID = "request.id"
SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
TICK_S = 0.05
"""How often the core is ticked (queue deadlines, Envoys gone, reclaim) besides its other events."""
RELOAD_CHECK_S = 1.0
MESSAGE_TIMEOUT_CEILING_S = 59.0
"""Below the generated filter's max_message_timeout (60 s)."""
TASK_FAILURES = 5
"""A background task that fails this many times within ``TASK_FAILURE_WINDOW_S`` makes kvgate
NOT_SERVING until it has run ``TASK_HEALTHY_S`` without failing."""
TASK_FAILURE_WINDOW_S = 60.0
TASK_HEALTHY_S = 30.0


def trusted_attr(header: str) -> str:
    return f"request.headers['{header}']"


_NO_FIELDS: dict[str, Any] = {}


def _tail(common: Any) -> float:
    """``Ended.tail_s`` from an access log's timings: its last byte sent downstream less its last byte received
    upstream, both from the request's start (0 where either is missing: a stream the node never finished)."""
    if not (common.HasField("time_to_last_downstream_tx_byte") and common.HasField("time_to_last_upstream_rx_byte")):
        return 0.0
    down, up = common.time_to_last_downstream_tx_byte, common.time_to_last_upstream_rx_byte
    tail: float = (down.seconds - up.seconds) + (down.nanos - up.nanos) * 1e-9
    return max(0.0, tail)


def _text(v: Any) -> str:
    return v.string_value if v is not None else ""


def _with_attributes(body: ep.ProcessingRequest, first: ep.ProcessingRequest) -> ep.ProcessingRequest:
    out = ep.ProcessingRequest()
    out.CopyFrom(body)
    for k, v in first.attributes.items():
        out.attributes[k].CopyFrom(v)
    return out


def _metadata(values: dict[str, Any]) -> struct_pb2.Struct:
    """``values`` under the ``kvgate`` namespace. Field by field rather than ``Struct.update``: the
    values are only strings and booleans, and update's generic walk cost more than the rest of the
    reply (per request, on the hot path)."""
    s = struct_pb2.Struct()
    fields = s.fields[META_NS].struct_value.fields
    for k, v in values.items():
        if isinstance(v, bool):
            fields[k].bool_value = v
        elif isinstance(v, str):
            fields[k].string_value = v
        else:
            fields[k].CopyFrom(_value(v))
    return s


def _value(v: Any) -> struct_pb2.Value:
    out = struct_pb2.Value()
    s = struct_pb2.Struct()
    s.update({"v": v})
    out.CopyFrom(s.fields["v"])
    return out


def _part(v: struct_pb2.Value | None, whole: float) -> int:
    """A part of a usage count (cached prompt, reasoning tokens): 0 when absent or not a count within it."""
    if v is None:
        return 0
    x = v.number_value
    return int(x) if math.isfinite(x) and 0 <= x <= whole else 0


def _immediate(reply: Reply) -> ep.ProcessingResponse:
    reason = next((v for k, v in reply.headers if k == REASON_HEADER), "reject" if reply.status >= 400 else "answer")
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


def envoy_reply(a: Answer, headers_phase: bool = False) -> ep.ProcessingResponse:
    """The ext_proc message for a core answer."""
    if a.reply is not None:
        return _immediate(a.reply)
    if headers_phase:
        return ep.ProcessingResponse(request_headers=ep.HeadersResponse(), dynamic_metadata=_metadata(a.metadata))
    common = ep.CommonResponse()
    if a.body is not None:
        common.body_mutation.body = a.body
    return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common), dynamic_metadata=_metadata(a.metadata))


# -- bytes that are not UTF-8 ---------------------------------------------------------------------
#
# A request attribute (an Authorization header, say) with bytes that are not UTF-8 makes protobuf's
# decoder refuse the whole ProcessingRequest before any handler runs: Envoy would answer 500 (503
# with retry), and with failure_mode_allow the request would pass uncounted — any client could switch
# fail-open on. So the server decodes itself: on a DecodeError the message is read again with a
# lenient twin of the same wire format whose attribute strings are bytes, and the request is answered
# 401 (its credentials are not UTF-8) or 400.

def _lenient_type() -> Any:
    f = descriptor_pb2.FileDescriptorProto(name="kvgate_lenient.proto", package="kvgate.lenient", syntax="proto3")
    T = descriptor_pb2.FieldDescriptorProto
    value = f.message_type.add(name="Value")
    value.field.add(name="string_value", number=3, type=T.TYPE_BYTES, label=T.LABEL_OPTIONAL)
    fields = f.message_type.add(name="FieldsEntry")
    fields.field.add(name="key", number=1, type=T.TYPE_BYTES, label=T.LABEL_OPTIONAL)
    fields.field.add(name="value", number=2, type=T.TYPE_MESSAGE, type_name=".kvgate.lenient.Value",
                     label=T.LABEL_OPTIONAL)
    struct = f.message_type.add(name="Struct")
    struct.field.add(name="fields", number=1, type=T.TYPE_MESSAGE, type_name=".kvgate.lenient.FieldsEntry",
                     label=T.LABEL_REPEATED)
    attrs = f.message_type.add(name="AttributesEntry")
    attrs.field.add(name="key", number=1, type=T.TYPE_BYTES, label=T.LABEL_OPTIONAL)
    attrs.field.add(name="value", number=2, type=T.TYPE_MESSAGE, type_name=".kvgate.lenient.Struct",
                    label=T.LABEL_OPTIONAL)
    req = f.message_type.add(name="ProcessingRequest")
    number = ep.ProcessingRequest.DESCRIPTOR.fields_by_name["attributes"].number
    req.field.add(name="attributes", number=number, type=T.TYPE_MESSAGE,
                  type_name=".kvgate.lenient.AttributesEntry", label=T.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("kvgate.lenient.ProcessingRequest"))


_LENIENT = _lenient_type()


class Undecodable:
    """A ProcessingRequest protobuf would not decode; what is known of it."""

    def __init__(self, raw: bytes) -> None:
        self.bad: list[str] = []
        self.request_id = ""
        try:
            msg = _LENIENT.FromString(raw)
        except DecodeError:
            self.bad.append("<message>")
            return
        for entry in msg.attributes:
            for f in entry.value.fields:
                name = f.key.decode(errors="replace")
                try:
                    text = f.value.string_value.decode()
                except UnicodeDecodeError:
                    self.bad.append(name)
                    continue
                if name == ATTR_ID:
                    self.request_id = text

    def answer(self) -> ep.ProcessingResponse:
        if any("authorization" in b for b in self.bad):
            r = reject("invalid-authorization", "The Authorization header is not valid UTF-8.")
        else:
            r = reject("invalid-body", "The request has header or path bytes that are not valid UTF-8.")
        return _immediate(reject_reply(r))


def _decode(raw: bytes) -> ep.ProcessingRequest | Undecodable:
    try:
        return ep.ProcessingRequest.FromString(raw)
    except DecodeError:
        return Undecodable(raw)


class Gateway:
    """The shell's state: the core, the config file, the streams waiting for a queued answer."""

    def __init__(self, config: Config, config_path: Path | None = None,
                 overrides: dict[str, Any] | None = None) -> None:
        self.config_path = config_path
        self.overrides = overrides or {}
        """``server.*`` settings from the command line: they win over the file's at every reload."""
        self.core = Core(config, time.monotonic, log=logs.get("kvgate.core"), wall=time.time)
        self.core.pump_once_per_turn(self._later)
        self._waiters: dict[str, asyncio.Future[Answer]] = {}
        self._seen = _stat(config_path)
        self._pending_stat: tuple[float, int] | None = None
        self.open_streams = 0
        self.receive_limit = grpc_receive_bytes(config.limits.max_body_bytes)
        """The gRPC server's receive limit, fixed when it starts (``serve``)."""
        self._trusted_attr: str | None = None
        self.task_restarts = Counter("kvgate_task_restarts_total", "Background tasks restarted after a failure",
                                     ["task"], registry=self.stats.registry)
        self.config_info = Gauge("kvgate_config_info", "The config this replica runs: version is the SHA-256 "
                                 "(first 12 hex digits) of the file it loaded", ["version"],
                                 registry=self.stats.registry)
        self._version = ""
        self.parts: cpuparts.CpuParts | None = None
        if cpuparts.enabled():
            self._measure_parts()
        self.store: SharedStore | None = None
        if config.store.redis is not None:
            from .store import SharedStore

            # a sync that frees queued requests answers them at once, not at the next tick
            self.store = SharedStore(config.store.redis, self.core, self.stats.registry, on_change=self.flush)
        self.spend: SpendGate | None = None
        """The shared spend ledger (``spendgate.py``): with a store, every tenant's budgets are checked
        fleet-wide in Redis before an admission goes out."""
        if self.store is not None and config.store.redis is not None:
            from .spendgate import SpendGate
            from .spendstore import SpendStore

            rs = config.store.redis
            self.spend = SpendGate(SpendStore(self.store.client, self.core.admission.replica, config.prices,
                                              {t.name: t.budgets for t in config.tenants if t.budgets},
                                              key_prefix=rs.key_prefix), self.core, rs.timeout_ms / 1000.0)
        self._apply(config)

    def _measure_parts(self) -> None:
        """``KVGATE_CPU_PARTS=1``: count the request path's CPU by part (``cpuparts.py``)."""
        p = self.parts = cpuparts.CpuParts()
        p.patch(self.core, "core", ("decide", "ended", "tick", "cancel", "snapshot", "headers", "remote"))
        p.patch(self.stats, "metrics", ("decision", "completion"))
        p.patch(self.stats.decision_seconds, "metrics", ("observe",))
        p.patch(self.core.log, "logging", ("debug", "info", "warning", "error", "exception"))
        p.patch(self, "shell", ("on_body", "on_headers", "on_access_log", "flush"))
        self.stats.registry.register(p)

    @property
    def config(self) -> Config:
        return self.core.config

    @property
    def stats(self) -> Stats:
        return self.core.stats

    @property
    def fleet(self) -> Any:
        return self.core.fleet

    def _apply(self, config: Config) -> None:
        h = config.identity.trusted_header
        self._trusted_attr = trusted_attr(h) if h else None
        version = _version(self.config_path)
        if version != self._version:
            if self._version:
                self.config_info.remove(self._version)
            self.config_info.labels(version).set(1)
            self._version = version

    # -- config ----------------------------------------------------------------------------------

    def reload(self, reason: str) -> bool:
        """Load the config file again; a bad, empty or unreadable file keeps the running config."""
        if self.config_path is None:
            return False
        self._seen = _stat(self.config_path)
        self._pending_stat = None
        try:
            new = load_config(self.config_path, self.overrides)
        except ConfigError as e:
            self.stats.reloads.labels("error").inc()
            log.error("config_reload_failed", reason=reason, error=str(e), kept="previous config")
            return False
        if new.server != self.config.server:
            log.warning("config_server_changed", note="server.* settings take effect on restart only")
        if grpc_receive_bytes(new.limits.max_body_bytes) > self.receive_limit:
            # the gRPC server (and Envoy's buffer, rendered from the config) keep the size they started with
            log.warning("config_body_limit_raised", max_body_bytes=new.limits.max_body_bytes,
                        note="a body cap above the one kvgate started with takes effect on restart only "
                        "(kvgate's gRPC receive limit; regenerate Envoy's config too)")
        if new.store != self.config.store:
            log.warning("config_store_changed", note="store.* settings take effect on restart only")
            new = new.model_copy(update={"store": self.config.store})
        self.core.reconfigure(new)
        if self.spend is not None:
            self.spend.configure(self.core)
        self._apply(new)
        self.flush()
        self.stats.reloads.labels("ok").inc()
        log.info("config_reloaded", reason=reason, tenants=len(new.tenants), mode=new.mode)
        return True

    def check_file(self) -> None:
        """Reload once the file changed and then stayed the same for one check (a file being
        written is not read half-way)."""
        if self.config_path is None:
            return
        st = _stat(self.config_path)
        if st == self._seen:
            self._pending_stat = None
            return
        if st is not None and st == self._pending_stat:
            self.reload("file changed")
        else:
            self._pending_stat = st

    # -- events ----------------------------------------------------------------------------------

    def _later(self, run: Callable[[], None]) -> None:
        """The core's put-off pump (``Core.pump_once_per_turn``): at the end of this loop turn, then the
        answers it decided to their streams; at once where no loop runs (start-up)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._turn_end(run)
            return
        loop.call_soon(self._turn_end, run)

    def _turn_end(self, run: Callable[[], None]) -> None:
        run()
        self.flush()

    def flush(self) -> None:
        """Hand the answers the core decided for queued requests to their streams."""
        for a in self.core.answers():
            fut = self._waiters.pop(a.held, None) if a.held else None
            if fut is not None and not fut.done():
                fut.set_result(a)

    def on_body(self, msg: ep.ProcessingRequest, peer: str, first: ep.ProcessingRequest | None = None
                ) -> Answer | tuple[Held, asyncio.Future[Answer]] | Borrow:
        """Decide one inference request: its answer, or for a queued request what its stream awaits.
        ``first``: the headers message of an Envoy that sends one first; it carried the attributes."""
        t0 = time.perf_counter()
        if first is not None and ATTR_NS not in msg.attributes:
            msg = _with_attributes(msg, first)
        attrs = msg.attributes.get(ATTR_NS)
        fields = attrs.fields if attrs is not None else _NO_FIELDS  # (looked up once, not per attribute)
        auth = fields.get(ATTR_AUTH)
        req = Request(
            path=_text(fields.get(ATTR_PATH)), request_id=_text(fields.get(ATTR_ID)),
            authorization=(auth.string_value or None) if auth is not None else None, body=msg.request_body.body,
            trusted=_text(fields.get(self._trusted_attr)) if self._trusted_attr else None, envoy=peer,
        )
        out = self.core.decide(req)
        if isinstance(out, Borrow):
            self.stats.decision_seconds.observe(time.perf_counter() - t0)
            return out
        result: Answer | tuple[Held, asyncio.Future[Answer]] = out if isinstance(out, Answer) else (
            out, self.wait_for(out))
        self.flush()
        self.stats.decision_seconds.observe(time.perf_counter() - t0)
        return result

    async def borrow(self, b: Borrow) -> Answer | tuple[Held, asyncio.Future[Answer]]:
        """The tenant's slice here is short: borrow from the store (one round trip), decide again."""
        if self.store is not None:
            est = b.request.estimate
            tokens = float(est.total) if est is not None else 0.0
            # the tenant and its per-model budget, both short here: one round trip, both answers applied
            # together, and the decision follows at once (no other request takes what was borrowed)
            await self.store.borrow(b.tenant, tokens, b.also)
        out = self.core.decide(b.request, borrowed=True)
        assert not isinstance(out, Borrow)
        result: Answer | tuple[Held, asyncio.Future[Answer]] = out if isinstance(out, Answer) else (
            out, self.wait_for(out))
        self.flush()
        return result

    def wait_for(self, held: Held) -> asyncio.Future[Answer]:
        fut: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._waiters[held.ticket] = fut
        return fut

    def forget(self, held: Held) -> None:
        self._waiters.pop(held.ticket, None)

    def on_headers(self, msg: ep.ProcessingRequest) -> ep.ProcessingResponse:
        """Bodyless routes (GET /v1/models, ...): identity only, no quota."""
        auth: list[str] = []
        trusted = None
        path = ""
        for h in msg.request_headers.headers.headers:
            if h.key == ":path":
                path = h.raw_value.decode(errors="replace")
            elif h.key == "authorization":
                auth.append(h.raw_value.decode(errors="replace"))
            elif h.key == self.config.identity.trusted_header:
                trusted = h.raw_value.decode(errors="replace")
        return envoy_reply(self.core.headers(",".join(auth) if auth else None, trusted, path), headers_phase=True)

    def on_access_log(self, entry: Any, logged: frozenset[str] = frozenset()) -> None:
        """One access-log entry; ``logged``: the request headers this Envoy's logger sends
        (:func:`logged_headers`)."""
        common = entry.common_properties
        md = common.metadata.filter_metadata
        kv = md.get(META_NS)
        kf = kv.fields if kv is not None else _NO_FIELDS  # each map looked up once
        ticket = _text(kf.get("ticket"))
        if not ticket and "rejected" in kf:
            return  # kvgate's own refusal ending (the client left during it): it held nothing
        usage = None
        u = md.get(USAGE_NS)
        uf = u.fields if u is not None else _NO_FIELDS
        pv = uf.get("prompt_tokens")
        if pv is not None:
            p = pv.number_value
            cv = uf.get("completion_tokens")
            c = cv.number_value if cv is not None else 0.0
            if math.isfinite(p) and math.isfinite(c) and 0 <= p < 1e12 and 0 <= c < 1e12:  # else: unreported
                usage = Usage(int(p), int(c), _part(uf.get("cached_tokens"), p), _part(uf.get("reasoning_tokens"), c))
        e = Ended(
            ticket or None, entry.request.request_id, entry.response.response_code.value, usage,
            upstream_answered=common.HasField("time_to_first_upstream_rx_byte"),
            disconnected=common.response_flags.downstream_connection_termination,
            credentials=self._credentials(entry, logged) if not ticket else None,
            tail_s=_tail(common) if ticket else 0.0,
        )
        if self.store is not None and ticket and not self.core.owns(ticket):
            # another replica's: Envoy's access log may reach any replica
            # a best-effort request held none of its tenant's slots: none to give back if its owner died; one
            # sent on its tenant's cap's stretch holds the tenant's own only if it took one over since (the
            # store's list of heirs says; its per-model budget's, it held all along)
            quota = not (be := kf.get("best_effort")) or not be.bool_value
            stretched = quota and (st := kf.get("stretched")) is not None and st.bool_value
            self.store.forward(e, _text(kf.get("tenant")) if quota else "", _text(kf.get("budget")) if quota else "",
                               stretched=stretched)
            return
        done = self.core.ended(e)
        if done is None and self.store is not None and not ticket and self.core.tombstoned(e.request_id):
            self.store.forward(e)  # a decision Envoy gave up on may be another replica's
        self.flush()

    def _credentials(self, entry: Any, logged: frozenset[str]) -> tuple[str | None, str | None] | None:
        """What identifies the request, when this Envoy logs every header that does (else None: unknown)."""
        trusted = self.config.identity.trusted_header
        if "authorization" not in logged or (trusted and trusted.lower() not in logged):
            return None
        headers = entry.request.request_headers
        return headers.get("authorization"), headers.get(trusted.lower()) if trusted else None

    def hold_timeout(self, held: Held) -> duration_pb2.Duration:
        """How long Envoy must wait for the answer to a queued request: its tier's deadline and a margin."""
        out = duration_pb2.Duration()
        out.FromMilliseconds(int(min(MESSAGE_TIMEOUT_CEILING_S, held.max_wait_s + 1.0) * 1000))
        return out


def _version(p: Path | None) -> str:
    """The config file's version: the first 12 hex digits of its SHA-256 ("none" without a file)."""
    if p is None:
        return "none"
    try:
        return hashlib.sha256(p.read_bytes()).hexdigest()[:12]
    except OSError:
        return "unreadable"


def _stat(p: Path | None) -> tuple[float, int] | None:
    if p is None:
        return None
    try:
        st = p.stat()
    except OSError:
        return None
    return st.st_mtime, st.st_size


class ExtProcServicer:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.reply = envoy_reply if gw.parts is None else gw.parts.wrap("protobuf", envoy_reply)

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest | Undecodable], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ep.ProcessingResponse]:
        gw = self.gw
        gw.open_streams += 1
        first: ep.ProcessingRequest | None = None
        try:
            async for msg in request_iterator:
                if isinstance(msg, Undecodable):
                    log.info("request_not_utf8", request_id=msg.request_id, attributes=msg.bad)
                    yield msg.answer()
                    return
                kind = msg.WhichOneof("request")
                if kind == "request_body":
                    out = gw.on_body(msg, peer_host(context.peer()), first)
                    if isinstance(out, Borrow):
                        out = await gw.borrow(out)
                    if isinstance(out, tuple):  # queued: tell Envoy to wait longer, then wait
                        held, fut = out
                        try:
                            if not fut.done():
                                yield ep.ProcessingResponse(override_message_timeout=gw.hold_timeout(held))
                            answer = await fut
                        except BaseException:
                            # the client or Envoy gave up (the stream was cancelled) while it waited
                            if not fut.done() or fut.cancelled():  # (a cancelled await cancels fut too)
                                gw.core.cancel(held.ticket)
                                gw.flush()
                            raise
                        finally:
                            gw.forget(held)
                    else:
                        answer = out
                    if gw.spend is not None and answer.reply is None:
                        answer = await gw.spend.gate(answer)  # the fleet's spend budgets (one round trip)
                    yield self.reply(answer)
                    # Done: closing the stream cleanly lets Envoy go on without kvgate. A kvgate restart
                    # from here on does not touch this request.
                    return
                if kind == "request_headers":
                    reply = gw.on_headers(msg)
                    yield reply
                    if reply.HasField("immediate_response") or msg.request_headers.end_of_stream:
                        return  # refused, or a bodyless request: nothing more to decide
                    # a body follows (an Envoy that sends headers first, e.g. Envoy Gateway): it is
                    # decided on its own message; Envoy sent the request attributes with this one
                    first = msg
                    continue
                if kind is not None:
                    # A phase kvgate did not ask for (a misconfigured Envoy): let it through unchanged.
                    yield ep.ProcessingResponse(**{kind: _EMPTY[kind]()})
        except Exception:
            # Envoy turns the broken stream into a 500 → its local-reply mapper answers 503 + retry-after
            log.exception("extproc_stream_failed")
            raise
        finally:
            gw.open_streams -= 1


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
        peer = peer_host(context.peer())  # the Envoy, not this connection: a reset one comes back
        core = self.gw.core
        core.envoy_up(peer)
        logged: frozenset[str] = frozenset()
        try:
            async for msg in request_iterator:
                if msg.HasField("identifier"):  # (the stream's first message)
                    logged = logged_headers(msg.identifier.log_name)
                for entry in msg.http_logs.log_entry:
                    try:
                        self.gw.on_access_log(entry, logged)
                    except Exception:
                        log.exception("access_log_entry_failed")
        finally:
            core.envoy_down(peer)
        return als_pb2.StreamAccessLogsResponse()


def logged_headers(log_name: str) -> frozenset[str]:
    """The request headers an Envoy's access logger sends with each entry, from its ``log_name``
    (``kvgate;headers=authorization,x-tenant``, as ``kvgate envoy-config`` renders it): an older config
    (``kvgate``) logs none, and its entries' credentials are then unknown, not absent."""
    _, sep, names = log_name.partition(";headers=")
    return frozenset(n for n in names.split(",") if n) if sep else frozenset()


def _process_handler(gw: Gateway) -> grpc.GenericRpcHandler:
    servicer = ExtProcServicer(gw)
    decode: Callable[[bytes], Any] = _decode
    encode: Callable[[Any], bytes] = ep.ProcessingResponse.SerializeToString
    if gw.parts is not None:
        decode, encode = gw.parts.wrap("protobuf", decode), gw.parts.wrap("protobuf", encode)
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "Process": grpc.stream_stream_rpc_method_handler(
            servicer.Process, request_deserializer=decode, response_serializer=encode),
    })


class Supervisor:
    """Background tasks that restart when they fail; health turns NOT_SERVING only when one keeps
    failing (``TASK_FAILURES`` within ``TASK_FAILURE_WINDOW_S``) and SERVING again once it has run
    ``TASK_HEALTHY_S`` without a failure."""

    def __init__(self, gw: Gateway, on_health: Callable[[bool], Awaitable[None]],
                 backoff: Callable[[int], float] = lambda n: min(5.0, 0.1 * 2 ** min(n, 6))) -> None:
        self.gw = gw
        self._on_health = on_health
        self._backoff = backoff
        self._failures: dict[str, list[float]] = {}
        self._sick: set[str] = set()
        self.tasks: list[asyncio.Task[None]] = []

    def start(self, name: str, factory: Callable[[], Awaitable[None]]) -> None:
        self.tasks.append(asyncio.create_task(self._run(name, factory), name=name))

    async def _run(self, name: str, factory: Callable[[], Awaitable[None]]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await factory()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                now = loop.time()
                recent = [t for t in self._failures.get(name, []) if now - t < TASK_FAILURE_WINDOW_S] + [now]
                self._failures[name] = recent
                self.gw.task_restarts.labels(name).inc()
                log.exception("task_failed", task=name, failures_in_window=len(recent), restarting=True)
                if len(recent) >= TASK_FAILURES and name not in self._sick:
                    self._sick.add(name)
                    log.error("task_unhealthy", task=name, note="health is NOT_SERVING until it recovers")
                    await self._on_health(False)
                await asyncio.sleep(self._backoff(len(recent)))
            if name in self._sick and loop.time() - started >= TASK_HEALTHY_S:
                self._sick.discard(name)
                if not self._sick:
                    await self._on_health(True)

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t


async def serve(config: Config, config_path: Path | None, ready: asyncio.Event | None = None,
                overrides: dict[str, Any] | None = None) -> None:
    gw = Gateway(config, config_path, overrides)
    # the largest message Envoy can send for this body cap (ext_proc/sizes.py); gRPC's default is 4 MiB
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0),
                                      ("grpc.max_receive_message_length", gw.receive_limit)])
    server.add_generic_rpc_handlers((_process_handler(gw),))
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLogServicer(gw), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(config.server.grpc_address)
    if port == 0:
        raise ConfigError(f"server.grpc_address: cannot listen on {config.server.grpc_address}")
    try:
        mhost, mport = split_hostport(config.server.metrics_address)
        start_http_server(mport, addr=mhost, registry=gw.stats.registry)
    except (OSError, ValueError) as e:
        raise ConfigError(f"server.metrics_address: cannot listen on {config.server.metrics_address}: {e}") from None
    await server.start()

    async def set_health(ok: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for svc in ("", SERVICE_NAME):
            await health_servicer.set(svc, status)

    await set_health(True)
    log.info("serving", grpc=config.server.grpc_address, metrics=config.server.metrics_address,
             tenants=len(config.tenants), mode=config.mode, pid=os.getpid(), body_scan=intake.SCAN_KIND)
    if intake.SCAN_KIND != "c":  # (an install without a C compiler: every large body costs more to read)
        log.warning("body_scan_pure_python", reason="ext_proc._jsonscan was not built",
                    effect="intake and the estimate run their Python loops: 2-10x the CPU on large bodies")

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: gw.reload("SIGHUP"))
    if ready is not None:
        ready.set()

    sup = Supervisor(gw, set_health)
    sup.start("tick", lambda: tick(gw))
    sup.start("config_watch", lambda: watch_config(gw))
    sup.start("probe_poll", lambda: poll_nodes(gw))
    sup.start("node_discovery", lambda: discover_nodes(gw))
    if gw.store is not None:
        sup.start("store_sync", gw.store.run)
    if gw.spend is not None:
        sup.start("spend_sync", gw.spend.run)
    await stop.wait()
    log.info("draining", open_streams=gw.open_streams, grace_s=config.server.drain_seconds)
    await set_health(False)
    # Admitted requests no longer hold a stream: what is left are requests waiting in the queue
    # (and decisions in progress). They get their answer, or Envoy's retryable 503, by the deadline.
    deadline = loop.time() + config.server.drain_seconds
    while gw.open_streams > 0 and loop.time() < deadline:
        await asyncio.sleep(0.05)
    await sup.stop()
    await server.stop(grace=0.5)
    if gw.store is not None:
        await gw.store.close()
    log.info("stopped", open_streams=gw.open_streams, open_leases=gw.core.open_leases)


async def tick(gw: Gateway) -> None:
    while True:
        await asyncio.sleep(TICK_S)
        gw.core.tick()
        gw.flush()


async def watch_config(gw: Gateway) -> None:
    while True:
        await asyncio.sleep(RELOAD_CHECK_S)
        gw.check_file()


async def poll_nodes(gw: Gateway) -> None:
    """Follow every probe in the background; a request never waits on this. Each probe streams its
    readings over one connection (``follow.py``; a probe without the stream is polled as before). A
    probe that is down, slow, silent or talks nonsense only makes its own node age towards unknown."""
    from .follow import Follower

    await Follower(gw.core, gw.flush).run()


async def discover_nodes(gw: Gateway) -> None:
    """DNS of a headless Service: every address it resolves to (A and AAAA) is a node, with its probe;
    each pool with ``nodes.dns`` is looked up at its own ``refresh_seconds``."""
    loop = asyncio.get_running_loop()
    due: dict[str, float] = {}
    while True:
        now = loop.time()
        pools = [(p.name, p.nodes) for p in gw.core.router.pools
                 if p.nodes is not None and p.nodes.dns is not None and p.name in gw.core.fleets]
        for name, cfg in pools:
            assert cfg is not None and cfg.dns is not None
            if due.get(name, 0.0) > now:
                continue
            dns = cfg.dns
            due[name] = now + dns.refresh_seconds
            fleet = gw.core.fleets[name]
            try:
                infos = await loop.getaddrinfo(dns.name, dns.port, type=socket.SOCK_STREAM)
                ips = sorted({str(i[4][0]) for i in infos})
                entries: list[tuple[str, str, float | None]] = [
                    (join_hostport(ip, dns.port), f"http://{join_hostport(ip, dns.probe_port)}", None) for ip in ips]
                entries += [(n.address, n.probe, n.kv_admit_threshold) for n in cfg.static]
                if {e[0] for e in entries} != set(fleet.nodes):
                    log.info("nodes_discovered", pool=name, name=dns.name, nodes=[e[0] for e in entries])
                gw.core.set_nodes(entries, name)
                gw.flush()
            except OSError as e:
                log.warning("node_discovery_failed", pool=name, name=dns.name, error=str(e), kept=len(fleet.nodes))
        for gone in set(due) - {n for n, _ in pools}:
            del due[gone]
        await asyncio.sleep(max(0.05, min(due.values(), default=now + 5.0) - loop.time()) if pools else 5.0)


def run(config_path: str, log_level: str = "info", overrides: dict[str, Any] | None = None) -> int:
    logs.setup(log_level)
    path = Path(config_path)
    config = load_config(path, overrides)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(config, path, overrides=overrides))
    return 0
