"""The conversation ledger: where each conversation lives and what cache it needs there.

The routing engine owns it: it finds the conversation a request continues
(:meth:`WorkingSets.find`) before the policy chooses, and records the turn where the
request went (:meth:`WorkingSets.record`) after. Policies read it: the cache-aware policy
prices what a placement does to each backend's cache with :meth:`WorkingSets.placement_cost`
and :meth:`WorkingSets.relief` (the thrash model, ``docs/cost-model.md``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

#: A conversation not seen for this long no longer counts in any backend's working set:
#: about the longest pause between an agent's turns (a long tool run) or a user's reads.
CONVERSATION_IDLE_S = 600.0
#: Bound on tracked conversations (~400 bytes each, ~580 with two anchors: ~120 MB at most);
#: the least recent are dropped.
MAX_CONVERSATIONS = 200_000
#: Besides its last full block (its leaf), a conversation is found by the blocks this many
#: blocks before it: a next turn that does not repeat the previous prompt's tail still
#: holds one of them (a template that rewrites the last turn, a client that trims it, a
#: trace hashed in 512-token blocks whose partial last block the next turn replaces).
ANCHOR_DEPTHS = (16, 64)


def anchor_positions(blocks: int, shared_blocks: int) -> list[int]:
    """Where a prompt of ``blocks`` full blocks has its anchors (:data:`ANCHOR_DEPTHS` before
    its last block), past the ``shared_blocks`` it began sharing with other conversations:
    a shared prefix names no one conversation."""
    last = blocks - 1
    return [last - depth for depth in ANCHOR_DEPTHS if last - depth >= shared_blocks]


@dataclass(slots=True, eq=False)
class Conversation:
    """One conversation the router follows: where it lives and how much cache it needs."""

    key: str
    #: Backend its latest request went to (None: new, or its backend left the pool).
    backend: str | None = None
    #: Tokens of its own (beyond the prefix it shared with others when it began) it keeps.
    tokens: int = 0
    #: Leading tokens it shared with other conversations when it began (a system prompt).
    shared_tokens: int = 0
    turns: int = 0
    last_seen: float = 0.0
    #: Hash of the last full block of its latest prompt: the next turn contains it.
    leaf: int | None = None
    #: Hashes of earlier blocks of that prompt (:func:`anchor_positions`), should it not.
    anchors: tuple[int, ...] = ()

    @property
    def counted(self) -> bool:
        """Counted in its backend's working set: it came back at least once."""
        return self.turns >= 2


def thrash_loss(demand_tokens: int, conversations: int, capacity_tokens: int | None) -> int:
    """Tokens re-prefilled per round by ``conversations`` taking turns in an LRU cache."""
    if capacity_tokens is None or demand_tokens <= capacity_tokens:
        return 0
    return min(demand_tokens, conversations * (demand_tokens - capacity_tokens))


