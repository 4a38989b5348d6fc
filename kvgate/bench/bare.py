"""The transport floor: an ext_proc server that decides nothing (``kvgate bench overhead`` runs it).

It serves Envoy exactly what kvgate's server serves, on the same stack (grpc.aio on uvloop, the same
generic handler and protobuf classes, an access-log stream drained entry by entry), but answers every
body with one prebuilt CONTINUE reply carrying a fixed metadata map, and looks at no access-log entry.
Its CPU per request is what the transport costs before kvgate does anything: the floor against which
kvgate's own share is measured (``bench.overhead``'s ``cpu_breakdown``).

``python -m kvgate.bench.bare --config FILE`` listens on the config's ``server.grpc_address`` and serves an
empty ``/metrics`` on ``server.metrics_address`` (so the local stack waits for it as for kvgate).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, start_http_server

from ext_proc.addresses import split_hostport
from ext_proc.config import load_config
from ext_proc.server import META_NS, SERVICE_NAME


def _reply() -> bytes:
    meta = struct_pb2.Struct()
    meta.update({META_NS: {"ticket": "bare-1", "strip_usage": False, "tenant": "bench", "tier": "standard"}})
    return bytes(ep.ProcessingResponse(request_body=ep.BodyResponse(), dynamic_metadata=meta).SerializeToString())


class _Bare:
    def __init__(self) -> None:
        self.reply = _reply()
        self.entries = 0

    async def process(self, requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for raw in requests:
            msg = ep.ProcessingRequest.FromString(raw)
            if msg.WhichOneof("request") == "request_body":
                yield self.reply
                return
            yield ep.ProcessingResponse(request_headers=ep.HeadersResponse()).SerializeToString()


class _Logs(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    def __init__(self, bare: _Bare) -> None:
        self.bare = bare

    async def StreamAccessLogs(self, request_iterator: AsyncIterator[Any], context: Any) -> Any:
        async for msg in request_iterator:
            self.bare.entries += len(msg.http_logs.log_entry)
        return None


async def serve(config_path: str) -> None:
    cfg = load_config(config_path)
    bare = _Bare()
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    handler = grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "Process": grpc.stream_stream_rpc_method_handler(bare.process)})  # bytes in, bytes out
    server.add_generic_rpc_handlers((handler,))
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(_Logs(bare), server)
    checks = health.aio.HealthServicer()  # Envoy health-checks the ext_proc service before using it
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    server.add_insecure_port(cfg.server.grpc_address)
    host, port = split_hostport(cfg.server.metrics_address)
    start_http_server(port, addr=host, registry=CollectorRegistry())
    await server.start()
    for svc in ("", SERVICE_NAME):
        await checks.set(svc, health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=0.2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvgate.bench.bare", description=__doc__.split("\n", 1)[0])
    p.add_argument("--config", required=True)
    a = p.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(a.config))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
