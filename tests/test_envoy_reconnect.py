"""An Envoy whose access-log connection is reset and comes back from a new port is the same Envoy:
the requests it still carries keep their leases (issue: they were released as ``envoy_gone`` after
``ENVOY_GRACE_S``, so ``max_concurrent: 1`` admitted a second request). Real gRPC, kvgate's own
servicers; the client plays Envoy."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from ext_proc import core as core_mod
from ext_proc.addresses import peer_host
from ext_proc.config import parse_config
from ext_proc.identity import hash_key
from ext_proc.server import (
    ATTR_AUTH,
    ATTR_ID,
    ATTR_NS,
    ATTR_PATH,
    META_NS,
    SERVICE_NAME,
    AccessLogServicer,
    Gateway,
    _process_handler,
)


def test_peer_host_drops_only_the_port() -> None:
    assert peer_host("ipv4:127.0.0.1:5000") == peer_host("ipv4:127.0.0.1:6001") == "ipv4:127.0.0.1"
    assert peer_host("ipv6:[::1]:5000") == "ipv6:[::1]"
    assert peer_host("ipv4:10.0.0.7:5000") != peer_host("ipv4:10.0.0.8:5000")
    assert peer_host("unix:/run/envoy.sock") == "unix:/run/envoy.sock"
    assert peer_host("odd") == "odd"


OWN = [("grpc.use_local_subchannel_pool", 1)]
"""Each channel its own connection (channels of one process share them by default)."""


def _body(request_id: str) -> bytes:
    s = struct_pb2.Struct()
    s.update({ATTR_AUTH: "Bearer k", ATTR_PATH: "/v1/chat/completions", ATTR_ID: request_id})
    msg = ep.ProcessingRequest(request_body=ep.HttpBody(
        body=b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4}', end_of_stream=True))
    msg.attributes[ATTR_NS].CopyFrom(s)
    return msg.SerializeToString()


async def _decide(channel: grpc.aio.Channel, request_id: str) -> Any:
    call = channel.stream_stream(f"/{SERVICE_NAME}/Process", request_serializer=lambda b: b,
                                 response_deserializer=ep.ProcessingResponse.FromString)

    async def one() -> Any:
        yield _body(request_id)

    async for reply in call(one()):
        return reply
    raise AssertionError("no reply")


def _log(ticket: str, request_id: str) -> als_pb2.StreamAccessLogsMessage:
    entry = accesslog_pb2.HTTPAccessLogEntry()
    entry.request.request_id = request_id
    entry.response.response_code.value = 200
    md = struct_pb2.Struct()
    md.update({"ticket": ticket})
    entry.common_properties.metadata.filter_metadata[META_NS].CopyFrom(md)
    entry.common_properties.time_to_first_upstream_rx_byte.FromMilliseconds(5)
    msg = als_pb2.StreamAccessLogsMessage()
    msg.identifier.node.id = "envoy-0"
    msg.identifier.log_name = "kvgate"
    msg.http_logs.log_entry.append(entry)
    return msg


async def _access_log(ch: grpc.aio.Channel, msgs: list[als_pb2.StreamAccessLogsMessage],
                      hold: asyncio.Event) -> None:
    stub = als_pb2_grpc.AccessLogServiceStub(ch)

    async def stream() -> Any:
        for m in msgs:
            yield m
        await hold.wait()

    await stub.StreamAccessLogs(stream())


async def test_a_reset_access_log_connection_keeps_the_leases_of_running_requests(monkeypatch: Any) -> None:
    monkeypatch.setattr(core_mod, "ENVOY_GRACE_S", 0.3)
    cfg = parse_config({"tenants": [{"name": "t", "api_key_sha256": [hash_key("k")], "max_concurrent": 1}]})
    gw = Gateway(cfg)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_process_handler(gw),))
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLogServicer(gw), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        # Envoy's first connection carries both the decision's stream and the access log (one channel)
        first = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OWN)
        hold = asyncio.Event()
        log1 = asyncio.create_task(_access_log(first, [], hold))
        admitted = await _decide(first, "r1")
        assert not admitted.HasField("immediate_response")
        assert gw.core.open_leases == 1
        await first.close(None)  # the connection is reset ...
        log1.cancel()
        second = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OWN)  # ... and comes back from a new port
        log2 = asyncio.create_task(_access_log(second, [], hold))
        await asyncio.sleep(0.6)  # past the grace period
        gw.core.tick()
        assert gw.core.open_leases == 1, "a running request's lease was released as envoy_gone"
        refused = await _decide(second, "r2")
        assert refused.immediate_response.status.code == 429  # max_concurrent: 1 still holds
        lease = next(iter(gw.core.admission.leases()))
        end = asyncio.create_task(_access_log(second, [_log(lease.ticket, "r1")], hold))
        for _ in range(100):
            if gw.core.open_leases == 0:
                break
            await asyncio.sleep(0.02)
        assert gw.core.open_leases == 0  # the real completion reconciles it
        hold.set()
        await asyncio.gather(end, log2, return_exceptions=True)
        await second.close(None)
    finally:
        await server.stop(None)
