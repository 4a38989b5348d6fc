"""Who is asking: API key → tenant.

Keys are only ever held as SHA-256 digests; the plaintext key from the request is hashed and
dropped here, so nothing downstream (logs, metrics, metadata) can leak it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .config import Config, Tenant


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Resolved:
    tenant: Tenant | None
    """None: the caller is not known (no key, or a key no tenant owns) and unknown_keys is 'reject'."""
    known: bool
    """False when the tenant was chosen by the unknown-key policy rather than by the key itself."""


class Identifier:
    def __init__(self, config: Config) -> None:
        self._by_digest = {d: t for t in config.tenants for d in t.api_key_sha256}
        self._by_name = {t.name: t for t in config.tenants}
        self._trusted = config.identity.trusted_header
        ident = config.identity
        self._fallback: Tenant | None = None
        if ident.unknown_keys == "default" and ident.default_tenant is not None:
            self._fallback = self._by_name[ident.default_tenant]

    @property
    def trusted_header(self) -> str | None:
        return self._trusted

    def resolve(self, authorization: str | None, trusted_value: str | None = None) -> Resolved:
        """Resolve a request's tenant.

        The trusted header, when configured, wins — but only if it names a configured tenant: a
        forged or unexpected value can never create a tenant (nor a metric label). The Envoy in front
        must overwrite or remove that header on requests from clients.
        """
        if self._trusted is not None and trusted_value:
            t = self._by_name.get(trusted_value.strip())
            if t is not None:
                return Resolved(t, True)
        key = _bearer(authorization)
        if key:
            t = self._by_digest.get(hash_key(key))
            if t is not None:
                return Resolved(t, True)
        return Resolved(self._fallback, False)


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, rest = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return rest.strip() or None
