from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ext_proc.identity import hash_key
from kvgate.dev.stack import Stack
from tests import tiers


@pytest.hookimpl(tryfirst=True)  # before -m deselects: it selects on these markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test gets its tier (unit, slow, e2e) and what it needs (envoy, redis, prometheus, helm):
    see tests/tiers.py."""
    tiers.mark(items)


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test classified unit that starts a process fails, naming the marker it needs."""
    if request.node.get_closest_marker("unit") is not None:
        tiers.refuse_processes(request.node.nodeid, monkeypatch)


KEYS = {name: f"sk-test-{name}" for name in ("open", "tight", "tokens", "shadowed", "cap")}


def tenants() -> list[dict[str, Any]]:
    return [
        {"name": "open", "api_key_sha256": [hash_key(KEYS["open"])], "max_prompt_tokens": 2000,
         "max_context_tokens": 4000},
        {"name": "tight", "api_key_sha256": [hash_key(KEYS["tight"])], "max_concurrent": 1,
         "requests_per_minute": 6000},
        {"name": "tokens", "api_key_sha256": [hash_key(KEYS["tokens"])], "tokens_per_minute": 600,
         "token_burst": 300},
        {"name": "shadowed", "mode": "shadow", "api_key_sha256": [hash_key(KEYS["shadowed"])], "max_concurrent": 1},
    ]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    st = Stack(tmp_path_factory.mktemp("stack"), {"limits": {"max_body_bytes": 200_000}, "tenants": tenants()},
               token_ms=5.0)
    st.start()
    try:
        yield st
    finally:
        st.stop()


@pytest.fixture
def fresh_stack(tmp_path: Path) -> Iterator[Stack]:
    """A stack of one's own, for tests that kill, reload or reconfigure things."""
    st = Stack(tmp_path, {"tenants": tenants()}, token_ms=5.0)
    try:
        yield st
    finally:
        st.stop()
