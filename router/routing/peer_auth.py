"""CurveZMQ for the peer exchange: only routers holding the fleet's secret hear each other.

Placements carry block hashes, backend URLs and session keys, and what a router hears
steers its routing: a stranger subscribed to a router's ``--peer-bind`` reads its traffic's
shape, and one a router subscribes to can herd its conversations onto one backend. With
``--peer-secret-file`` (:class:`~kvroute.router.peer_key.PeerKey`) every ZMQ socket of the
exchange runs CURVE, encrypted both ways:

* a publisher is a CURVE server with the fleet's key pair, and a ZAP handler
  (:class:`Gatekeeper`, pyzmq's authenticator thread) admits only subscribers that prove
  they hold the same pair;
* a subscriber is a CURVE client that accepts only a publisher holding it.

A router without the secret, or with another, completes no handshake either way: it
neither hears nor is heard (``kvroute_peer_handshakes_total`` and a warning say so). Unix
links (the workers of one router, in a 0700 directory) do not use it.

Rotating the secret (``--peer-accepted-secret-file``, a second secret): a router given
one admits subscribers proving either pair, and its subscriber tries the other pair on a
publisher that refuses its first (:class:`~kvroute.router.routing.zmq_handshakes.Handshakes`).
Three rollouts then change the fleet's secret with every router hearing every other
throughout: add the new secret as the accepted one; swap the two; drop the old one
(``deploy/README.md``, "Rotating the peer secret").
"""

from __future__ import annotations

import logging
import time

import zmq
from zmq.auth.thread import ThreadAuthenticator

from kvroute.router.peer_key import PeerKey

log = logging.getLogger(__name__)

#: The ZAP domain the exchange's publishers ask their handler about.
ZAP_DOMAIN = "kvroute-peers"
#: Seconds between two warnings of refused subscribers (a stranger may retry without end).
WARN_EVERY_S = 60.0


def secure_subscriber(socket: zmq.Socket, key: PeerKey) -> None:
    """Make ``socket`` (before it connects) a CURVE client of publishers holding ``key``."""
    socket.curve_serverkey = key.public
    socket.curve_publickey = key.public
    socket.curve_secretkey = key.secret


class Gatekeeper:
    """A context whose publishers are CURVE servers with ``key``, admitting only holders of
    it or of ``accepted`` (the other secret while one is rotated).

    ZAP handlers are per context, one each: every secured publisher gets a context of its
    own (one more ZMQ I/O thread and the authenticator's thread, idle but at handshakes).
    """

    def __init__(self, key: PeerKey, accepted: PeerKey | None = None) -> None:
        self._key = key
        self._admitted = {key.public} | ({accepted.public} if accepted is not None else set())
        self.context = zmq.Context()
        self._authenticator = ThreadAuthenticator(self.context, log=log)
        self._authenticator.start()
        self._authenticator.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self)
        #: Subscribers refused (they proved another key).
        self.refused = 0
        self._warned_at = float("-inf")

    def publisher(self) -> zmq.Socket[bytes]:
        """A PUB socket of this context, set up as a CURVE server (bind it next)."""
        socket: zmq.Socket[bytes] = self.context.socket(zmq.PUB)
        socket.curve_server = True
        socket.curve_publickey = self._key.public
        socket.curve_secretkey = self._key.secret
        socket.zap_domain = ZAP_DOMAIN.encode()
        return socket

    def callback(self, domain: str, client_key: bytes) -> bool:
        """The ZAP decision (the authenticator's thread): the client's public key is the fleet's."""
        if domain == ZAP_DOMAIN and client_key in self._admitted:
            return True
        self.refused += 1
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning(
                "peer exchange: refused a subscriber holding another key (%d so far; is its --peer-secret-file ours?)",
                self.refused,
            )
        return False

    def close(self) -> None:
        """Stop the handler and the context (close its sockets first)."""
        self._authenticator.stop()
        self.context.destroy(linger=0)
