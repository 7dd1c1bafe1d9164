"""Request bodies the router rewrites: the rank named in the body."""

from __future__ import annotations

import orjson
import pytest

from kvroute.router.routing.request_info import body_with_rank


@pytest.mark.parametrize(
    "raw",
    [
        b"{}",
        b'{"text": "hi"}',
        b'{"text":"a }","sampling_params":{"max_new_tokens":2,"stop":["}"]}}\n',
        b' {\n  "input_ids": [1, 2, 3]\n}  \r\n',
    ],
)
def test_the_rank_is_added_as_the_last_member(raw: bytes) -> None:
    body = orjson.loads(raw)
    written = body_with_rank(raw, body, "routed_dp_rank", 3)
    assert orjson.loads(written) == {**body, "routed_dp_rank": 3}
    assert written.endswith(b'"routed_dp_rank":3}')


def test_a_clients_own_rank_is_replaced_not_duplicated() -> None:
    raw = b'{"routed_dp_rank": 7, "text": "hi"}'
    written = body_with_rank(raw, orjson.loads(raw), "routed_dp_rank", 1)
    assert written.count(b"routed_dp_rank") == 1 and orjson.loads(written) == {"routed_dp_rank": 1, "text": "hi"}
