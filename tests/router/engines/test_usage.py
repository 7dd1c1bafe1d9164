"""Reading usage from responses, and removing the injected usage chunk from streams."""

from __future__ import annotations

import itertools

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.router.engines.usage import StreamTap, Usage, usage_from_body, usage_from_object


def sse(payload: object) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


CONTENT_EVENTS = [
    sse({"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}),
    sse(
        {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": 'say "usage"'}}]}
    ),
    sse(
        {
            "id": "c1",
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
        }
    ),
]
USAGE_EVENT = sse(
    {
        "id": "c1",
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": {"prompt_tokens": 40, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 32}},
    }
)
DONE = b"data: [DONE]\n\n"
WITH_USAGE = b"".join(CONTENT_EVENTS) + USAGE_EVENT + DONE
WITHOUT_USAGE = b"".join(CONTENT_EVENTS) + DONE


def run_tap(tap: StreamTap, chunks: list[bytes]) -> bytes:
    out = b"".join(tap.feed(chunk) for chunk in chunks)
    return out + tap.finish()


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(max(cut, 0), len(data)) for cut in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(WITH_USAGE)), max_size=12))
def test_strip_mode_removes_only_the_usage_chunk_however_the_stream_is_cut(cuts: list[int]) -> None:
    tap = StreamTap(strip_usage_chunk=True)
    assert run_tap(tap, split_at(WITH_USAGE, cuts)) == WITHOUT_USAGE
    assert tap.usage == Usage(prompt_tokens=40, cached_tokens=32)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(WITH_USAGE)), max_size=12))
def test_pass_through_mode_forwards_every_byte_and_reads_the_usage(cuts: list[int]) -> None:
    tap = StreamTap(strip_usage_chunk=False)
    chunks = split_at(WITH_USAGE, cuts)
    assert [tap.feed(chunk) for chunk in chunks] == chunks
    assert tap.finish() == b""
    assert tap.usage == Usage(prompt_tokens=40, cached_tokens=32)


def test_strip_mode_forwards_complete_events_as_they_arrive() -> None:
    tap = StreamTap(strip_usage_chunk=True)
    first, second = CONTENT_EVENTS[0], CONTENT_EVENTS[1]
    assert tap.feed(first) == first  # nothing held back when chunks are whole events
    assert tap.feed(second[:10]) == b""
    assert tap.feed(second[10:]) == second


def test_pass_through_finds_usage_in_a_long_stream() -> None:
    tap = StreamTap(strip_usage_chunk=False)
    for _ in range(5000):
        tap.feed(CONTENT_EVENTS[1])
    tap.feed(USAGE_EVENT)
    tap.feed(DONE)
    tap.finish()
    assert tap.usage == Usage(prompt_tokens=40, cached_tokens=32)


def test_crlf_separated_events_are_handled() -> None:
    crlf = WITH_USAGE.replace(b"\n\n", b"\r\n\r\n")
    tap = StreamTap(strip_usage_chunk=True)
    assert run_tap(tap, [crlf[:50], crlf[50:]]) == WITHOUT_USAGE.replace(b"\n\n", b"\r\n\r\n")
    assert tap.usage is not None and tap.usage.cached_tokens == 32


def test_stream_without_usage_reports_none() -> None:
    tap = StreamTap(strip_usage_chunk=False)
    run_tap(tap, [WITHOUT_USAGE])
    assert tap.usage is None


def test_usage_from_bodies() -> None:
    chat = orjson.dumps({"choices": [], "usage": {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 0}}})
    assert usage_from_body(chat) == Usage(prompt_tokens=7, cached_tokens=0)
    no_details = orjson.dumps({"usage": {"prompt_tokens": 7, "prompt_tokens_details": None}})
    assert usage_from_body(no_details) == Usage(prompt_tokens=7, cached_tokens=None)
    responses_api = orjson.dumps({"usage": {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 4}}})
    assert usage_from_body(responses_api) == Usage(prompt_tokens=9, cached_tokens=4)
    assert usage_from_body(b'not json but has "usage"') is None
    assert usage_from_body(b'{"usage": {"prompt_tokens": "7"}}') == Usage(prompt_tokens=None, cached_tokens=None)
    assert usage_from_body(b"{}") is None


def test_a_responses_answer_says_its_id_beside_its_usage() -> None:
    """The id a later request may continue (previous_response_id): from the body, or from
    the stream's response.completed event; a chat completion's id is not one."""
    usage = {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 0}}
    body = {"id": "resp_1", "object": "response", "usage": usage}
    assert usage_from_object(body) == Usage(9, 0, response_id="resp_1")
    event = {"type": "response.completed", "response": body}
    assert usage_from_object(event) == Usage(9, 0, response_id="resp_1")
    chat = {"id": "chatcmpl-1", "object": "chat.completion", "usage": {"prompt_tokens": 9}}
    assert usage_from_object(chat) == Usage(9, None)


def test_a_responses_answer_without_usage_still_says_its_id() -> None:
    """A background answer (queued, ``usage: null``) and a stream's response.created event
    name the stored response before any usage exists; a chunk without usage says nothing."""
    queued = {"id": "resp_2", "object": "response", "status": "queued", "usage": None}
    assert usage_from_body(orjson.dumps(queued)) == Usage(None, None, response_id="resp_2")
    created = {"type": "response.created", "sequence_number": 0, "response": queued}
    assert usage_from_object(created) == Usage(None, None, response_id="resp_2")
    tap = StreamTap(strip_usage_chunk=False)
    tap.feed(b"event: response.created\ndata: " + orjson.dumps(created) + b"\n\n")
    tap.finish()  # the stream broke off here: the id was still read
    assert tap.usage == Usage(None, None, response_id="resp_2")
    assert usage_from_object({"object": "chat.completion.chunk", "usage": None}) is None
    assert usage_from_object({"type": "response.output_text.delta", "delta": "usage"}) is None
