"""What an HTTP server alone costs per request on this machine: the floor under a proxy.

    python3 -m kvroute.benchmarks.server_floor [--rounds 5] [--seconds 3] [--out FILE]

Each server answers every ``POST /v1/chat/completions`` with the same small JSON body,
doing nothing else, and gets the overhead benchmark's ~2 KB chat bodies from 32
closed-loop clients, round by round, in turn; its CPU per request comes from ``/proc``
as the overhead benchmark reads a router's. The servers:

* ``aiohttp-app``: an aiohttp application as kvroute serves one (URL dispatcher, a
  middleware, the handler reads the body and returns a ``web.Response``);
* ``aiohttp-direct``: the same application, the handler called without the dispatcher
  and middleware chain, as kvroute's proxied routes are (``router/http/app.py``);
* ``uvicorn``: uvicorn (httptools, uvloop) running a bare ASGI callable (measured where
  uvicorn is installed: ``pip install uvicorn``; kvroute does not depend on it);
* ``httptools``: an ``asyncio.Protocol`` on uvloop feeding llhttp (``httptools``) and
  writing one fixed response per request: the least any Python server on uvloop does.
  A sizing fixture only, not a server: no keep-alive rules, limits or errors.

A proxy pays a server's floor once for its clients; what lies above the floor is what a
leaner server could save (benchmarks/README.md, "The HTTP side").
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from email.utils import formatdate
from pathlib import Path
from typing import Any

from kvroute.benchmarks.fleet import free_port
from kvroute.benchmarks.overhead import chat_bodies, closed_loop

SERVERS = ("aiohttp-app", "aiohttp-direct", "uvicorn", "httptools")
#: The module each server needs beyond kvroute's own dependencies.
_OPTIONAL_MODULE = {"uvicorn": "uvicorn"}
PATH = "/v1/chat/completions"
ANSWER = (
    b'{"id":"floor","object":"chat.completion","model":"overhead","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":500,"completion_tokens":1,"total_tokens":501}}'
)


def _serve_aiohttp(port: int, direct: bool) -> None:
    import uvloop
    from aiohttp import web

    async def answer(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.Response(body=ANSWER, content_type="application/json")

    @web.middleware
    async def passing(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Any:
        return await handler(request)

    app = web.Application(middlewares=[passing])
    app.router.add_post(PATH, answer)

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        if direct:
            server = runner.server
            assert server is not None
            dispatch = server.request_handler

            async def handle(request: web.BaseRequest) -> web.StreamResponse:
                if request.method == "POST" and request.rel_url.path_safe == PATH:
                    return await answer(request)  # type: ignore[arg-type]
                return await dispatch(request)

            server.request_handler = handle
        await web.TCPSite(runner, "127.0.0.1", port, backlog=2048).start()
        await asyncio.Event().wait()

    uvloop.run(main())


def _serve_uvicorn(port: int) -> None:
    import uvicorn

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": ANSWER})

    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="warning", lifespan="off")


def _serve_httptools(port: int) -> None:
    import httptools
    import uvloop

    class Answering(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport: Any = transport
            self.parser = httptools.HttpRequestParser(self)

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_message_complete(self) -> None:
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nDate: %s\r\nContent-Length: %d\r\n\r\n"
            self.transport.write(head % (formatdate(usegmt=True).encode(), len(ANSWER)) + ANSWER)

    async def main() -> None:
        await asyncio.get_running_loop().create_server(Answering, "127.0.0.1", port, backlog=2048)
        await asyncio.Event().wait()

    uvloop.run(main())


def installed(kind: str) -> bool:
    """Whether ``kind`` can run here (uvicorn is not one of kvroute's dependencies)."""
    module = _OPTIONAL_MODULE.get(kind)
    return module is None or importlib.util.find_spec(module) is not None


def serve(kind: str, port: int) -> None:
    if kind.startswith("aiohttp"):
        _serve_aiohttp(port, direct=kind == "aiohttp-direct")
    elif kind == "uvicorn":
        _serve_uvicorn(port)
    else:
        _serve_httptools(port)


@dataclass(slots=True)
class FloorRow:
    server: str
    cpu_us_per_request: float
    cpu_range: tuple[float, float]
    requests_per_s: float
    errors: int
    cpu_us_per_request_rounds: list[float]


async def _wait_listening(port: int, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)
        else:
            writer.close()
            return


async def measure(kinds: list[str], rounds: int, seconds: float) -> list[FloorRow]:
    bodies = chat_bodies()
    servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    try:
        for kind in kinds:
            port = free_port()
            argv = [sys.executable, "-m", "kvroute.benchmarks.server_floor", "--serve", kind, str(port)]
            # Its own process group: the CPU read from /proc is the server's alone.
            servers[kind] = (subprocess.Popen(argv, start_new_session=True), f"http://127.0.0.1:{port}")
            await _wait_listening(port)
        for _, url in servers.values():
            await closed_loop(url, bodies, 32, 0.0, None, requests=len(bodies))
        runs: dict[str, list[tuple[float, float, int]]] = {kind: [] for kind in kinds}
        for _ in range(rounds):
            for kind, (process, url) in servers.items():
                run = await closed_loop(url, bodies, 32, seconds, process.pid)
                cpu_us = run.cpu_us_per_request
                assert cpu_us is not None, f"{kind}: no CPU reading or no requests answered"
                runs[kind].append((cpu_us, run.requests / run.seconds, run.errors))
        rows = []
        for kind, measured in runs.items():
            cpus = [cpu for cpu, _, _ in measured]
            rows.append(
                FloorRow(
                    server=kind,
                    cpu_us_per_request=statistics.median(cpus),
                    cpu_range=(min(cpus), max(cpus)),
                    requests_per_s=statistics.median(rate for _, rate, _ in measured),
                    errors=sum(errors for _, _, errors in measured),
                    cpu_us_per_request_rounds=cpus,
                )
            )
        return rows
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m kvroute.benchmarks.server_floor", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--servers", help=f"comma-separated, of {', '.join(SERVERS)} (default: those installed)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--serve", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return 0
    if args.servers is None:
        kinds = [kind for kind in SERVERS if installed(kind)]
        for kind in SERVERS:
            if kind not in kinds:
                print(f"{kind:<15} not installed (pip install {_OPTIONAL_MODULE[kind]}): not measured")
    else:
        kinds = [kind.strip() for kind in args.servers.split(",") if kind.strip()]
        unknown = sorted(set(kinds) - set(SERVERS))
        if unknown:
            parser.error(f"unknown servers {unknown}; choose from {', '.join(SERVERS)}")
        missing = [kind for kind in kinds if not installed(kind)]
        if missing:
            parser.error(f"not installed: {missing} (pip install {' '.join(_OPTIONAL_MODULE[k] for k in missing)})")
    rows = asyncio.run(measure(kinds, args.rounds, args.seconds))
    for row in rows:
        low, high = row.cpu_range
        print(
            f"{row.server:<15} {row.cpu_us_per_request:6.0f} us/request ({low:.0f}-{high:.0f}),"
            f" {row.requests_per_s:6.0f} req/s, errors {row.errors}"
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps([asdict(row) for row in rows], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
