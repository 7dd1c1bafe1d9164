"""The key pair routers of one fleet share for the peer exchange, from one secret file.

Read where the settings are checked (``--peer-secret-file``), so a missing, unreadable or
too short secret fails at start; used by :mod:`kvroute.router.routing.peer_auth`.

Any text of at least :data:`MIN_SECRET_CHARS` characters will do (``head -c 32
/dev/urandom | base64``, a Kubernetes Secret): its SHA-256 is the Curve25519 secret key
(every 32 bytes are one), so operators never handle Z85 key files, and every router given
the same text derives the same pair.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

#: The shortest secret accepted: 32 characters of base64 carry 192 bits.
MIN_SECRET_CHARS = 32
# Keys derived for the exchange differ from any other use of the same text.
_DOMAIN = b"kvroute peer exchange v1\0"


@dataclass(frozen=True, slots=True)
class PeerKey:
    """A Curve25519 key pair, Z85-encoded as ZMQ's CURVE options take it."""

    public: bytes
    secret: bytes

    @classmethod
    def from_text(cls, text: str) -> PeerKey:
        secret_text = text.strip()
        if len(secret_text) < MIN_SECRET_CHARS:
            raise ValueError(f"the peer secret must hold at least {MIN_SECRET_CHARS} characters")
        secret = z85.encode(hashlib.sha256(_DOMAIN + secret_text.encode()).digest())
        return cls(public=zmq.curve_public(secret), secret=secret)

    @classmethod
    def read(cls, path: Path) -> PeerKey:
        """The pair derived from the text in ``path``; ``ValueError`` naming the file if it cannot be."""
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the peer secret file {path}: {exc}") from exc
        try:
            return cls.from_text(text)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def __repr__(self) -> str:  # never the secret, in logs or tracebacks
        return f"PeerKey(public={self.public.decode()!r})"
