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

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from kvroute.router.routing.peer_exchange import zmq_frames, zmq_publisher
from kvroute.router.routing.unix_links import UnixSubscriber, unix_path

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RelayStats:
    """Messages relayed, and links closed for sending something other than frames."""

    relayed: int = 0
    refused: int = 0


class PeerRelay:
    """Binds ``bind`` and relays every message of the workers' Unix publishers ``sources``."""

    def __init__(self, bind: str, sources: Sequence[str]) -> None:
        paths = [unix_path(source) for source in sources]
        if unix_path(bind) is not None or None in paths:
            raise ValueError("the relay binds a ZMQ endpoint and reads unix:// publishers")
        self._bind = bind
        self._paths = [path for path in paths if path is not None]
        self._pub: zmq.Socket[bytes] | None = None
        self._sub: UnixSubscriber | None = None
        self.stats = RelayStats()

    @property
    def endpoint(self) -> str | None:
        """Where the PUB socket listens (with the port the OS chose for ``tcp://host:*``)."""
        return None if self._pub is None else self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self) -> None:
        """Bind, and connect to every worker's publisher (needs the running loop)."""
        self._pub = zmq_publisher(self._bind)
        self._sub = UnixSubscriber(self._relay, self._count_refused)
        self._sub.connect(self._paths)

    def stop(self) -> None:
        if self._sub is not None:
            self._sub.close()
        if self._pub is not None:
            self._pub.close(linger=0)
        self._sub = self._pub = None

    def _relay(self, head: bytes, body: bytes) -> None:
        if self._pub is None:
            return
        with contextlib.suppress(zmq.Again):  # a peer at its high-water mark: PUB drops for it
            self._pub.send_multipart(zmq_frames(head, body), flags=zmq.NOBLOCK)
        self.stats.relayed += 1

    def _count_refused(self) -> None:
        self.stats.refused += 1
        log.warning("peer relay: a worker's publisher sent something other than frames")
