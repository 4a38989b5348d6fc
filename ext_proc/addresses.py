"""``host:port`` strings, IPv6 included (``[::1]:8000``): one place that splits and joins them, for
kvgate's own listen addresses, discovered nodes and the scaler's replica URLs."""

from __future__ import annotations


def split_hostport(address: str, default_host: str = "0.0.0.0") -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` → (host without brackets, port); an empty host is ``default_host``."""
    host, _, port = address.rpartition(":")
    return host.strip("[]") or default_host, int(port)


def join_hostport(host: str, port: int | str) -> str:
    """(host, port) → ``host:port``, an IPv6 literal in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def peer_host(peer: str) -> str:
    """A gRPC peer (``ipv4:10.0.0.7:53412``, ``ipv6:[::1]:53412``, ``unix:/run/x.sock``) without its port.

    kvgate names an Envoy by its address, not its connection: a reset access-log connection comes back
    from a new port, and the requests that Envoy still carries must not be taken for dead. Two Envoys
    sharing one address (one host, no pod network) count as one: their leases are released when the
    last of them is gone (or by ``lease_timeout_seconds``)."""
    scheme, sep, rest = peer.partition(":")
    if not sep or scheme not in ("ipv4", "ipv6"):
        return peer
    host, colon, port = rest.rpartition(":")
    return f"{scheme}:{host}" if colon and port.isdigit() else peer
