import logging
from typing import Any

import orjson
import pytest

from ext_proc.admission import RateLimitView, Rejection
from ext_proc.config import parse_config
from ext_proc.identity import Identifier, bearer_credential, hash_key
from ext_proc.reasons import Invalid
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
    with pytest.raises(Invalid):
        ident.resolve("Basic key-a")  # a present but malformed header: 401 invalid-authorization
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


def _ident(**identity: Any) -> Identifier:
    return Identifier(parse_config({"identity": identity, "tenants": [
        {"name": "a", "api_key_sha256": [hash_key("key-a")]}, {"name": "b", "api_key_sha256": [hash_key("key-b")]},
        {"name": "free"}]}))


@pytest.mark.parametrize("value", ["Bearer key-a", "bearer key-a", "BEARER key-a", "BeArEr key-a", "Bearer  key-a",
                                   " Bearer key-a\t"])
def test_bearer_scheme_is_case_insensitive(value: str) -> None:
    r = _ident().resolve(value)
    assert r.tenant is not None and r.tenant.name == "a" and r.known


@pytest.mark.parametrize("value", [
    "Bearer key-a,Bearer key-b",  # two Authorization headers, joined by Envoy
    "Bearer key-a, Bearer key-b",
    "Bearer key-a,",
    "Basic a2V5LWE=", "Token key-a", "key-a", "Bearer", "Bearer ", "Bearer\tkey-a", "Bearerkey-a",
    "Bearer key a", "Bearer key-a extra", "Bearer ke\x00y", "Bearer ke\x7fy", "Bearer kéy", "Bearer key-\u200b",
    "Bearer \udcff\udcfe",  # what a lenient decode of non-UTF-8 bytes gives
])
@pytest.mark.parametrize("unknown_keys", ["reject", "default"])
def test_malformed_authorization_is_invalid_whatever_unknown_keys_says(value: str, unknown_keys: str) -> None:
    ident = _ident(unknown_keys=unknown_keys, default_tenant="free") if unknown_keys == "default" else _ident()
    with pytest.raises(Invalid) as e:
        ident.resolve(value)
    assert e.value.name == "invalid-authorization"
    rej = e.value.rejection()
    assert rej.status == 401 and rej.klass == "auth"
    assert "key-a" not in e.value.message and "a2V5" not in e.value.message  # never echoes the key


def test_missing_or_empty_authorization_is_an_unknown_caller() -> None:
    for value in (None, "", "   "):
        assert _ident().resolve(value).tenant is None
        r = _ident(unknown_keys="default", default_tenant="free").resolve(value)
        assert r.tenant is not None and r.tenant.name == "free" and not r.known


def test_bearer_credential_grammar() -> None:
    assert bearer_credential("Bearer sk-proj_AZaz09.~+/=") == "sk-proj_AZaz09.~+/="
    assert bearer_credential('bearer !"#$%&()*') == '!"#$%&()*'
    assert bearer_credential(None) is None


def test_trusted_header_never_overrides_a_valid_key_by_default() -> None:
    ident = _ident(trusted_header="x-tenant")
    r = ident.resolve("Bearer key-a", "b")
    assert r.tenant is not None and r.tenant.name == "a"
    # no key, or a key nobody owns: the trusted header names the tenant
    assert ident.resolve(None, "b").tenant.name == "b"  # type: ignore[union-attr]
    assert ident.resolve("Bearer nobody", "b").tenant.name == "b"  # type: ignore[union-attr]
    # it never names a tenant that is not configured
    assert ident.resolve(None, "ghost").tenant is None
    assert ident.resolve("Bearer key-b", "ghost").tenant.name == "b"  # type: ignore[union-attr]


def test_trusted_header_overrides_key_when_configured() -> None:
    ident = _ident(trusted_header="x-tenant", trusted_header_overrides_key=True)
    assert ident.resolve("Bearer key-a", "b").tenant.name == "b"  # type: ignore[union-attr]
    assert ident.resolve("Bearer key-a", "ghost").tenant.name == "a"  # type: ignore[union-attr]


def test_trusted_header_without_the_setting_is_ignored() -> None:
    assert _ident().resolve("Bearer key-a", "b").tenant.name == "a"  # type: ignore[union-attr]
    assert _ident().resolve(None, "b").tenant is None


def test_a_trusted_tenant_excuses_an_authorization_meant_for_the_filter_in_front() -> None:
    ident = _ident(trusted_header="x-tenant")
    assert ident.resolve("Basic dXNlcjpwdw==", "b").tenant.name == "b"  # type: ignore[union-attr]
    with pytest.raises(Invalid):
        ident.resolve("Basic dXNlcjpwdw==", "ghost")


def test_keys_are_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    ident = _ident()
    ident.resolve("Bearer key-a")
    try:
        ident.resolve("Bearer key-a,Bearer key-b")
    except Invalid as e:
        assert "key-a" not in str(e) and "key-b" not in str(e)
    assert "key-a" not in caplog.text
    assert not any(len(d) != 64 for d in ident._by_digest)  # only digests are held
