"""The supervisor's relay: two workers' Unix publishers, one ZMQ endpoint; a router
subscribed to it hears both workers' placements, load reports and stored responses as
from two routers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from kvroute.router.peer_key import PeerKey
from kvroute.router.routing.peer_exchange import PeerExchange, Placement
from kvroute.router.routing.peer_load import BackendLoad
from kvroute.router.routing.peer_relay import PeerRelay
from tests.servers import until


@pytest.mark.parametrize(
    "key", [None, PeerKey.from_text("fleet-secret-0123456789abcdefghijklmnop")], ids=["plain", "curve"]
)
def test_a_peer_hears_every_worker_through_the_relay(tmp_path: Path, key: PeerKey | None) -> None:
    """With ``--peer-secret-file`` the relay publishes as a CURVE server, as one router does."""

    async def scenario() -> None:
        sources = [f"unix://{tmp_path / f'worker-{index}.placements'}" for index in (0, 1)]
        loads = [{"http://a": BackendLoad(1, 100)}, {"http://a": BackendLoad(2, 300)}]
        workers = [
            PeerExchange(
                bind=source,
                peers=[],
                apply=lambda _: None,
                max_bytes_per_s=1e9,
                own_load=load.copy,
                apply_stored=lambda response_id, url: None,
            )
            for source, load in zip(sources, loads)
        ]
        for worker in workers:
            await worker.start()
        relay = PeerRelay("tcp://127.0.0.1:*", sources, key)
        relay.start()
        endpoint = relay.endpoint
        assert endpoint is not None and endpoint.startswith("tcp://127.0.0.1:")
        received: list[Placement] = []
        heard: dict[str, BackendLoad] = {}
        stored: dict[str, str] = {}
        peer = PeerExchange(
            bind=None,
            peers=[endpoint],
            apply=received.append,
            max_bytes_per_s=1e9,
            apply_load=heard.__setitem__,
            apply_stored=stored.__setitem__,
            key=key,
        )
        try:
            assert await peer.start(wait_for=[endpoint])
            await asyncio.sleep(0.3)  # the relay's Unix links greeted, the ZMQ subscription landed
            for number, worker in enumerate(workers):
                worker.publish(Placement("http://a", 16, np.array([number], dtype=np.uint64), 16 * (number + 1)))
                worker.load_changed()
                worker.stored(f"resp_{number}", "http://a")
            await until(lambda: len(received) == 2 and heard.get("http://a") == BackendLoad(3, 400))
            await until(lambda: stored == {"resp_0": "http://a", "resp_1": "http://a"})
            assert sorted(placement.prompt_tokens for placement in received) == [16, 32]
            assert peer.load_stats.received == 2 and peer.stats.malformed == 0
            assert relay.stats.relayed == 6 and relay.stats.refused == 0
        finally:
            relay.stop()
            for exchange in (peer, *workers):
                await exchange.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("bind", "sources"),
    [("unix:///tmp/relay.sock", ["unix:///tmp/w0"]), ("tcp://127.0.0.1:*", ["tcp://127.0.0.1:5601"])],
    ids=["unix-bind", "zmq-source"],
)
def test_the_relay_binds_zmq_and_reads_unix(bind: str, sources: list[str]) -> None:
    with pytest.raises(ValueError, match="unix://"):
        PeerRelay(bind, sources)
