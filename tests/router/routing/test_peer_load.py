"""Peer routers' load reports: their wire format and the table that sums them."""

from __future__ import annotations

import pytest

from kvroute.router.routing import peer_load
from kvroute.router.routing.peer_load import (
    NO_LOAD,
    BackendLoad,
    LoadReport,
    PeerLoad,
    decode_report,
    encode_report,
)


def test_a_report_survives_the_wire() -> None:
    report = LoadReport("a1b2", {"http://10.0.0.7:8000/serving": BackendLoad(3, 4500), "http://b": BackendLoad(0, 7)})
    assert decode_report(encode_report(report)) == report
    assert decode_report(encode_report(LoadReport("idle", {}))) == LoadReport("idle", {})
    computing = LoadReport("c3", {"http://b": BackendLoad(2, 90, ((0, 2**64 - 1), (12, 77)))})
    assert decode_report(encode_report(computing)) == computing


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json",
        b"[]",
        b'{"sender": "a"}',  # no load
        b'{"sender": "a", "load": {}, "more": 1}',
        b'{"sender": "", "load": {}}',
        b'{"sender": 7, "load": {}}',
        b'{"sender": "a", "load": []}',
        b'{"sender": "a", "load": {"http://b": [1]}}',
        b'{"sender": "a", "load": {"http://b": [1, 2, 3]}}',
        b'{"sender": "a", "load": {"http://b": [-1, 2]}}',
        b'{"sender": "a", "load": {"http://b": [1.5, 2]}}',
        b'{"sender": "a", "load": {"http://b": [true, 2]}}',
        b'{"sender": "a", "load": {"http://b": [1, 9007199254740993]}}',
        b'{"sender": "a", "load": {"": [1, 2]}}',
        b'{"sender": "a", "load": {"http://b": {"in_flight": 1}}}',
        b'{"sender": "a", "load": {"http://b": [1, 2]}, "computing": []}',
        b'{"sender": "a", "load": {"http://b": [1, 2]}, "computing": {"http://c": [[0, 1]]}}',  # not in load
        b'{"sender": "a", "load": {"http://b": [1, 2]}, "computing": {"http://b": [0, 1]}}',
        b'{"sender": "a", "load": {"http://b": [1, 2]}, "computing": {"http://b": [[0]]}}',
        b'{"sender": "a", "load": {"http://b": [1, 2]}, "computing": {"http://b": [[-1, 1]]}}',
        b'{"sender": "a", "load": {"http://b": [1, 2]}, "computing": {"http://b": [[0, -1]]}}',
        b'{"sender": "a", "load": {"http://b": [1, 2]}, "computing": {"http://b": [[0, 18446744073709551616]]}}',
        b'{"sender": "a", "load": {"http://b": [1, 2]}, "computing": {"http://b": [[0, 1.0]]}}',
    ],
)
def test_malformed_reports_are_refused(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode_report(data)


def test_an_oversized_report_is_refused_before_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peer_load, "MAX_REPORT_BYTES", 64)
    report = LoadReport("a", {f"http://backend-{number}": BackendLoad(1, 1) for number in range(10)})
    with pytest.raises(ValueError, match="too large"):
        decode_report(encode_report(report))


def test_a_report_replaces_its_senders_last_and_sums_with_the_others() -> None:
    table = PeerLoad("me")
    assert table.apply(LoadReport("a", {"http://x": BackendLoad(2, 200), "http://y": BackendLoad(1, 50)})) == {
        "http://x",
        "http://y",
    }
    assert table.apply(LoadReport("b", {"http://x": BackendLoad(1, 30)})) == {"http://x"}
    assert table.total("http://x") == BackendLoad(3, 230) and table.total("http://y") == BackendLoad(1, 50)
    # a's next report: x unchanged, y finished (left out), z new. Only y and z changed.
    assert table.apply(LoadReport("a", {"http://x": BackendLoad(2, 200), "http://z": BackendLoad(4, 9)})) == {
        "http://y",
        "http://z",
    }
    assert table.total("http://x") == BackendLoad(3, 230)
    assert table.total("http://y") == NO_LOAD and table.total("http://z") == BackendLoad(4, 9)
    assert table.peers == 2 and table.backends() == {"http://x", "http://z"}


def test_the_blocks_peers_compute_are_every_reports_together() -> None:
    table = PeerLoad("me")
    table.apply(LoadReport("a", {"http://x": BackendLoad(1, 10, ((0, 5),))}))
    assert table.apply(LoadReport("b", {"http://x": BackendLoad(1, 10, ((3, 9),))})) == {"http://x"}
    assert table.total("http://x") == BackendLoad(2, 20, ((0, 5), (3, 9)))
    # a's request finished and another started: same counts, other blocks, a change.
    assert table.apply(LoadReport("a", {"http://x": BackendLoad(1, 10, ((2, 6),))})) == {"http://x"}
    assert table.total("http://x") == BackendLoad(2, 20, ((2, 6), (3, 9)))
    table.apply(LoadReport("b", {}))
    assert table.total("http://x") == BackendLoad(1, 10, ((2, 6),))


def test_its_own_report_coming_back_is_not_a_peers() -> None:
    table = PeerLoad("me")
    assert table.apply(LoadReport("me", {"http://x": BackendLoad(5, 5)})) == set()
    assert table.total("http://x") == NO_LOAD and table.peers == 0


def test_a_silent_peer_is_forgotten_after_the_ttl() -> None:
    now = [0.0]
    table = PeerLoad("me", clock=lambda: now[0])
    table.apply(LoadReport("quiet", {"http://x": BackendLoad(2, 100)}))
    now[0] = 1.0
    table.apply(LoadReport("talking", {"http://x": BackendLoad(1, 10)}))
    now[0] = peer_load.REPORT_TTL_S - 0.1
    assert table.expire() == (set(), 0)
    now[0] = peer_load.REPORT_TTL_S + 0.1
    assert table.expire() == ({"http://x"}, 1)  # "quiet" went; "talking" spoke at 1.0
    assert table.total("http://x") == BackendLoad(1, 10) and table.peers == 1
    table.apply(LoadReport("talking", {}))  # an idle report keeps the peer known, with nothing in flight
    now[0] = 1.0 + peer_load.REPORT_TTL_S + 0.2
    assert table.expire() == (set(), 0) and table.total("http://x") == NO_LOAD
    now[0] = 10.0  # an idle peer that stays quiet is dropped, not counted as gone with requests
    assert table.expire() == (set(), 0) and table.peers == 0
