"""What the generated Envoy config does, seen through a real Envoy 1.40 process.

kvgate itself is not running: the configs are rendered fail-open (an unreachable ext_proc lets the
request through) so that only Envoy's own behaviour is under test — the route allowlist, slow
clients, a hung or slow-streaming node, circuit breakers, IPv6. A tiny threaded upstream plays the
node; what it does is chosen by the request path.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kvgate.dev.stack import envoy_binary, free_port, http_get, wait_port
from kvgate.envoy_config import EnvoyParams, bootstrap, dump


class Node(threading.Thread):
    """An HTTP/1.1 upstream: /v1/chat/completions answers at once; /v1/completions streams five chunks
    0.3 s apart; /v1/embeddings never answers; anything else answers 200 'node:<path>'."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        super().__init__(daemon=True)
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.paths: list[str] = []
        self.heads: list[bytes] = []

    def run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                got = conn.recv(65536)
                if not got:
                    return
                data += got
            head, _, body = data.partition(b"\r\n\r\n")
            path = head.split(b" ")[1].decode()
            self.paths.append(path)
            self.heads.append(head.lower())
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            chunked = b"transfer-encoding: chunked" in head.lower()
            while len(body) < length or (chunked and not body.endswith(b"0\r\n\r\n")):
                got = conn.recv(65536)
                if not got:
                    return
                body += got
            try:
                if path == "/v1/embeddings":
                    time.sleep(30)
                elif path == "/v1/completions":
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
                    for i in range(5):
                        time.sleep(0.3)
                        ev = f"data: {i}\n\n".encode()
                        conn.sendall(b"%x\r\n%s\r\n" % (len(ev), ev))
                    conn.sendall(b"0\r\n\r\n")
                else:
                    out = f"node:{path}".encode()
                    # one request per connection, said so: Envoy must not reuse a connection this
                    # closes (a request it sent there as the close lands would come back as a 503)
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
                                 % (len(out), out))
            except OSError:
                pass


def start_envoy(tmp: Path, params: EnvoyParams, kvgate: bool = True) -> subprocess.Popen[bytes]:
    cfg = tmp / f"envoy-{params.listen_port}.yaml"
    cfg.write_text(dump(bootstrap(params, kvgate=kvgate)))
    proc = subprocess.Popen([envoy_binary(), "-c", str(cfg), "--concurrency", "1", "--disable-hot-restart"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp / "envoy.log", "ab"))  # noqa: SIM115
    try:
        wait_port(params.admin_port, proc=proc)
        deadline = time.monotonic() + 20
        while http_get(f"http://127.0.0.1:{params.admin_port}/ready")[0] != 200:
            assert time.monotonic() < deadline, (tmp / "envoy.log").read_text()[-3000:]
            time.sleep(0.05)
    except BaseException:
        proc.kill()
        raise
    return proc


@pytest.fixture(scope="module")
def node() -> Node:
    n = Node()
    n.start()
    return n


@pytest.fixture(scope="module")
def envoy(node: Node, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnvoyParams]:
    p = EnvoyParams(
        listen_address="127.0.0.1", listen_port=free_port(), admin_port=free_port(), extproc_port=free_port(),
        upstreams=[("127.0.0.1", node.port)], fail_open=True, max_requests=4321,
        request_headers_timeout_ms=1000, first_byte_timeout_ms=1000, idle_timeout_ms=1000,
    )
    proc = start_envoy(tmp_path_factory.mktemp("envoy"), p)
    try:
        yield p
    finally:
        proc.kill()
        proc.wait()


def request(port: int, method: str, path: str, body: bytes = b"", host: str = "127.0.0.1",
            timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
    import http.client

    c = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        c.request(method, path, body=body or None, headers={"content-type": "application/json"})
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        c.close()


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/metrics"), ("POST", "/metrics"), ("GET", "/v1/chat/completions"), ("POST", "/v1/models"),
    ("GET", "/"), ("POST", "/v1/chat/completions/x"), ("DELETE", "/v1/models"),
])
def test_paths_outside_the_allowlist_get_envoys_404(envoy: EnvoyParams, node: Node, method: str, path: str) -> None:
    before = len(node.paths)
    code, headers, body = request(envoy.listen_port, method, path, b"{}" if method == "POST" else b"")
    assert code == 404
    assert headers["x-kvgate-reject-reason"] == "route-not-found"
    assert headers["content-type"] == "application/json"
    err = json.loads(body)["error"]
    assert err["code"] == "unknown_url" and err["type"] == "invalid_request_error"
    assert len(node.paths) == before  # the node never saw it


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v1/chat/completions"), ("POST", "/v1/embeddings?x=1"), ("POST", "/v1/responses"),
    ("GET", "/v1/models"), ("GET", "/health"),
])
def test_allowlisted_routes_reach_the_node(envoy: EnvoyParams, method: str, path: str) -> None:
    if path.startswith("/v1/embeddings"):
        path = "/v1/responses"  # the embeddings path is the hung node below
    code, _, body = request(envoy.listen_port, method, path, b"{}" if method == "POST" else b"")
    assert code == 200 and body == f"node:{path}".encode()


