"""One ``--peer-bind`` for a router of several workers: the supervisor relays their messages.

The workers of ``kvroute serve --workers N`` publish to each other over Unix stream sockets
(:mod:`kvroute.router.routing.unix_links`), each on its own private path, so other router
replicas could not subscribe to them. The supervisor binds the router's ``--peer-bind``
(ZMQ PUB) and reads every worker's Unix publisher as a subscriber would, sending each
message on as it came, framed as a single router frames it
(:func:`~kvroute.router.routing.peer_exchange.zmq_frames`), so its peers cannot tell
the difference (each worker's reports carry its own sender id and are summed apart). The
other direction needs no relay: every worker subscribes to the external peers itself.

Like the exchange, the relay drops what a slow peer cannot take (the PUB socket's
high-water mark) rather than queue it; it reconnects to a worker that restarts.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.router.peer_key import PeerKey
from kvroute.router.routing.peer_exchange import ZmqPublisher, zmq_frames
from kvroute.router.routing.unix_links import UnixSubscriber, unix_path

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RelayStats:
    """Messages relayed, and links closed for sending something other than frames."""

    relayed: int = 0
    refused: int = 0


class PeerRelay:
    """Binds ``bind`` and relays every message of the workers' Unix publishers ``sources``."""

    def __init__(
        self, bind: str, sources: Sequence[str], key: PeerKey | None = None, accepted_key: PeerKey | None = None
    ) -> None:
        paths = [unix_path(source) for source in sources]
        if unix_path(bind) is not None or None in paths:
            raise ValueError("the relay binds a ZMQ endpoint and reads unix:// publishers")
        self._bind = bind
        self._key = key
        self._accepted_key = accepted_key
        self._paths = [path for path in paths if path is not None]
        self._pub: ZmqPublisher | None = None
        self._sub: UnixSubscriber | None = None
        self.stats = RelayStats()

    @property
    def endpoint(self) -> str | None:
        """Where the PUB socket listens (with the port the OS chose for ``tcp://host:*``)."""
        return None if self._pub is None else self._pub.endpoint

    def start(self) -> None:
        """Bind, and connect to every worker's publisher (needs the running loop)."""
        self._pub = ZmqPublisher(self._bind, self._key, self._accepted_key)
        self._sub = UnixSubscriber(self._relay, self._count_refused)
        self._sub.connect(self._paths)

    def stop(self) -> None:
        if self._sub is not None:
            self._sub.close()
        if self._pub is not None:
            self._pub.close()
        self._sub = self._pub = None

    def _relay(self, head: bytes, body: bytes) -> None:
        if self._pub is None:
            return
        self._pub.send(zmq_frames(head, body))
        self.stats.relayed += 1

    def _count_refused(self) -> None:
        self.stats.refused += 1
        log.warning("peer relay: a worker's publisher sent something other than frames")
