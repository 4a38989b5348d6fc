"""Who is asking: API key → tenant.

Keys are only ever held as SHA-256 digests; the plaintext key from the request is hashed and
dropped here, so nothing downstream (logs, metrics, metadata) can leak it. Error messages never
quote the header either.

The ``Authorization`` grammar is explicit (RFC 9110 §11.6.2 with a token68-style credential):
``Bearer`` in any letter case, one or more spaces, then one credential of printable ASCII without
spaces or commas. Envoy joins repeated headers with ``,``, so two ``Authorization`` headers arrive as
``Bearer a,Bearer b``: a comma is refused rather than picking one of them.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from .config import Config, Tenant
from .reasons import Invalid

_CREDENTIAL = re.compile(r"[\x21-\x2b\x2d-\x7e]+")
"""Printable ASCII (``!`` to ``~``) except the comma that joins repeated headers."""


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
        ident = config.identity
        self._trusted = ident.trusted_header
        self._override = ident.trusted_header_overrides_key
        self._fallback: Tenant | None = None
        if ident.unknown_keys == "default" and ident.default_tenant is not None:
            self._fallback = self._by_name[ident.default_tenant]

    @property
    def trusted_header(self) -> str | None:
        return self._trusted

    def resolve(self, authorization: str | None, trusted_value: str | None = None) -> Resolved:
        """Resolve a request's tenant.

        Raises :class:`~ext_proc.reasons.Invalid` (``invalid-authorization``) for a present but
        malformed ``Authorization`` header, whatever ``unknown_keys`` says; a missing or empty one
        is an unknown caller.

        The trusted header, when configured, is accepted only if it names a configured tenant: a
        forged or unexpected value can never create a tenant (nor a metric label). It names the
        tenant of a request without a valid key; it overrides the tenant of a valid key only with
        ``identity.trusted_header_overrides_key``. When it names a tenant, a malformed
        ``Authorization`` is not an error (the filter in front may use another scheme). The Envoy in
        front must overwrite or remove that header on requests from clients.
        """
        trusted: Tenant | None = None
        if self._trusted is not None and trusted_value:
            trusted = self._by_name.get(trusted_value.strip())
        try:
            key = bearer_credential(authorization)
        except Invalid:
            if trusted is None:
                raise
            key = None
        by_key = self._by_digest.get(hash_key(key)) if key is not None else None
        if by_key is not None and (trusted is None or not self._override):
            return Resolved(by_key, True)
        if trusted is not None:
            return Resolved(trusted, True)
        return Resolved(self._fallback, False)


def bearer_credential(authorization: str | None) -> str | None:
    """The credential of an ``Authorization: Bearer <key>`` value; None when the header is missing or
    empty. Anything else present raises ``Invalid("invalid-authorization")``; the message never
    contains the value."""
    if authorization is None:
        return None
    value = authorization.strip(" \t")
    if not value:
        return None
    scheme, sep, rest = value.partition(" ")
    if not sep or scheme.lower() != "bearer":
        raise _malformed("the scheme must be 'Bearer' followed by a space and the key")
    credential = rest.lstrip(" ")
    if not credential:
        raise _malformed("the key after 'Bearer' is empty")
    if "," in credential:
        raise _malformed("send exactly one Authorization header (got several, or a key with a comma)")
    if not _CREDENTIAL.fullmatch(credential):
        raise _malformed("the key must be one word of printable ASCII (no spaces or control characters)")
    return credential


def _malformed(why: str) -> Invalid:
    return Invalid("invalid-authorization", f"The Authorization header is malformed: {why}. "
                   "Send exactly one 'Authorization: Bearer <key>' header.")