def test_circuit_breakers_are_set_on_both_clusters(envoy: EnvoyParams) -> None:
    _, text = http_get(f"http://127.0.0.1:{envoy.admin_port}/clusters")
    for cluster in ("kvgate_ext_proc", "llm_upstream"):
        for what in ("max_connections", "max_pending_requests", "max_requests"):
            assert f"{cluster}::default_priority::{what}::4321" in text.decode(), (cluster, what)


def test_a_client_sending_headers_slowly_is_cut(envoy: EnvoyParams, node: Node) -> None:
    before = len(node.paths)
    s = socket.create_connection(("127.0.0.1", envoy.listen_port), timeout=15)
    got = b""
    with s:
        try:
            for b in b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\nx-slow: " + b"a" * 200:
                s.sendall(bytes([b]))
                time.sleep(0.1)  # 200 bytes at 10 B/s: 20 s, far past the 1 s headers timeout
        except OSError:
            pass  # Envoy closed the connection
        try:
            got = s.recv(4096)
        except OSError:
            got = b""
    assert got == b"" or got.startswith(b"HTTP/1.1 408"), got
    assert len(node.paths) == before


def test_a_client_sending_the_body_slowly_is_cut(tmp_path: Path, node: Node) -> None:
    p = EnvoyParams(listen_address="127.0.0.1", listen_port=free_port(), admin_port=free_port(),
                    extproc_port=free_port(), upstreams=[("127.0.0.1", node.port)], fail_open=True,
                    request_timeout_ms=1000)
    proc = start_envoy(tmp_path, p)
    try:
        s = socket.create_connection(("127.0.0.1", p.listen_port), timeout=15)
        got = b""
        with s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n")
            try:
                for _ in range(100):
                    s.sendall(b"a")
                    time.sleep(0.1)
            except OSError:
                pass
            try:
                got = s.recv(4096)
            except OSError:
                got = b""
        assert got == b"" or got.startswith(b"HTTP/1.1 408"), got
    finally:
        proc.kill()
        proc.wait()


def test_a_hung_node_is_cut_by_the_first_byte_timeout(envoy: EnvoyParams) -> None:
    code, headers, body = request(envoy.listen_port, "POST", "/v1/embeddings", b"{}")
    assert code == 503 and headers["x-kvgate-reject-reason"] == "upstream-unavailable"
    assert "retry-after" in headers and json.loads(body)["error"]["code"] == "upstream_unavailable"


def test_a_stream_longer_than_both_timeouts_survives(envoy: EnvoyParams) -> None:
    # five chunks 0.3 s apart: 1.5 s in all, past the 1 s first-byte and idle timeouts, never idle 1 s
    code, _, body = request(envoy.listen_port, "POST", "/v1/completions", b"{}")
    assert code == 200 and body == b"".join(f"data: {i}\n\n".encode() for i in range(5))


def test_ipv6_listener_and_upstream(tmp_path: Path) -> None:
    n = Node("::1")
    n.start()
    p = EnvoyParams(listen_address="::", listen_port=free_port(), admin_port=free_port(), extproc_host="::1",
                    extproc_port=free_port(), upstreams=[("::1", n.port)], fail_open=True)
    proc = start_envoy(tmp_path, p)
    try:
        assert request(p.listen_port, "GET", "/v1/models", host="::1")[0] == 200
        assert request(p.listen_port, "GET", "/v1/models", host="127.0.0.1")[0] == 200  # ipv4_compat
    finally:
        proc.kill()
        proc.wait()


def test_original_dst_takes_an_ipv6_endpoint(tmp_path: Path) -> None:
    """The ORIGINAL_DST cluster reads '[::1]:port' (what kvgate writes for an IPv6 node)."""
    import http.client

    n = Node("::1")
    n.start()
    p = replace(EnvoyParams(listen_address="::1", listen_port=free_port(), admin_port=free_port()),
                original_dst=True)
    proc = start_envoy(tmp_path, p, kvgate=False)  # no Lua: the client's header stands in for kvgate's
    try:
        c = http.client.HTTPConnection("::1", p.listen_port, timeout=10)
        c.request("GET", "/v1/models", headers={"x-gateway-destination-endpoint": f"[::1]:{n.port}"})
        r = c.getresponse()
        assert r.status == 200 and r.read() == b"node:/v1/models"
    finally:
        proc.kill()
        proc.wait()


