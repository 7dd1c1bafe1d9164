"""Many long conversations at once: what a turn costs when the conversation memo holds them, and when it cannot.

    python3 -m kvroute.benchmarks.profile_sessions [--sessions 200,400,600] [--messages 200]
        [--memo-mb 128] [--rounds 3] [--ending 0.0] [--json FILE]

A router fronting coding agents sees hundreds of conversations of hundreds of messages,
their turns interleaved. The tokenizer remembers each long conversation's last turn
(rendered text and ids: ``render_memo``, ``prompt_memo``) so the next renders and
tokenizes only its new messages; within ``--memo-mb`` (``kvroute serve
--conversation-memo-mb``) that holds, beyond it every turn is rendered and tokenized whole.
Here ``--sessions`` agent conversations (the overhead bench's shape: a tool call and its
result per turn) of ``--messages`` messages each are sent once, then grow by one turn
``--rounds`` times, each round every conversation in turn, as ``encode_chat_array`` (render
and tokenize) per request. With ``--ending F``, after each round that share of the
conversations ends and as many new ones start (their first request, of ``--messages``
messages, in the next round). Reports thread CPU per request of each round and how many
requests the two memos continued from a remembered turn.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvroute.benchmarks.overhead import agent_messages
from kvroute.benchmarks.profile_render import SYSTEM
from kvroute.tokenizer_index import RequestTokenizer

#: Turns each conversation sends after its first, every conversation in turn (default).
ROUNDS = 3


@dataclass(slots=True)
class SessionsRun:
    sessions: int
    messages: int
    memo_mb: int
    ending: float
    #: Thread CPU microseconds per request, per round.
    us_per_request: list[float]
    #: Requests the render memo / the prompt memo continued from a remembered turn, of all.
    render_reused: int
    ids_reused: int
    requests: int


def run_sessions(
    sessions: int, messages: int = 200, memo_mb: int = 128, *, rounds: int = ROUNDS, ending: float = 0.0
) -> SessionsRun:
    """``sessions`` conversations of ``messages`` messages, then ``rounds`` interleaved
    turns; after each, ``ending`` of them replaced by new conversations."""
    half = memo_mb * 2**19
    tokenizer = RequestTokenizer.default(memo_bytes=half, render_memo_bytes=half)
    longest = messages + 2 * rounds
    chats = {number: agent_messages(number, longest, SYSTEM) for number in range(sessions)}
    active = [(number, messages) for number in range(sessions)]  # (conversation, messages it sends)
    for number, sent in active:
        tokenizer.encode_chat_array(chats[number][:sent])
    rendered, tokenized = tokenizer.render_memo_stats().reused, tokenizer.memo_stats().reused
    ended = round(ending * sessions)
    spent = []
    for turn in range(1, rounds + 1):
        active = [(number, min(sent + 2, longest)) for number, sent in active]
        started = time.thread_time_ns()
        for number, sent in active:
            tokenizer.encode_chat_array(chats[number][:sent])
        spent.append((time.thread_time_ns() - started) / sessions / 1000)
        for index in range(turn * ended, (turn + 1) * ended):  # (in turn, a different share each round)
            number = len(chats)
            chats[number] = agent_messages(number, longest, SYSTEM)
            active[index % sessions] = (number, messages - 2)
    return SessionsRun(
        sessions,
        messages,
        memo_mb,
        ending,
        spent,
        tokenizer.render_memo_stats().reused - rendered,
        tokenizer.memo_stats().reused - tokenized,
        sessions * rounds,
    )


def format_runs(runs: Sequence[SessionsRun]) -> str:
    lines = [
        f"{'sessions':>8} {'messages':>8} {'memo MB':>7} {'ending':>6}  {'us per request by round':<26} {'memo reused':>16}"
    ]
    for run in runs:
        rounds = " ".join(f"{spent:7.0f}" for spent in run.us_per_request)
        reused = f"{run.render_reused}/{run.ids_reused} of {run.requests}"
        lines.append(
            f"{run.sessions:>8} {run.messages:>8} {run.memo_mb:>7} {run.ending:>6.2f}  {rounds:<26} {reused:>16}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m kvroute.benchmarks.profile_sessions", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--sessions", default="200,400,600", help="conversation counts, comma-separated")
    parser.add_argument("--messages", type=int, default=200, help="messages per conversation at its first turn")
    parser.add_argument("--memo-mb", type=int, default=128, help="as kvroute serve --conversation-memo-mb")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="turns each conversation sends after its first")
    parser.add_argument("--ending", type=float, default=0.0, help="share of conversations replaced after each round")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    runs = []
    for sessions in (int(count) for count in args.sessions.split(",")):
        runs.append(run_sessions(sessions, args.messages, args.memo_mb, rounds=args.rounds, ending=args.ending))
        print(format_runs(runs[-1:]).splitlines()[-1] if len(runs) > 1 else format_runs(runs), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(run) for run in runs], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
