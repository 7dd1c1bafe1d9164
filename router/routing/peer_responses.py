"""Stored Responses answers routers share: which backend holds which response id.

vLLM keeps a stored response (``VLLM_ENABLE_RESPONSES_API_STORE=1``) in the memory of the
replica that ran it, and only that replica answers a continuation of it
(``previous_response_id``) or a call on it (``GET /v1/responses/{id}``...). A router
remembers where the answers it relayed are stored (:mod:`~kvroute.router.routing.stored_responses`);
one that did not relay an answer searches the backends for it, one 404 per replica that
lacks it. Behind a client-side balancer, or across ``--workers``, a conversation's next turn
reaches another router about as often as the same one, so each router sends its peers the
ids it learned since its last message, and the peers remember them as their own.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson

from kvroute.router.routing.peer_load import decode_object

#: The topic of stored responses on the ZMQ exchange (routers without it do not subscribe to it).
RESPONSES_TOPIC = b"kvroute-responses"
#: The head of stored responses on a ``unix://`` link (never a valid placement head).
RESPONSES_HEAD = b"kvroute-responses/1"
#: Largest accepted message: thousands of ids.
MAX_RESPONSES_BYTES = 1 << 20
#: Longest id taken (vLLM's are ``resp_`` and 32 hex digits).
MAX_RESPONSE_ID_CHARS = 256


def encode_responses(stored: Mapping[str, str]) -> bytes:
    """``{response_id: backend URL}`` as one message."""
    return orjson.dumps(stored)


def decode_responses(data: bytes) -> dict[str, str]:
    """The inverse of :func:`encode_responses`; ``ValueError`` on anything else."""
    stored = decode_object(data, MAX_RESPONSES_BYTES, "stored responses")
    for response_id, url in stored.items():
        if not response_id or len(response_id) > MAX_RESPONSE_ID_CHARS or not isinstance(url, str) or not url:
            raise ValueError("malformed stored responses")
    return stored