def test_the_trusted_header_from_the_client_is_stripped(tmp_path: Path, node: Node) -> None:
    p = EnvoyParams(listen_address="127.0.0.1", listen_port=free_port(), admin_port=free_port(),
                    extproc_port=free_port(), upstreams=[("127.0.0.1", node.port)], fail_open=True,
                    trusted_header="X-Auth-Tenant")
    proc = start_envoy(tmp_path, p)
    try:
        import http.client

        c = http.client.HTTPConnection("127.0.0.1", p.listen_port, timeout=10)
        c.request("GET", "/v1/models", headers={"x-auth-tenant": "someone-else", "x-other": "kept"})
        assert c.getresponse().status == 200
        head = node.heads[-1]
        assert b"x-other: kept" in head and b"x-auth-tenant" not in head
    finally:
        proc.kill()
        proc.wait()


def test_the_access_log_reports_local_5xx_on_inference_routes(tmp_path: Path, node: Node) -> None:
    """kvgate unreachable, fail closed: the 503 Envoy gives an inference request is logged (kvgate
    releases by request id whatever it may have admitted); GET routes and 404s are not."""
    p = EnvoyParams(listen_address="127.0.0.1", listen_port=free_port(), admin_port=free_port(),
                    extproc_port=free_port(), upstreams=[("127.0.0.1", node.port)])
    doc = bootstrap(p)
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    log = tmp_path / "access.log"
    (al,) = hcm["access_log"]
    al["name"] = "envoy.access_loggers.file"  # the same filter, written to a file instead of kvgate
    al["typed_config"] = {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
        "path": str(log), "log_format": {"text_format_source": {"inline_string": "%REQ(:PATH)% %RESPONSE_CODE%\n"}},
    }
    cfg = tmp_path / "envoy.yaml"
    cfg.write_text(dump(doc))
    proc = subprocess.Popen([envoy_binary(), "-c", str(cfg), "--concurrency", "1", "--disable-hot-restart"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(p.listen_port, proc=proc)
        code, headers, _ = request(p.listen_port, "POST", "/v1/chat/completions", b"{}")
        assert code == 503 and headers["x-kvgate-reject-reason"] == "gateway-unavailable"
        assert request(p.listen_port, "GET", "/v1/models")[0] == 503
        assert request(p.listen_port, "POST", "/metrics", b"{}")[0] == 404
        assert request(p.listen_port, "POST", "/v1/responses", b"{}")[0] == 503
        deadline = time.monotonic() + 10
        while log.read_text().count("\n") < 2 if log.exists() else True:
            assert time.monotonic() < deadline, "no access log entries"
            time.sleep(0.05)
        time.sleep(0.3)  # anything else would have been flushed with them
        assert log.read_text().splitlines() == ["/v1/chat/completions 503", "/v1/responses 503"]
    finally:
        proc.kill()
        proc.wait()


def _raw(port: int, data: bytes) -> bytes:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        s.sendall(data)
        out = b""
        while got := s.recv(65536):
            out += got
        return out
    finally:
        s.close()


@pytest.mark.parametrize(("data", "status", "reason"), [
    (b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-bad: a\x00b\r\n\r\n", 400, "invalid-http"),
    (b"GARBAGE\r\n\r\n", 400, "invalid-http"),
    (b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 100_000 + b"\r\n\r\n", 431, "headers-too-large"),
    (b"GET /v1/models HTTP/1.0\r\nhost: x\r\n\r\n", 426, "http-version"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
     501, "not-implemented"),
], ids=["nul-in-header", "not-http", "huge-header", "http-1.0", "gzip-te"])
def test_envoys_own_protocol_errors_are_openai_json(envoy: EnvoyParams, data: bytes, status: int, reason: str) -> None:
    """Envoy answers these itself (plain text by default): a client's SDK must get the same JSON shape
    as from any other refusal, with the reason header."""
    head, _, body = _raw(envoy.listen_port, data).partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0].split(" ")[1] == str(status), lines[0]
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    assert headers["x-kvgate-reject-reason"] == reason
    assert headers["content-type"] == "application/json"
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and err["code"]


def test_dot_segments_and_doubled_slashes_are_resolved_before_routing(envoy: EnvoyParams, node: Node) -> None:
    """(red team) ``/v1/models/../../metrics`` matched the bodyless prefix route and reached the node as
    sent; Envoy now normalizes the path first (escaped slashes stay: ``meta-llama%2FLlama``)."""
    seen = len(node.paths)
    code, h, _ = request(envoy.listen_port, "GET", "/v1/models/../../metrics")
    assert code == 404 and h.get("x-kvgate-reject-reason") == "route-not-found"
    assert not any("metrics" in p for p in node.paths[seen:])
    code, _, _ = request(envoy.listen_port, "GET", "//v1//models")
    assert code == 200 and node.paths[-1] == "/v1/models"
    code, _, _ = request(envoy.listen_port, "GET", "/v1/models/meta-llama%2FLlama-3")
    assert code == 200 and node.paths[-1] == "/v1/models/meta-llama%2FLlama-3"
