from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ext_proc.identity import hash_key
from kvgate.dev.stack import Stack

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
