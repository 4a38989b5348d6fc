import orjson

from ext_proc.admission import RateLimitView, Rejection
from ext_proc.config import parse_config
from ext_proc.identity import Identifier, hash_key
from ext_proc.wire import format_duration, reject_reply


def test_429_carries_retry_after_ratelimit_headers_and_openai_body() -> None:
    r = Rejection(429, "tenant-tokens", "policy", "slow down", retry_after=2.01,
                  tokens=RateLimitView(6000, 12, 75.0))
    reply = reject_reply(r)
    h = dict(reply.headers)
    assert reply.status == 429
    assert h["retry-after"] == "3"  # ceil, never rounds a wait down
    assert h["retry-after-ms"] == "2010"
    assert h["x-kvgate-reject-reason"] == "tenant-tokens"
    assert (h["x-ratelimit-limit-tokens"], h["x-ratelimit-remaining-tokens"], h["x-ratelimit-reset-tokens"]) == (
        "6000", "12", "1m15s")
    assert "x-ratelimit-limit-requests" not in h
    body = orjson.loads(reply.body)
    assert body == {"error": {"message": "slow down", "type": "tokens", "param": None, "code": "rate_limit_exceeded"}}


def test_retry_after_is_at_least_one_second() -> None:
    h = dict(reject_reply(Rejection(503, "fleet-inflight", "capacity", "busy", retry_after=0.12)).headers)
    assert h["retry-after"] == "1" and h["retry-after-ms"] == "120"


def test_format_duration() -> None:
    assert [format_duration(x) for x in (0.0201, 1.0, 1.25, 59.99, 60, 360.0)] == [
        "21ms", "1s", "1.3s", "60s", "1m0s", "6m0s"]


def test_identity_from_bearer_key_and_trusted_header() -> None:
    cfg = parse_config({"identity": {"trusted_header": "x-auth-tenant"},
                        "tenants": [{"name": "a", "api_key_sha256": [hash_key("key-a")]}, {"name": "b"}]})
    ident = Identifier(cfg)
    assert ident.resolve("Bearer key-a").tenant is not None
    assert ident.resolve("bearer   key-a ").tenant.name == "a"  # type: ignore[union-attr]
    assert ident.resolve("Bearer key-b").tenant is None
    assert ident.resolve("Basic key-a").tenant is None
    assert ident.resolve(None).tenant is None
    assert ident.resolve(None, "b").tenant.name == "b"  # type: ignore[union-attr]
    # a forged header value names no configured tenant: never a new tenant, falls back to the key
    r = ident.resolve("Bearer key-a", "evil-tenant")
    assert r.tenant is not None and r.tenant.name == "a"


def test_unknown_keys_can_map_to_a_default_tenant() -> None:
    cfg = parse_config({"identity": {"unknown_keys": "default", "default_tenant": "free"},
                        "tenants": [{"name": "free"}]})
    r = Identifier(cfg).resolve("Bearer whatever")
    assert r.tenant is not None and r.tenant.name == "free" and not r.known


def test_hash_key_is_sha256_hex() -> None:
    assert hash_key("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
