"""CPU per response of the upstream client's parser, this checkout against another one.

    python3 -m kvroute.benchmarks.bench_upstream_parse [--before /tmp/kv-before] [--rounds 7]

Feeds two typical engine answers to one kept-alive ``kvroute.router.forwarding.upstream._Connection`` over
the stand-in transport of :mod:`kvroute.benchmarks.upstream_cases`, reads them as the proxy does,
and times process CPU: a JSON completion (uvicorn's head and a Content-Length body, one
packet) and a streamed one (a chunked head, then 64 SSE events of 174 bytes, one packet
each, as tokens arrive). With ``--before PATH`` the ``router/forwarding/upstream.py`` of that checkout is timed in the
same rounds, alternating, and the medians of both are printed side by side. Process CPU is
far steadier than a load test's on a shared machine, and it is the parser's own cost.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path
from types import ModuleType

import orjson

from kvroute.benchmarks.upstream_cases import STILL_LOOP, Wire, read_now
from kvroute.router.forwarding import upstream as this_upstream

_REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: engine\r\nContent-Length: 2\r\n\r\n"
_JSON_BODY = orjson.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris."}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 512, "completion_tokens": 3, "total_tokens": 515},
    }
)
_UVICORN_HEAD = (
    b"HTTP/1.1 200 OK\r\ndate: Tue, 01 Dec 2026 23:00:00 GMT\r\nserver: uvicorn\r\n"
    b"content-length: %d\r\ncontent-type: application/json\r\n\r\n"
)
_EVENT = (
    b"data: "
    + orjson.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "delta": {"content": " token"}, "logprobs": None, "finish_reason": None}],
        }
    )
    + b"\n\n"
)

#: Each answer as the packets that carry it.
ANSWERS: dict[str, list[bytes]] = {
    "json": [_UVICORN_HEAD % len(_JSON_BODY) + _JSON_BODY],
    "stream": [
        (
            b"HTTP/1.1 200 OK\r\ndate: Tue, 01 Dec 2026 23:00:00 GMT\r\nserver: uvicorn\r\n"
            b"content-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
        ),
        *[b"%x\r\n%s\r\n" % (len(_EVENT), _EVENT)] * 64,
        b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n",
    ],
}


def load_upstream(tree: Path) -> ModuleType:
    """``router/forwarding/upstream.py`` of another checkout, as a module of its own."""
    path = tree / "router" / "forwarding" / "upstream.py"
    if not path.exists():  # checkouts before the rooms
        path = tree / "router" / "upstream.py"
    spec = importlib.util.spec_from_file_location("upstream_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def new_connection(upstream: ModuleType) -> object:
    connection = upstream._Connection(STILL_LOOP)
    connection.connection_made(Wire())
    return connection


def read_answer(connection: object, packets: list[bytes]) -> int:
    """One exchange on a kept-alive connection, as the proxy makes it: send, read the
    answer to its end, return the connection to the pool."""
    connection.send(_REQUEST, b"{}", 60.0)
    size = 0
    for packet in packets:
        connection.data_received(packet)
        while data := read_now(connection):
            size += len(data)
    assert connection.status == 200 and connection.reusable(), "the answer must end, reusable"
    connection.recycle()
    return size


def cpu_us_per_answer(upstream: ModuleType, packets: list[bytes], repeats: int) -> float:
    connection = new_connection(upstream)
    started = time.process_time()
    for _ in range(repeats):
        read_answer(connection, packets)
    return (time.process_time() - started) / repeats * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="another checkout to time side by side")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args(argv)
    modules = {"after" if args.before else "this": this_upstream}
    if args.before:
        modules = {"before": load_upstream(args.before), **modules}
    for name, packets in ANSWERS.items():
        times: dict[str, list[float]] = {label: [] for label in modules}
        for _ in range(args.rounds):
            for label, module in modules.items():
                times[label].append(cpu_us_per_answer(module, packets, args.repeats))
        cells = [
            f"{label} {statistics.median(values):.1f} us (min {min(values):.1f}, max {max(values):.1f})"
            for label, values in times.items()
        ]
        print(f"{name:6} " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