class WorkingSets:
    """Which conversation lives on which backend, and each backend's working set in tokens.

    A conversation is identified by its session key when the client sends one, else by
    its prompt chain: turn N+1's prompt extends turn N's, so it contains the hash of turn
    N's last full block (its *leaf*), or, where it rewrote turn N's tail, one of its
    *anchors* a few blocks before. A conversation counts in its backend's working set
    from its second request on, so one-off requests never inflate it, and stops counting
    after :data:`CONVERSATION_IDLE_S` without a request.
    """

    def __init__(
        self,
        *,
        idle_s: float = CONVERSATION_IDLE_S,
        max_conversations: int = MAX_CONVERSATIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._idle_s = idle_s
        self._max = max_conversations
        self._clock = clock
        self._conversations: OrderedDict[str, Conversation] = OrderedDict()  # least recent first
        self._leaves: dict[int, str] = {}
        self._tokens: dict[str, int] = {}
        # Per backend its counted conversations in the order they joined it (key -> it).
        self._members: dict[str, dict[str, Conversation]] = {}
        # Per backend the tracked conversations whose latest request went there, new ones
        # included (a first turn counts here, not yet in the working set).
        self._hosted: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._conversations)

    def demand(self, backend: str) -> tuple[int, int]:
        """``(tokens, conversations)`` counted on ``backend``."""
        return self._tokens.get(backend, 0), len(self._members.get(backend, ()))

    def hosted(self, backend: str) -> int:
        """Conversations (seen within the idle time) whose latest request went to ``backend``."""
        return self._hosted.get(backend, 0)

    def find(self, session_key: str | None, hashes: Sequence[int], shared_tokens: int) -> Conversation | None:
        """The conversation this request continues, or a new one (recorded by :meth:`record`).

        ``hashes`` are the prompt's block hashes; ``shared_tokens`` the longest prefix any
        backend holds (for a new conversation: the part it shares with others). None when
        the request has neither a session key nor a full block.
        """
        self._expire(self._clock())
        if session_key is not None:
            key = "session:" + session_key
            return self._conversations.get(key) or Conversation(key, shared_tokens=shared_tokens)
        leaves = self._leaves
        conversations = self._conversations
        # The leaves and anchors in the prompt, found in one pass in C (a first-seen or branched
        # 100K-token prompt's 6,300 blocks: ~0.25 ms, against ~0.65 ms walked in Python); a
        # handful at most, usually one conversation's. The latest one whose conversation is
        # still tracked is the one it continues (ordering them scans the prompt once each).
        blocks: Iterable[int] = leaves.keys() & hashes
        if len({leaves[block] for block in blocks}) > 1:
            blocks = sorted(blocks, key=hashes.index, reverse=True)
        for block in blocks:
            found = conversations.get(leaves[block])
            if found is not None:
                return found
        if not hashes:
            return None
        return Conversation(f"prefix:{hashes[-1]:016x}", shared_tokens=shared_tokens)

    def placement_cost(
        self, conversation: Conversation, prompt_tokens: int, backend: str, capacity_tokens: int | None
    ) -> int:
        """Change of ``backend``'s thrash loss if ``conversation`` continues there."""
        tokens, count = self.demand(backend)
        size = max(0, prompt_tokens - conversation.shared_tokens)
        if conversation.counted and conversation.backend == backend:
            after = thrash_loss(tokens - conversation.tokens + size, count, capacity_tokens)
        else:
            after = thrash_loss(tokens + size, count + 1, capacity_tokens)
        return after - thrash_loss(tokens, count, capacity_tokens)

    def relief(self, conversation: Conversation, capacity_tokens: int | None) -> int:
        """What leaving its home backend saves (<= 0, tokens re-prefilled per round).

        A thrashing backend recovers only once enough conversations leave, so a single
        departure is credited with a share of that recovery: the conversations that joined
        first and fit in the cache are its residents, the later ones its overflow, and each
        overflow conversation is credited an equal share of the whole loss. A resident is
        credited what its own departure changes.
        """
        home = conversation.backend
        if home is None or not conversation.counted:
            return 0
        tokens, count = self.demand(home)
        loss = thrash_loss(tokens, count, capacity_tokens)
        if loss == 0 or capacity_tokens is None:
            return 0
        resident_tokens = 0
        for position, member in enumerate(self._members[home].values()):
            resident_tokens += member.tokens
            if resident_tokens > capacity_tokens:
                overflow = count - position
                break
            if member is conversation:
                return thrash_loss(tokens - conversation.tokens, count - 1, capacity_tokens) - loss
        else:
            return 0
        return -(loss // overflow)

    def record(
        self,
        conversation: Conversation,
        backend: str,
        prompt_tokens: int,
        leaf: int | None,
        chain: Sequence[int] = (),
        block_size: int = 1,
    ) -> None:
        """``conversation``'s request of ``prompt_tokens`` went to ``backend``; ``leaf`` is
        the hash of its prompt's last full block; ``chain`` all its blocks' hashes (none with
        a session key), whose blocks at :func:`anchor_positions` become its anchors (past
        its shared prefix, in blocks of ``block_size`` tokens)."""
        now = self._clock()
        stays = conversation.counted and conversation.backend == backend
        if conversation.counted and not stays:
            self._uncount(conversation)
        # A retry of the same request (same last block) is not a new turn.
        if not (conversation.turns and leaf is not None and leaf == conversation.leaf):
            conversation.turns += 1
        size = max(0, prompt_tokens - conversation.shared_tokens)
        if stays:  # keeps its place in its backend's join order
            self._tokens[backend] += size - conversation.tokens
        elif conversation.counted:
            self._tokens[backend] = self._tokens.get(backend, 0) + size
            self._members.setdefault(backend, {})[conversation.key] = conversation
        tracked = self._conversations.get(conversation.key) is conversation
        if not tracked or conversation.backend != backend:
            if tracked and conversation.backend is not None:
                self._hosted[conversation.backend] -= 1
            self._hosted[backend] = self._hosted.get(backend, 0) + 1
        conversation.backend = backend
        conversation.tokens = size
        conversation.last_seen = now
        if leaf != conversation.leaf:  # a new turn (a retry keeps its leaf and anchors)
            self._unlink(conversation)
            conversation.leaf = leaf
            shared_blocks = conversation.shared_tokens // block_size
            conversation.anchors = tuple(chain[position] for position in anchor_positions(len(chain), shared_blocks))
            if not conversation.key.startswith("session:"):
                for block in (*conversation.anchors, *(() if leaf is None else (leaf,))):
                    self._leaves[block] = conversation.key
        conversations = self._conversations
        if conversations.get(conversation.key) is conversation:
            conversations.move_to_end(conversation.key)
        else:
            conversations[conversation.key] = conversation
            while len(conversations) > self._max:
                self._drop(next(iter(conversations.values())))

    def forget_backend(self, backend: str) -> None:
        """A backend left: its conversations no longer count anywhere until they return."""
        for conversation in self._conversations.values():
            if conversation.backend == backend:
                conversation.backend = None
        self._tokens.pop(backend, None)
        self._hosted.pop(backend, None)
        self._members.pop(backend, None)

    def _uncount(self, conversation: Conversation) -> None:
        backend = conversation.backend
        members = self._members.get(backend) if backend is not None else None
        if backend is None or members is None or members.pop(conversation.key, None) is None:
            return
        self._tokens[backend] -= conversation.tokens

    def _unlink(self, conversation: Conversation) -> None:
        """Its leaf and anchors no longer find it (those another conversation took stay)."""
        leaves = self._leaves
        for block in (conversation.leaf, *conversation.anchors):
            if block is not None and leaves.get(block) == conversation.key:
                del leaves[block]

    def _drop(self, conversation: Conversation) -> None:
        if conversation.counted:
            self._uncount(conversation)
        self._unlink(conversation)
        if conversation.backend is not None:
            self._hosted[conversation.backend] -= 1
        del self._conversations[conversation.key]

    def _expire(self, now: float) -> None:
        conversations = self._conversations
        deadline = now - self._idle_s
        while conversations:
            oldest = next(iter(conversations.values()))
            if oldest.last_seen >= deadline:
                return
            self._drop(oldest)
