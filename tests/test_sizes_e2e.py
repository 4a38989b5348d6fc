"""Size limits agree end to end (ext_proc/sizes.py): every body Envoy buffers reaches kvgate whole, with
the largest headers Envoy lets through, in both failure modes — so a request that can never succeed
gets kvgate's 413, never a retryable 503, and fail-open never lets an undecided request through."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ext_proc.sizes import ENVOY_MIN_BODY_BUFFER_BYTES, MAX_REQUEST_HEADERS_KB, grpc_receive_bytes
from kvgate.envoy_config import EnvoyParams, bootstrap, params_for
from kvgate.stack import Stack
from tests.conftest import KEYS, tenants
from tests.helpers import chat, post

pytestmark = pytest.mark.envoy

CAP = 200_000
CHAT = "/v1/chat/completions"


def exactly(n: int) -> bytes:
    """A chat body of exactly n bytes."""
    base = json.dumps(chat("")).encode()
    return json.dumps(chat("x" * (n - len(base)))).encode()


def test_the_grpc_limit_covers_envoys_buffer_and_headers() -> None:
    from ext_proc.config import Config
    for cap in (1, CAP, ENVOY_MIN_BODY_BUFFER_BYTES, 16 * 1024 * 1024):
        cfg = Config.model_validate({"limits": {"max_body_bytes": cap}})
        p = params_for(cfg, EnvoyParams())
        listener = bootstrap(p)["static_resources"]["listeners"][0]
        buffered = listener["per_connection_buffer_limit_bytes"]
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        assert buffered >= cap
        assert hcm["max_request_headers_kb"] == MAX_REQUEST_HEADERS_KB
        assert grpc_receive_bytes(cap) > buffered + MAX_REQUEST_HEADERS_KB * 1024


@pytest.mark.parametrize("fail_open", [False, True], ids=["fail-closed", "fail-open"])
def test_bodies_at_every_edge_are_decided_by_kvgate(tmp_path: Path, fail_open: bool) -> None:
    with Stack(tmp_path, {"limits": {"max_body_bytes": CAP}, "tenants": tenants()}, token_ms=1.0,
               envoy=EnvoyParams(fail_open=fail_open)) as st:
        for n in (CAP - 1, CAP):
            code, h, raw = post(st.url + CHAT, None, KEYS["tight"], raw=exactly(n))
            assert code == 200, (n, raw[:200])
        code, h, _ = post(st.url + CHAT, None, KEYS["tight"], raw=exactly(CAP + 1))
        assert code == 413 and h["x-kvgate-reject-reason"] == "body-too-large"
        # within Envoy's buffer by a few hundred bytes, with ~30 KB of the attributes kvgate receives
        # (a long query string travels in request.path): gRPC's default 4 MiB limit refused this message
        pad = "?pad=" + "p" * 30_000
        near = exactly(ENVOY_MIN_BODY_BUFFER_BYTES - 200)
        code, h, raw = post(st.url + CHAT + pad, None, KEYS["tight"], raw=near, timeout=30)
        assert code == 413, raw[:300]
        assert h["x-kvgate-reject-reason"] == "body-too-large"
        assert "retry-after" not in h
        # a 30 KB Authorization header (no such key): kvgate's 401, not a 503 or a pass-through
        code, h, raw = post(st.url + CHAT, None, "sk-" + "k" * 30_000, raw=near, timeout=30)
        assert code == 401, raw[:300]
        code, h, raw = post(st.url + CHAT, None, KEYS["tight"], raw=exactly(ENVOY_MIN_BODY_BUFFER_BYTES + 1),
                            timeout=30)
        assert code == 413 and json.loads(raw)["error"]["code"] == "request_too_large"
        assert "larger than max" not in st.log("kvgate")
