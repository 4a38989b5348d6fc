"""The Redis scripts of ``ext_proc/lua/*.lua``, one by one, on a real ``redis-server``.

What the scripts do together with several replicas is ``test_store.py``; here each script is loaded as
Redis gets it (compiled by Redis's Lua 5.1, and by lupa's Lua for a second opinion) and the
bucket's arithmetic is checked against what a replica then does with the answer (``limits.Credit``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ext_proc.limits import Credit
from ext_proc.spendstore import SPEND_SCRIPTS
from ext_proc.store import BUCKET, LUA, SCRIPTS

from .redis_server import RedisServer

_prefixes = itertools.count()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    r = RedisServer(tmp_path_factory.mktemp("redis-lua")).start()
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture(scope="module")
def client(server: RedisServer) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(server.url)
    try:
        yield c
    finally:
        c.close()


def test_every_script_file_is_shipped_and_compiles(client: redis.Redis) -> None:
    files = sorted(p.stem for p in LUA.glob("*.lua"))
    assert files == ["bucket", "end", "fair", "hello", "slots", "spend_reserve", "spend_roll", "spend_settle"]
    for name, src in {**SCRIPTS, **SPEND_SCRIPTS}.items():
        assert client.script_load(src), name  # Redis compiles it (a syntax error raises)
    lupa = pytest.importorskip("lupa")
    rt = lupa.LuaRuntime()
    for p in LUA.glob("*.lua"):
        ok, err = rt.execute("return function(s) local f, e = (loadstring or load)(s); return f ~= nil, e end")(
            p.read_text())
        assert ok, f"{p.name}: {err}"


def test_the_package_ships_the_scripts() -> None:
    """``pip install`` (not only an editable checkout) carries the .lua files: package-data says so."""
    text = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    assert 'ext_proc = ["lua/*.lua"]' in text


def _bucket(client: redis.Redis) -> tuple[object, list[str]]:
    p = f"{{lua{next(_prefixes)}}}"
    client.set(f"{p}:epoch", "e1")
    return client.register_script(BUCKET), [f"{p}:b:a:tokens", f"{p}:learning", f"{p}:epoch"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(level=st.floats(0.0, 1e6, allow_nan=False, allow_infinity=False),
       need=st.floats(1e-3, 1e6, allow_nan=False, allow_infinity=False))
@example(level=190946.17594321707, need=961931.0735162556)  # level + (need - level) < need by one ulp
@example(level=0.30000000000000004, need=23.0)
def test_credit_leased_for_what_a_request_lacks_pays_for_it(client: redis.Redis, level: float, need: float) -> None:
    """Issue 29 bug 1: a replica holding ``level`` of credit borrows what ``need`` lacks; the bucket
    grants exactly that amount (``tostring`` kept 14 digits: 23 came back as 22.99999999999999), and
    the credit then pays for the request (``level + (need - level)`` may round below ``need``)."""
    script, keys = _bucket(client)
    c = Credit(60.0 * 1e9, 1e12, time.monotonic(), level=level)  # a fleet bucket far larger than any borrow
    amount = c.lacks(need)
    if amount > 0:
        granted, _ = script(keys=keys, args=[repr(c.rate), repr(c.capacity), repr(amount), 0, "e1"])
        assert float(granted) == amount, "granted exactly what was asked, to the last bit"
        c.level += float(granted)
    assert c.seconds_until(need, time.monotonic()) == 0.0, "the borrowed credit pays for the request"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(amounts=st.lists(st.floats(1e-6, 1e3, allow_nan=False, allow_infinity=False), min_size=1, max_size=8))
def test_the_bucket_level_survives_the_round_trip_exactly(client: redis.Redis, amounts: list[float]) -> None:
    """What the script answers as the fleet's level is the level it stored (``%.17g`` round-trips a
    double): what replicas read back adds up to what they leased, no credit lost or made by printing."""
    script, keys = _bucket(client)
    cap = 1e6
    for a in amounts:
        _, level = script(keys=keys, args=[repr(1e-9), repr(cap), repr(a), 0, "e1"])
        stored = client.hget(keys[0], "l")
        assert stored is not None
        assert float(level) == float(stored), "the answer is the stored level, every digit"
    assert script(keys=keys, args=["1", "10", "1", 0, "other"]) == [b"epoch"]
