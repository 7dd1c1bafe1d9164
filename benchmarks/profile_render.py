"""A chat's render by shape and length: as the tokenizer renders it, and whole.

    python3 -m kvroute.benchmarks.profile_render [--tokenizer DIR] [--chat-template FILE] [--chats 300]
        [--repeats 5] [--shapes plain,agent] [--json FILE]

Two shapes of conversation, each ``--chats`` of them different from one another (their
own texts and tool-call ids, as real conversations have), at 4 to 42 messages:

* ``plain``: a system prompt, then user and assistant texts;
* ``agent``: a system prompt and a task, then per turn an assistant tool call and its
  tool result (what coding agents send).

Thread CPU per render, best of ``--repeats``, of:

* ``whole``: the model's template over every message (what vLLM does, and what the
  router did before its shortcuts);
* ``tokenizer``: ``RequestTokenizer.render_chat`` after the same conversation's previous
  turn (two messages shorter) was rendered, as a router sees a conversation grow: a
  skeleton for a short chat, the render memo from ``render_memo.MIN_MESSAGES``
  messages on, else the whole render. Both texts are checked equal.

Skeletons cover plain chats and, under templates that print tool calls verbatim, agents'
chats too (``render_skeleton``). ``--chat-template`` renders with another template (e.g.
``benchmarks/templates/qwen3_style.jinja``) over the tokenizer's; ``--shapes plain`` leaves
the agents out (Gemma 3's template refuses tool roles).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvroute.benchmarks.overhead import agent_messages
from kvroute.tokenizer_index import RequestTokenizer
from kvroute.tokenizer_index.render_memo import RenderSettings

SHAPES = ("plain", "agent")
LENGTHS = (4, 8, 12, 16, 22, 42)
SYSTEM = "You are a careful assistant working in a code repository. " * 12


@dataclass(slots=True)
class RenderTime:
    shape: str
    messages: int
    whole_us: float
    tokenizer_us: float


def conversation(shape: str, number: int, messages: int) -> list[dict[str, Any]]:
    """Conversation ``number`` of ``shape`` with ``messages`` messages (an even count >= 2)."""
    if shape == "agent":
        return agent_messages(number, messages, SYSTEM)
    chat = agent_messages(number, 2, SYSTEM)  # (the same system prompt and task)
    for turn in range((messages - 2) // 2):
        chat += [
            {"role": "assistant", "content": f"Step {turn}: I read module {number} and found line {turn * 7}."},
            {"role": "user", "content": f"Good. Now check what calls it ({number}.{turn})."},
        ]
    return chat


def _timed_us(
    render: Callable[[list[dict[str, Any]]], str], chats: Sequence[list[dict[str, Any]]]
) -> tuple[float, list[str]]:
    """Thread CPU microseconds per chat of ``render`` after the chats' previous turns went
    through it (the turn before, as each conversation sent it), and the texts."""
    for chat in chats:
        render(chat[:-2])
    started = time.thread_time_ns()
    texts = [render(chat) for chat in chats]
    return (time.thread_time_ns() - started) / len(chats) / 1000, texts


def profile_renders(
    tokenizer_dir: Path | None = None,
    chats: int = 300,
    repeats: int = 5,
    lengths: Sequence[int] = LENGTHS,
    chat_template: str | None = None,
    shapes: Sequence[str] = SHAPES,
) -> list[RenderTime]:
    rows = []
    for shape in shapes:
        for length in lengths:
            tokenizer = (
                RequestTokenizer.from_pretrained(tokenizer_dir, chat_template=chat_template)
                if tokenizer_dir
                else RequestTokenizer.default(chat_template=chat_template)
            )
            whole = RenderSettings(tokenizer.chat_template(), None, None, dict(tokenizer.special_tokens), True)
            best = {"whole": float("inf"), "tokenizer": float("inf")}
            for number in range(repeats):
                # Each repetition its own conversations, each way its own copies of them (so
                # neither finds the other's in the CPU's caches), in alternating order.
                ways = {"whole": whole.render_whole, "tokenizer": tokenizer.render_chat}
                texts = {}
                for way in sorted(ways, reverse=number % 2 == 1):
                    batch = [conversation(shape, number * chats + index, length) for index in range(chats)]
                    spent, texts[way] = _timed_us(ways[way], batch)
                    best[way] = min(best[way], spent)
                if texts["whole"] != texts["tokenizer"]:
                    raise AssertionError(f"{shape} chats of {length} messages rendered differently")
            rows.append(RenderTime(shape, length, best["whole"], best["tokenizer"]))
    return rows


def format_renders(rows: Sequence[RenderTime]) -> str:
    lines = [f"{'shape':<6} {'messages':>8} {'whole us':>9} {'tokenizer us':>13}"]
    lines += [f"{r.shape:<6} {r.messages:>8} {r.whole_us:>9.1f} {r.tokenizer_us:>13.1f}" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m kvroute.benchmarks.profile_render", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer directory (default: the shipped one)")
    parser.add_argument("--chat-template", type=Path, help="a Jinja chat template file to render with instead")
    parser.add_argument("--chats", type=int, default=300, help="conversations per shape, length and repetition")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of: " + ", ".join(SHAPES))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    shapes = args.shapes.split(",")
    if not set(shapes) <= set(SHAPES):
        parser.error(f"--shapes takes {', '.join(SHAPES)}")
    template = args.chat_template.read_text() if args.chat_template else None
    rows = profile_renders(args.tokenizer, args.chats, args.repeats, chat_template=template, shapes=shapes)
    print(format_renders(rows))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(row) for row in rows], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
