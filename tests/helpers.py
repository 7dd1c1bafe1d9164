"""Assertions shared by several test modules (fixtures live in ``conftest.py``).

Test modules import these as ``from helpers import ...`` (``tests/`` is on ``sys.path``
under pytest's default import mode), never from one another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from tests.servers import RouterServer

GREETING = [{"role": "user", "content": "hi"}]


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    """Check that ``response`` is the router's OpenAI-style error with ``status`` (and ``code``); return it."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert body["type"] == "error"  # Anthropic's envelope, for /v1/messages clients
    error = body["error"]
    assert set(error) == {"message", "type", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]
    if code is not None:
        assert error["code"] == code
    return error


def still_serves(router: RouterServer) -> None:
    """A small chat completion through ``router`` succeeds (it survived what came before)."""
    answer = router.client().chat.completions.create(model="sim", messages=GREETING, max_tokens=2)
    assert answer.choices
