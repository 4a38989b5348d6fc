"""Prompts that share a prefix, in the trace format and in virtual time (the simulated nodes' prefix cache)."""

from __future__ import annotations

import json

import pytest

from ext_proc.config import parse_config
from ext_proc.profiles import PROFILES
from kvgate.bench.scenarios.driver import Policy, simulate
from kvgate.bench.scenarios.trace import TraceRequest, parse_line


def test_segments_and_session_round_trip_and_bad_ones_say_what_is_wrong() -> None:
    r = TraceRequest(1.0, "a", 3000, 20, segments=(("sys-a", 1500), ("doc-7", 1200)), session="chat-1")
    assert parse_line(json.dumps(r.to_json())) == r
    assert "segments" not in TraceRequest(1.0, "a", 30, 2).to_json(), "absent unless given: old traces unchanged"
    for doc, what in (({"segments": [["s", 4000]]}, "more than prompt_tokens"),
                      ({"segments": [["s", 0]]}, r"segments\[0\]"),
                      ({"segments": [[1, 10]]}, r"segments\[0\]"),
                      ({"segments": "s"}, "segments: must be a list"),
                      ({"session": ""}, "session")):
        with pytest.raises(ValueError, match=what):
            parse_line(json.dumps({"t": 0, "tenant": "a", "prompt_tokens": 3000, "output_tokens": 5, **doc}))


def test_the_nodes_prefill_a_shared_prefix_once_and_the_results_say_so() -> None:
    cfg = parse_config({"tenants": [{"name": "a"}]})
    shared = [TraceRequest(i * 0.5, "a", 3000, 20, segments=(("sys", 2000),)) for i in range(20)]
    plain = [TraceRequest(i * 0.5, "a", 3000, 20) for i in range(20)]
    one = PROFILES["8b-h100"]
    assert simulate(cfg, Policy("none", 1), one, plain).prefill_tokens_computed == 60_000
    # the 2,000-token prefix (125 full blocks) is computed by the first request only
    assert simulate(cfg, Policy("none", 1), one, shared).prefill_tokens_computed == 60_000 - 19 * 2000
