"""kvgate in front of the simulated vLLM node: vLLM's own stream format, accounted and untouched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ext_proc.identity import hash_key
from ext_proc.profiles import PROFILES
from kvgate.dev.stack import Stack
from tests.helpers import metric, post, wait_for

MODEL = PROFILES["8b-h100"].model_name


@pytest.mark.parametrize("stream", [False, True])
def test_usage_of_a_vllm_like_node_is_accounted(tmp_path: Path, stream: bool) -> None:
    cfg = {"tenants": [{"name": "t", "api_key_sha256": [hash_key("sk-t")], "max_concurrent": 4}]}
    with Stack(tmp_path, cfg, sim_args=["--num-gpu-blocks", "512"]) as st:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 80}], "max_tokens": 9,
                "ignore_eos": True, "stream": stream}
        code, _, raw = post(st.url + "/v1/chat/completions", body, "sk-t")
        assert code == 200
        if stream:
            events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e.strip()]
            chunks = [json.loads(e) for e in events[:-1]]
            assert events[-1] == "[DONE]" and all(c["choices"] for c in chunks)  # usage chunk stripped
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        wait_for(lambda: metric(st.metrics_url, "kvgate_tokens_total", tenant="t", kind="completion") == 9,
                 what="completion tokens from the node's usage")
        assert metric(st.metrics_url, "kvgate_tokens_total", tenant="t", kind="prompt") == 4 + 20
        assert metric(st.metrics_url, "kvgate_inflight_requests", tenant="t") == 0
        node = f"http://127.0.0.1:{st.envoy.upstreams[0][1]}/metrics"
        assert metric(node, "vllm:generation_tokens_total") == 9
