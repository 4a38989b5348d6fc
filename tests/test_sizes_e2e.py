"""Size limits agree end to end (ext_proc/sizes.py): every body Envoy buffers reaches kvgate whole, with
the largest headers Envoy lets through, in both failure modes — so a request that can never succeed
gets kvgate's 413, never a retryable 503, and fail-open never lets an undecided request through."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ext_proc.sizes import ENVOY_MIN_BODY_BUFFER_BYTES
from kvgate.dev.stack import Stack
from kvgate.envoy_config import EnvoyParams
from tests.conftest import KEYS, tenants
from tests.helpers import chat, metric, post, wait_for

CAP = 200_000
CHAT = "/v1/chat/completions"


def exactly(n: int) -> bytes:
    """A chat body of exactly n bytes."""
    base = json.dumps(chat("")).encode()
    return json.dumps(chat("x" * (n - len(base)))).encode()


@pytest.mark.envoy
@pytest.mark.parametrize("fail_open", [False, True], ids=["fail-closed", "fail-open"])
def test_bodies_at_every_edge_are_decided_by_kvgate(tmp_path: Path, fail_open: bool) -> None:
    with Stack(tmp_path, {"limits": {"max_body_bytes": CAP}, "tenants": tenants()}, token_ms=1.0,
               envoy=EnvoyParams(fail_open=fail_open)) as st:
        for n in (CAP - 1, CAP):
            code, h, raw = post(st.url + CHAT, None, KEYS["tight"], raw=exactly(n))
            assert code == 200, (n, raw[:200])
            # "tight" may run one request at a time, and its slot comes back with Envoy's access log,
            # which can trail the response on a busy machine (a 429 tenant-concurrency was seen in CI)
            wait_for(lambda: metric(st.metrics_url, "kvgate_inflight_requests", tenant="tight") == 0,
                     what="the tenant's slot released")
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
