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
