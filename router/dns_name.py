"""``NAME:PORT``: a DNS name to resolve and the port every address it gives listens on.

Parsed where the settings are checked (``--peers-dns``), so a malformed value fails at
start; resolved by :mod:`kvroute.router.routing.peer_discovery`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DnsName:
    """``NAME:PORT``: the name to resolve and the port every peer publishes on."""

    host: str
    port: int

    @classmethod
    def parse(cls, value: str) -> DnsName:
        host, sep, port = value.strip().rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"expected NAME:PORT (e.g. kvroute-peers.default.svc:5600), got {value!r}")
        return cls(host, int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"
