"""Stored responses between routers: their wire format and what a message may say."""

from __future__ import annotations

import pytest

from kvroute.router.routing.peer_responses import MAX_RESPONSE_ID_CHARS, decode_responses, encode_responses


def test_stored_responses_survive_the_wire() -> None:
    stored = {"resp_0123": "http://a", "resp_ü": "http://b:8000"}
    assert decode_responses(encode_responses(stored)) == stored
    assert decode_responses(encode_responses({})) == {}


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b'["resp_1", "http://a"]',
        b'{"": "http://a"}',
        b'{"resp_1": ""}',
        b'{"resp_1": 7}',
        b'{"resp_1": ["http://a"]}',
        b'{"' + b"r" * (MAX_RESPONSE_ID_CHARS + 1) + b'": "http://a"}',
        b'{"resp_1": "' + b"x" * (1 << 20) + b'"}',
    ],
)
def test_malformed_stored_responses_are_refused(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode_responses(data)
