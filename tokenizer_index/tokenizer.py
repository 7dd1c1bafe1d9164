"""RequestTokenizer: an OpenAI request -> the token ids the engine will prefill, fast.

Exact: a chat is rendered with the model's own template the way vLLM renders it (see
:mod:`kvroute.tokenizer_index.chat_messages` and :mod:`kvroute.tokenizer_index.chat_template`) and tokenized
without adding special tokens, as vLLM does for chats; a completion prompt is tokenized with
them, as vLLM does for completions.

Incremental: turn N+1 of a conversation re-renders all of turn N, but tokenizing it costs only
the new text. The rendered text is cut right after every added token (``<|im_end|>``, ...):
the tokenizer extracts added tokens before anything else and never merges across them, so
each piece tokenizes on its own to exactly the ids it has inside the whole text. Pieces are
memoised in a byte-bounded LRU (:class:`kvroute.tokenizer_index.piece_cache.PieceCache`) as int64
arrays, so the ``*_array`` encoders join a prompt's arrays (``join_ids``) and hand them to
the block hasher as is: converting a long list of ids to an array costs more than the rest
of a router's per-request work (``python -m kvroute.benchmarks.bench_tokenizer``). The list encoders
share the cache and the cutting; they join list forms of the pieces kept beside the arrays.
Whether cutting is exact for a given tokenizer is checked at construction on probe strings.
Some pipelines treat the start of the text apart (SentencePiece's Metaspace with
``prepend_scheme="first"``, transformers' conversion of Llama's and Mistral's tokenizers,
puts a prefix space there only): every piece but the text's first is then tokenized after
an added token, whose ids are dropped, as it follows one inside the text, if the probes
agree; where no cutting is exact the whole text is tokenized every time
(:attr:`RequestTokenizer.incremental` is then ``False``).

Chunked: a piece longer than :data:`CHUNK_CHARS` (:data:`COMPILED_CHUNK_CHARS` where new
words are looked up in compiled code; an agent's tool result, a pasted document, a
completions prompt) is cut further, at spaces between two letters, into chunks memoised
on their own: a prompt that repeats most of an earlier one (a shared document with
a new question after it) tokenizes only the chunks from where the two part. New chunks are
encoded in one batch on all the tokenizer's threads, with the GIL released for all of it but
the conversion of each chunk's ids: a 1M-token document tokenized in a worker thread never
holds the GIL for long. Such a cut is exact when the tokenizer's pre-tokenizer splits words
there and nothing before it looks across words: decided at construction from the
pipeline's parts and checked on probe texts (:attr:`RequestTokenizer.chunks_long_pieces`).

Word by word: new text of a few thousand characters (an agent's tool result) is cut into
the pre-tokenizer's words in Python and each word's ids taken from a word cache, where
the pipeline is a byte-level BPE whose words come from regexes
(:mod:`kvroute.tokenizer_index.word_split`); the library's batch call costs more than the
whole lookup at that size. Longer new text goes to the library's parallel batch.

Remembered: a chat prompt of :data:`MEMO_MIN_CHARS` or more is kept with its ids
(:mod:`kvroute.tokenizer_index.prompt_memo`); the conversation's next turn, which starts with
that text, takes the ids of all of it but its last few added tokens (kept as the read-only
runs they were joined from, never copied) and only the rest is cut into pieces and looked up.

Rendered incrementally: a chat of 16 messages or more is remembered with its rendered text
(:mod:`kvroute.tokenizer_index.render_memo`); its next turn renders only the first (or, where
the template peels a system message off, the first few) and the new messages, and where the
template reads a message's neighbours the last few remembered ones, and joins them to that
text, under templates whose syntax guarantees that this
equals the whole render (:mod:`kvroute.tokenizer_index.template_prefix`) and whose probe
conversations agree at first use (:meth:`RequestTokenizer.renders_incrementally`); every other
template renders every message every time.

Rendered from skeletons: a shorter chat of plain messages (a role and a text each), tool
results and assistants' tool calls, with or without tools, with no documents or template
keywords, is its shape's skeleton (per tools) filled with its texts and arguments
(:mod:`kvroute.tokenizer_index.render_skeleton`), under templates whose syntax shows that
they print them verbatim (:mod:`kvroute.tokenizer_index.template_verbatim`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Tokenizer

from kvroute.tokenizer_index import hf_files
from kvroute.tokenizer_index.bpe_merges import bpe_merges
from kvroute.tokenizer_index.chat_messages import conversation_from_request, tools_from_request
from kvroute.tokenizer_index.chat_template import ChatTemplate, ChatTemplateError
from kvroute.tokenizer_index.piece_cache import PieceCache, PieceCacheStats, frozen_ids, join_ids
from kvroute.tokenizer_index.prompt_memo import PromptMemo, PromptMemoStats, RememberedPrompt, conversation_keys
from kvroute.tokenizer_index.render_memo import MIN_MESSAGES as RENDER_MEMO_MESSAGES
from kvroute.tokenizer_index.render_memo import RenderMemo, RenderSettings, incremental_render_agrees
from kvroute.tokenizer_index.render_skeleton import SkeletonRenders, SkeletonStats, tools_key
from kvroute.tokenizer_index.template_prefix import PrefixShape, template_shape
from kvroute.tokenizer_index.word_split import (
    NEW_WORD_SOURCES,
    VERIFY_EVERY,
    WordSplitter,
    pipeline_parts,
    word_pattern,
)

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 64 * 1024 * 1024
DEFAULT_MEMO_BYTES = 64 * 1024 * 1024
DEFAULT_RENDER_MEMO_BYTES = 64 * 1024 * 1024
#: Chats shorter than this fill skeletons (longer ones, with shapes of their own, would each
#: build one): the render memo's threshold, where it takes over.
SKELETON_MESSAGES = RENDER_MEMO_MESSAGES
#: Chat prompts at least this long (characters, ~4K tokens) are remembered for their next turn.
MEMO_MIN_CHARS = 16_384
#: How far back from a remembered prompt's end its pieces are tried as the common prefix,
#: when a new prompt does not start with all of it (a template that renders the generation
#: prompt and the message that answers it differently).
MEMO_LOOK_BACK_PIECES = 4
_DEFAULT_DIRECTORY = Path(__file__).resolve().parent / "data" / "default"
# Texts around added tokens in the probes: spaces, newlines, digits, accents, combining marks,
# emoji, CJK; each probe is tokenized whole and piece by piece, and the two must agree.
_PROBE_CONTEXTS = ("x", " y", "\n", "  ", "Hé\u0301llo", "1", "\t😀 中文", "", " \n z ", "▁a")
_PROBE_TOKENS_MAX = 48

#: New text up to this many characters (all a request's new pieces together) is tokenized
#: word by word from the word cache where that is exact (:mod:`kvroute.tokenizer_index.word_split`):
#: ~55 us of CPU per 1,000 characters against the library's ~190 (8K-64K characters of
#: vocabulary words on 2 cores). More goes to the library's parallel batch, which keeps the
#: GIL free while a worker thread tokenizes a long document for the event loop.
WORD_SPLIT_MAX_CHARS = 65_536
#: Up to this many texts of up to :data:`SINGLE_ENCODE_CHARS` in all (a request's or a
#: turn's new words) go to the library one at a time: its batch call hands them to a
#: thread pool, whose threads a router's loop finds asleep: ~25-100 us more a call on 2
#: cores, more than encoding ~30 new words one by one (benchmarks/README.md, "New words
#: one at a time").
SINGLE_ENCODE_TEXTS = 32
SINGLE_ENCODE_CHARS = 1024
#: Pieces longer than this (characters) are cached as chunks of about this size, cut at
#: spaces between words, and new chunks tokenized in one parallel batch (where such cuts are
#: exact). Smaller chunks re-tokenize less where two prompts part; at 512 a 1,088-token
#: completions prompt that repeats a 1,024-token prefix costs ~0.3 of tokenizing it whole.
CHUNK_CHARS = 512
#: The chunk size where new text is cut and looked up in compiled code
#: (:attr:`FastPaths.words` "(compiled)"): re-tokenizing a chunk there costs ~15 ns a
#: character, less than each chunk's bookkeeping (~5 us: its cache entry, its array, its
#: slot in the joined ids); a new 8,000-token tool result tokenizes in ~0.8 of the time
#: at 2,048 as at 512 (benchmarks/README.md, "Longer chunks where words are compiled").
COMPILED_CHUNK_CHARS = 2048
#: New units go to the library's parallel batch call at most this many at a time.
ENCODE_SLICE_UNITS = 256
#: Texts' first units remembered under a context token (``RequestTokenizer._lead_ids``).
LEAD_UNITS = 1024
# Candidates for a cut: a space between two word characters that are not digits or "_";
# str.isalpha() then keeps those between two letters (the \p{L} of pre-tokenizer regexes).
_SPACE_BETWEEN_WORDS = re.compile(r"(?<=[^\W\d_]) (?=[^\W\d_])")
# Normalizers that map characters one at a time or compose marks onto the letter before
# them, so the text on either side of a space normalizes alone as it does inside the whole.
_CHARACTER_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "BertNormalizer"})
# Pre-tokenizers that split words apart at spaces (one of them is needed), and those that
# only split further or map single characters (allowed beside them in a Sequence).
_WORD_SPLITTERS = frozenset({"ByteLevel", "Split", "Metaspace", "Whitespace", "WhitespaceSplit", "BertPreTokenizer"})
_FURTHER_SPLITTERS = frozenset({"ByteLevel", "Punctuation", "Digits", "UnicodeScripts"})
# Probe words of every letter category (Lu, Ll, Lt, Lm, Lo), scripts with and without
# case, combining marks, ligatures and contractions, around the spaces chunks are cut at.
_CHUNK_PROBE_WORDS = (
    "The", "quick", "BROWN", "fox's", "don't", "ǅemal", "ʰaspirated", "naïve", "café", "e\u0301clair",
    "中文", "字符", "日本語", "カタカナ", "한국어", "한", "Ελληνικά", "русский", "שלום", "مرحبا", "ไทย",
    "a", "I", "x1", "y_z", "ﬁne", "İstanbul", "straße", "ǈ", "ªb", "Ⅻx", "ß",
)  # fmt: skip


def _component_state(component: Any) -> Any:
    """The JSON state of a normalizer or pre-tokenizer (None when the tokenizer has none)."""
    return None if component is None else json.loads(component.__getstate__())


def _trie_pattern(words: Iterable[str]) -> str:
    """A regex matching the longest of ``words`` at a position, built as a character trie.

    A flat alternation tries every word at every candidate position; the trie walks each
    character once, which matters for vocabularies with hundreds of added tokens.
    """
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}  # end of a word

    def build(node: dict[str, Any]) -> str:
        ends_here = "" in node
        branches = [re.escape(char) + build(child) for char, child in sorted(node.items()) if char]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        if ends_here:  # greedy optional: a longer word first, this one if that fails
            return "(?:" + body + ")?"
        return body

    return build(trie)


def _first_prompt(prompt: str | Sequence[Any]) -> str | Sequence[Any]:
    """What vLLM tokenizes of a completions ``prompt``: a string, token ids, or a batch's first."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, bytes) or not isinstance(prompt, Sequence):
        raise ValueError("prompt must be a string, a list of token ids, or a list of those")
    if not prompt:
        raise ValueError("prompt must not be empty")
    first = prompt[0]
    if isinstance(first, int) and not isinstance(first, bool):
        return prompt
    if isinstance(first, str) or (isinstance(first, Sequence) and not isinstance(first, bytes)):
        return _first_prompt(first)
    raise ValueError("prompt must be a string, a list of token ids, or a list of those")


def _token_id_array(prompt: Sequence[Any]) -> np.ndarray:
    """Token ids given by a client, converted once to a new int64 array.

    numpy's type inference is the check (a Python loop over 128K ids costs ~20 ms here):
    floats, strings, ``None``, nested lists and ids beyond int64 give another dtype or shape
    and are refused. JSON ``true``/``false`` among integers count as 1/0, as in vLLM's
    (pydantic's) validation of the request.
    """
    try:
        ids = np.array(prompt)
    except (TypeError, ValueError, OverflowError) as exc:  # ragged nesting
        raise ValueError("a token-id prompt must hold only integers") from exc
    if ids.ndim != 1 or ids.dtype.kind != "i":
        raise ValueError("a token-id prompt must hold only integers")
    return ids.astype(np.int64, copy=False)


def _ends_in_word_character(text: str) -> bool:
    last = text[-1:]
    return last.isalnum() or last == "_" or last > "\x7f"


def _never_overlap(first: Sequence[str], second: Sequence[str]) -> bool:
    """Whether no occurrence of a text of ``first`` in any text can overlap one of ``second``:
    none holds another, and no end of one (shorter than it) starts the other."""
    first, second = [text for text in first if text], [text for text in second if text]
    if not first or not second:
        return True
    starts = {text[:end] for text in second for end in range(1, len(text))}
    ends = {text[begin:] for text in second for begin in range(1, len(text))}
    inside_second = "\x00".join(second)
    for text in first:
        if text in inside_second or any(other in text for other in second):
            return False
        if any(text[begin:] in starts or text[:begin] in ends for begin in range(1, len(text))):
            return False
    return True


def _compiled_words(words: WordSplitter) -> str:
    """What of the new text cut word by word is cut in compiled code, as ``FastPaths`` says it."""
    if not words.compiled:
        return ""
    bpe = ", new words by BPE" if words.compiled_bpe else ""
    return f" (compiled{bpe})" if words.compiled_wide or not words.unicode else f" (compiled ascii{bpe})"


def _one_run(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """``arrays`` (read-only id arrays) joined into one read-only array (the one as it is)."""
    if len(arrays) == 1:
        return arrays[0]
    joined = join_ids(arrays)
    joined.flags.writeable = False
    return joined


def _cut_at_word_spaces(text: str, size: int) -> list[str]:
    """``text`` cut right before spaces between two letters into runs of at least ``size``
    characters (the last may be shorter; ``text`` whole if it has no such space)."""
    chunks: list[str] = []
    start = 0
    search = _SPACE_BETWEEN_WORDS.search
    match = search(text, size)
    while match is not None:
        cut = match.start()
        if text[cut - 1].isalpha() and text[cut + 1].isalpha():
            chunks.append(text[start:cut])
            start = cut
            match = search(text, cut + size)
        else:
            match = search(text, cut + 1)
    chunks.append(text[start:])
    return chunks


#: Distinct templates brought by requests kept compiled (vLLM's ``--trust-request-chat-template``).
REQUEST_TEMPLATES = 16


@lru_cache(maxsize=REQUEST_TEMPLATES)
def request_template(source: str) -> ChatTemplate:
    """A chat template a request brought, compiled once while it stays among the recent ones."""
    return ChatTemplate.from_source(source)


def _check_template_kwargs(kwargs: Mapping[str, Any]) -> None:
    """Refuse what chat template keywords may not set (as vLLM does): the template itself
    (a request brings one in its ``chat_template`` field) and ``tokenize``."""
    for forbidden in ("chat_template", "tokenize"):
        if forbidden in kwargs:
            raise ValueError(f"chat_template_kwargs may not set {forbidden!r}")


@dataclass(frozen=True, slots=True)
class FastPaths:
    """Which of its shortcuts a tokenizer takes (each exact, each checked at construction
    or at a template's first use): what an operator reads to know a model's cost."""

    #: Pieces cut at added tokens and memoised (else every text is tokenized whole).
    pieces: bool
    #: The added token pieces are tokenized after, where the pipeline needs one.
    context_token: str | None
    #: Long pieces cut into chunks at spaces between words, each memoised.
    chunks: bool
    #: New text word by word: "ascii", "ascii+unicode", or "off"; "(compiled)" where
    #: all of it is cut and looked up in compiled code, "(compiled ascii)" where ASCII only,
    #: each with ", new words by BPE" where words it has not seen are tokenized there too.
    words: str
    #: Per chat template: None where long conversations render only their new messages,
    #: else why they render whole.
    templates: dict[str, str | None]
    #: Per chat template: None where short plain chats are filled into skeletons, else why
    #: they go through the template engine.
    skeletons: dict[str, str | None] = field(default_factory=dict)
    #: The same for short chats with tool calls and tool results.
    tool_skeletons: dict[str, str | None] = field(default_factory=dict)

    def summary(self) -> str:
        """One line for the log."""
        pieces = "on" if self.context_token is None else f"on, after {self.context_token!r}"
        if not self.pieces:
            pieces = "off (whole texts)"
        templates = ", ".join(
            f"{name}: {'incremental' if reason is None else 'whole (' + reason + ')'}"
            + (
                f", short chats {_skeleton_verdict(self.skeletons[name], self.tool_skeletons.get(name))}"
                if name in self.skeletons
                else ""
            )
            for name, reason in self.templates.items()
        )
        return (
            f"pieces {pieces}; chunks {'on' if self.chunks else 'off'}; words {self.words}; "
            f"chat templates: {templates or 'none'}"
        )


def _skeleton_verdict(reason: str | None, tools_reason: str | None) -> str:
    if reason is not None:
        return f"rendered ({reason})"
    return (
        "from skeletons, with tool calls"
        if tools_reason is None
        else f"from skeletons, not with tool calls ({tools_reason})"
    )


class RequestTokenizer:
    """Turns chat messages and completion prompts into the engine's prompt token ids.

    Build one with :meth:`from_pretrained` or :meth:`default`; it is thread-safe and meant to
    be shared by every request for a model.
    """

    #: How a unit of text (a piece, or a chunk of a long one) got its ids (:meth:`unit_counts`).
    UNIT_SOURCES = ("cached", "words", "words_compiled", "library")
    NEW_WORD_SOURCES = NEW_WORD_SOURCES

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        chat_templates: Mapping[str, str] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        name: str = "tokenizer",
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        incremental: bool | None = None,
        chunk_chars: int | None = None,
        memo_bytes: int = DEFAULT_MEMO_BYTES,
        render_memo_bytes: int = DEFAULT_RENDER_MEMO_BYTES,
        word_split: bool = True,
        default_chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Wrap a ``tokenizers.Tokenizer``.

        ``chat_templates`` maps template names to Jinja sources (``"default"`` first; a
        ``"tool_use"`` one is chosen for requests with tools, as in transformers); without any,
        the shipped ChatML template is used. ``special_tokens`` are the template's variables
        (``bos_token``...). ``cache_bytes`` bounds the piece cache (0 disables it).
        ``incremental=None`` checks whether piecewise tokenization is exact for this tokenizer;
        ``False`` forces whole-text tokenization. New pieces longer than ``chunk_chars``
        characters are tokenized in parallel chunks where that is exact (0: never; None:
        :data:`COMPILED_CHUNK_CHARS` where words are looked up in compiled code, else
        :data:`CHUNK_CHARS`).
        ``memo_bytes`` bounds the long chat prompts remembered for their next turn (0: none);
        ``render_memo_bytes`` the rendered long conversations (0: every chat rendered whole).
        ``word_split=False`` leaves all new text to the library (else it is tokenized word by
        word where that is exact). ``default_chat_template_kwargs`` are the engine's
        (``vllm serve --default-chat-template-kwargs``): a request's own take precedence.
        """
        self._default_kwargs = dict(default_chat_template_kwargs or {})
        _check_template_kwargs(self._default_kwargs)
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tokenizer = tokenizer
        self.name = name
        templates = dict(chat_templates or {})
        self.has_own_chat_template = bool(templates)
        if not templates:
            templates = hf_files.read_directory_chat_templates(_DEFAULT_DIRECTORY)
        self._template_sources = templates
        self._templates: dict[str, ChatTemplate] = {}
        # Per template source: whether its conversations may be rendered incrementally.
        self._incremental_shapes: dict[str, PrefixShape | None] = {}
        self._render_refusals: dict[str, str] = {}
        self._render_memo = RenderMemo(render_memo_bytes)
        self._skeletons = SkeletonRenders()
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        # One shared int object per token id: cached list forms then cost a pointer per token.
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self._canonical_id = list(range(max(vocab.values(), default=-1) + 1)).__getitem__
        self._cache = PieceCache(cache_bytes, to_list=self._canonical_list)
        self._raw_added, self._normalized_apart = self._added_in_raw_text()
        self._left_stripping = frozenset(token.content for token in self._raw_added if token.lstrip)
        self._boundary_re, self._non_boundaries, self._boundary_tokens = self._boundary_matcher()
        # The same, capturing, where every match cuts: re.split then finds the cuts in C.
        self._boundary_split = (
            re.compile(f"({self._boundary_re.pattern})")
            if self._boundary_re is not None and not self._non_boundaries
            else None
        )
        # A scan for added tokens reads at most this many characters from where it tries one.
        self._longest_added_token = max((len(token.content) for token in self._raw_added), default=0)
        self._memo: PromptMemo[RememberedPrompt] = PromptMemo(memo_bytes)
        self._incremental = False
        # An added token new units are tokenized after (its ids dropped), for pipelines that
        # treat the start of a text apart (SentencePiece's Metaspace with prepend_scheme
        # "first"); None where a unit tokenizes alone as it does inside the text.
        self._context: str | None = None
        self._context_ids = 0
        self._leads: dict[str, tuple[np.ndarray, list[int]]] = {}
        if incremental is not False and self._boundary_re is not None:
            self._incremental = self._piecewise_is_exact()
            if not self._incremental:
                self._incremental = self._piecewise_after_context_is_exact()
            if not self._incremental:
                log.info("tokenizer %s: piecewise tokenization is not exact; tokenizing whole texts", name)
        self._prompt_prefix: np.ndarray | None
        self._prompt_suffix: np.ndarray | None
        self._prompt_prefix, self._prompt_suffix = self._special_token_wrapping()
        self._words = self._word_splitter() if word_split else None
        if chunk_chars is None:
            chunk_chars = COMPILED_CHUNK_CHARS if self._words is not None and self._words.compiled else CHUNK_CHARS
        self._chunk_chars = chunk_chars
        self._chunks_long_pieces = chunk_chars > 0 and self._incremental and self._word_cuts_are_exact()
        self._word_texts = 0  # texts tokenized word by word, for the periodic check
        # New units (pieces or chunks the piece cache lacked) by who tokenized them.
        self._new_units = {source: 0 for source in self.UNIT_SOURCES if source != "cached"}

    # --- construction --------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls, name_or_path: str | os.PathLike[str], *, chat_template: str | None = None, **options: Any
    ) -> RequestTokenizer:
        """Load a Hugging Face tokenizer: a local directory, or a hub id via transformers.

        ``chat_template`` (Jinja source) replaces the tokenizer's own templates, for every
        request, as ``vllm serve --chat-template`` does. ``options`` are passed to the
        constructor (``cache_bytes``, ``incremental``, ``chunk_chars``, ``memo_bytes``,
        ``default_chat_template_kwargs``...).
        """
        files = hf_files.load(os.fspath(name_or_path))
        return cls(
            files.tokenizer,
            chat_templates=files.chat_templates if chat_template is None else {"default": chat_template},
            special_tokens=files.special_tokens,
            name=files.name_or_path,
            **options,
        )

    @classmethod
    def default(cls, *, chat_template: str | None = None, **options: Any) -> RequestTokenizer:
        """The byte-level BPE shipped with kvroute (ChatML template); needs no download."""
        return cls.from_pretrained(cls.default_path(), chat_template=chat_template, **options)

    @staticmethod
    def default_path() -> Path:
        """The directory of the shipped default tokenizer (a valid Hugging Face tokenizer dir)."""
        return _DEFAULT_DIRECTORY

    def _added_in_raw_text(self) -> tuple[list[AddedToken], bool]:
        """The added tokens the tokenizer finds in the raw text, and whether others are looked
        for apart, in the normalized pieces between those.

        The library extracts non-normalized added tokens first, then normalizes the text
        between them and extracts the normalized ones there. Without a normalizer (none, or
        an empty sequence: DeepSeek's) that second pass reads the raw text too, and where no
        normalized token's text can overlap a non-normalized one's (one inside the other,
        or one's end the other's start) both passes find what one pass over all of them
        finds.
        """
        tokens = list(self._tokenizer.get_added_tokens_decoder().values())
        raw = [token for token in tokens if not token.normalized]
        normalized = [token for token in tokens if token.normalized]
        if not normalized:
            return raw, False
        unnormalized = not pipeline_parts(_component_state(self._tokenizer.normalizer))
        if unnormalized and _never_overlap([t.content for t in normalized], [t.content for t in raw]):
            return tokens, False
        return raw, True

    def _boundary_matcher(self) -> tuple[re.Pattern[str] | None, frozenset[str], list[str]]:
        """A regex finding added tokens as the tokenizer's first pass does, and the non-cuts.

        The tokenizer first looks for its non-normalized added tokens in the raw text (the
        leftmost, longest one), so the regex holds exactly those (and the normalized ones
        where it finds them in the raw text too: :meth:`_added_in_raw_text`); other normalized
        ones are looked for later, inside the pieces, and never cut. Some matches must not cut
        either: tokens that swallow the whitespace after them (``rstrip``), ``single_word``
        tokens (and, when there are any, tokens ending in a word character, whose next piece
        would otherwise lose the context a single-word match depends on), and special tokens
        when the tokenizer reads them as text. Not cutting is always exact; it only caches less.
        """
        matched = self._raw_added
        contents = [token.content for token in matched if token.content]
        if not contents:
            return None, frozenset(), []
        pattern = re.compile(_trie_pattern(contents))
        specials_as_text = self._tokenizer.encode_special_tokens
        any_single_word = any(token.single_word for token in matched)
        non_boundaries = frozenset(
            token.content
            for token in matched
            if token.rstrip
            or token.single_word
            or (specials_as_text and token.special)
            or (any_single_word and _ends_in_word_character(token.content))
        )
        return pattern, non_boundaries, [content for content in contents if content not in non_boundaries]

    def _probe_texts(self) -> list[str]:
        # The tokens the templates write come first: those are the cuts that matter most.
        template_text = "".join(self._template_sources.values())
        tokens = sorted(self._boundary_tokens, key=lambda token: (token not in template_text, token))
        tokens = tokens[:_PROBE_TOKENS_MAX]
        probes = []
        for token in tokens:
            probes.append(token.join(_PROBE_CONTEXTS) + token)
            probes.append(token + token + "a" + token)
        if tokens:
            probes.append("".join(f"{context}{token}" for context, token in zip(_PROBE_CONTEXTS * 10, tokens)))
        try:
            probes.append(
                self.render_chat(
                    [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Hi there 😀"},
                        {"role": "assistant", "content": " Hello!\n"},
                        {"role": "user", "content": "\n中文 text"},
                    ]
                )
            )
        except ValueError:
            pass  # a template that rejects this sample: the synthetic probes still decide
        return probes

    def _piecewise_is_exact(self) -> bool:
        """Whether the probe texts, cut into pieces, tokenize to the whole texts' ids."""
        return self._cuts_agree(self._probe_texts(), self._pieces)

    def _cuts_agree(self, probes: list[str], cut: Callable[[str], list[str]]) -> bool:
        """Whether every probe, cut by ``cut`` and its parts tokenized as :meth:`_units_ids`
        does, has the whole probe's ids."""
        encode_batch = self._tokenizer.encode_batch_fast
        for probe, whole in zip(probes, encode_batch(probes, add_special_tokens=False)):
            joined: list[int] = []
            for ids in self._units_ids(cut(probe), at_text_start=True):
                joined += ids
            if joined != whole.ids:
                return False
        return True

    def _piecewise_after_context_is_exact(self) -> bool:
        """Whether the probes agree when every piece but a text's first is tokenized after an
        added token (one of the first two the tokenizer cuts at), as it follows one inside
        the text; if so that token stays the context."""
        contents = [added.content for added in self._raw_added]
        for token in self._boundary_tokens[:2]:
            # No longer added token may start with it: matched leftmost-longest, it would run
            # on into the unit after it.
            if any(other != token and other.startswith(token) for other in contents):
                continue
            [encoding] = self._tokenizer.encode_batch_fast([token], add_special_tokens=False)
            self._context, self._context_ids = token, len(encoding.ids)
            if self._context_ids and self._piecewise_is_exact():
                return True
        self._context, self._context_ids = None, 0
        return False

    def _units_ids(self, units: Sequence[str], *, at_text_start: bool) -> list[list[int]]:
        """The library's ids of each of ``units`` as it reads inside a text: after the
        context token where there is one, but for a first unit at the text's start."""
        encode_batch = self._tokenizer.encode_batch_fast
        context = self._context
        if context is None:
            return [encoding.ids for encoding in encode_batch(list(units), add_special_tokens=False)]
        lead = (
            [encoding.ids for encoding in encode_batch(list(units[:1]), add_special_tokens=False)]
            if at_text_start
            else []
        )
        rest = [context + unit for unit in units[len(lead) :]]
        skip = self._context_ids
        return [*lead, *(encoding.ids[skip:] for encoding in encode_batch(rest, add_special_tokens=False))]

    def _word_cuts_are_exact(self) -> bool:
        """Whether cutting a piece at a space between two letters leaves its ids unchanged.

        The pipeline must split words at such a space (a word-splitting pre-tokenizer) and
        nothing before that may look across it: no normalizer but per-character ones, no
        added token that strips, matches whole words only or is looked for in normalized
        text (each could span the cut). Then probe texts, cut at every such space, must
        tokenize to the ids of the whole text.
        """
        normalizers = pipeline_parts(_component_state(self._tokenizer.normalizer))
        if any(part.get("type") not in _CHARACTER_NORMALIZERS for part in normalizers):
            return False
        pre_tokenizers = pipeline_parts(_component_state(self._tokenizer.pre_tokenizer))
        if any(part.get("type") not in _WORD_SPLITTERS | _FURTHER_SPLITTERS for part in pre_tokenizers):
            return False
        splits_words = any(
            part["type"] in ("Split", "Whitespace", "WhitespaceSplit", "BertPreTokenizer")
            or (part["type"] == "ByteLevel" and part.get("use_regex", True))
            or (part["type"] == "Metaspace" and part.get("split", True))
            for part in pre_tokenizers
        )
        added = self._tokenizer.get_added_tokens_decoder().values()
        if (
            not splits_words
            or self._normalized_apart
            or any(token.lstrip or token.rstrip or token.single_word for token in added)
        ):
            return False
        return self._chunk_probes_agree()

    def _chunk_probes_agree(self) -> bool:
        words = _CHUNK_PROBE_WORDS
        probes = [
            " ".join(words),
            " ".join(reversed(words)),
            " " + " ".join(words[::2]) + " ",
            "x  " + " ".join(words[1::3]),
        ]
        probes += [f"{left} {right}" for left in words for right in words[:: max(1, len(words) // 8)]]
        if self._cuts_agree(probes, lambda probe: _cut_at_word_spaces(probe, 1)):
            return True
        log.info("tokenizer %s: cuts between words are not exact; long pieces are tokenized whole", self.name)
        return False

    def _word_splitter(self) -> WordSplitter | None:
        """Word-by-word tokenization of new text, where it is exact: pieces are cut at
        every added token the library extracts (none is looked for in normalized text), the
        pipeline's words come from regexes kvroute translates, and the probes agree."""
        if not self._incremental or self._context is not None or self._normalized_apart:
            return None
        state = json.loads(self._tokenizer.to_str())
        pattern = word_pattern(state.get("normalizer"), state.get("pre_tokenizer"), state.get("model"))
        if pattern is None:
            return None
        normalizer = self._tokenizer.normalizer
        splitter = WordSplitter(
            pattern,
            self._encode_each,
            normalize=normalizer.normalize_str if normalizer else None,
            bpe=bpe_merges(state.get("model")),
        )
        if not splitter.agrees(self._encode_each):
            log.info("tokenizer %s: its words cut in Python differ from its own; not tokenizing by words", self.name)
            return None
        if pattern.unicode is not None and not splitter.unicode:
            log.info("tokenizer %s: text that is not ASCII cut in Python differs; the library tokenizes it", self.name)
        return splitter

    def _encode_each(self, texts: list[str]) -> list[list[int]]:
        if len(texts) <= SINGLE_ENCODE_TEXTS and sum(map(len, texts)) <= SINGLE_ENCODE_CHARS:
            encode = self._tokenizer.encode
            return [encode(text, add_special_tokens=False).ids for text in texts]
        return [encoding.ids for encoding in self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def _special_token_wrapping(self) -> tuple[np.ndarray, np.ndarray] | tuple[None, None]:
        """The ids the post-processor puts around a completion prompt (e.g. ``[bos]``, ``[]``).

        ``(None, None)`` when they are not a fixed prefix and suffix: prompts are then
        tokenized whole with special tokens.
        """
        samples = ["a", "", "Hello world", " 1 2\n3"]
        plain = [encoding.ids for encoding in self._tokenizer.encode_batch_fast(samples, add_special_tokens=False)]
        wrapped = [encoding.ids for encoding in self._tokenizer.encode_batch_fast(samples, add_special_tokens=True)]
        # Where the plain ids of the first sample sit inside its wrapped ids.
        first, first_wrapped = plain[0], wrapped[0]
        start = next((i for i in range(len(first_wrapped)) if first_wrapped[i : i + len(first)] == first), None)
        if start is None:
            return None, None
        prefix, suffix = first_wrapped[:start], first_wrapped[start + len(first) :]
        if any(prefix + ids + suffix != expected for ids, expected in zip(plain, wrapped)):
            return None, None
        return frozen_ids(prefix), frozen_ids(suffix)

    # --- properties ----------------------------------------------------------------------

    @property
    def incremental(self) -> bool:
        """Whether texts are tokenized piece by piece with memoisation (else whole)."""
        return self._incremental

    @property
    def chunk_chars(self) -> int:
        """The size (characters) long pieces are cut into chunks of, where they are."""
        return self._chunk_chars

    @property
    def chunks_long_pieces(self) -> bool:
        """Whether long new pieces are tokenized in parallel chunks cut between words."""
        return self._chunks_long_pieces

    @property
    def backend(self) -> Tokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tokenizer

    @cached_property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @cached_property
    def eos_token_id(self) -> int | None:
        """The id of ``eos_token``, if the tokenizer names one."""
        eos = self.special_tokens.get("eos_token")
        return None if eos is None else self._tokenizer.token_to_id(eos)

    def cache_stats(self) -> PieceCacheStats:
        """Size and hit counters of the piece cache."""
        return self._cache.stats()

    def memo_stats(self) -> PromptMemoStats:
        """Size and counters of the remembered long prompts."""
        return self._memo.stats()

    def unit_counts(self) -> dict[str, int]:
        """Units of text by how their ids were found: ``cached`` (the piece cache), ``words``
        (new text word by word in Python), ``words_compiled`` (in compiled code), ``library``
        (the tokenizers library). Counters: they only grow."""
        return {"cached": self._cache.stats().hits, **self._new_units}

    def new_word_counts(self) -> dict[str, int]:
        """Words new text brought that the word caches lacked, by who tokenized them: ``bpe``
        (compiled code, :mod:`~kvroute.tokenizer_index.bpe_merges`) or ``library``; none
        without word-by-word tokenization. Counters: they only grow."""
        return self._words.new_word_counts() if self._words is not None else dict.fromkeys(NEW_WORD_SOURCES, 0)

    def render_memo_stats(self) -> PromptMemoStats:
        """Size and counters of the remembered rendered conversations."""
        return self._render_memo.stats()

    def skeleton_stats(self) -> SkeletonStats:
        """Counters of the short chats rendered by filling a skeleton."""
        return self._skeletons.stats()

    def clear_cache(self) -> None:
        """Forget every memoised piece, word, remembered prompt and rendered conversation."""
        self._cache.clear()
        if self._words is not None:
            self._words.clear()
        self._memo.clear()
        self._render_memo.clear()
        self._skeletons.clear()
        self._leads.clear()

    # --- chat ------------------------------------------------------------------------------

    def chat_template(self, *, tools: bool = False, requested: str | None = None) -> ChatTemplate:
        """The template a request uses: the one it brings (``requested``: Jinja source, or
        where the tokenizer has several named templates one of their names, as transformers
        reads it), else ``tool_use`` for requests with tools when present, else the default."""
        sources = self._template_sources
        if requested is not None:
            return (
                self._compiled_template(requested) if self._names_template(requested) else request_template(requested)
            )
        if tools and "tool_use" in sources:
            name = "tool_use"
        elif "default" in sources:
            name = "default"
        elif len(sources) == 1:
            name = next(iter(sources))
        else:
            raise ValueError(f"the tokenizer has several chat templates and no default: {sorted(sources)}")
        return self._compiled_template(name)

    def _names_template(self, requested: str) -> bool:
        """Whether a request's ``chat_template`` names one of the tokenizer's templates (only
        where it has several, as in transformers; else it is Jinja source)."""
        return len(self._template_sources) > 1 and requested in self._template_sources

    def _compiled_template(self, name: str) -> ChatTemplate:
        """The chat template of that name, compiled at its first use."""
        template = self._templates.get(name)
        if template is None:
            template = self._templates[name] = ChatTemplate.from_source(self._template_sources[name])
        return template

    def renders_incrementally(self, template: ChatTemplate) -> bool:
        """Whether long conversations under ``template`` render only their new messages
        after a remembered earlier turn (:mod:`kvroute.tokenizer_index.render_memo`): the
        template's syntax must promise it and probe conversations must agree, checked at
        its first use."""
        return self._incremental_shape(template) is not None

    def _incremental_shape(self, template: ChatTemplate) -> PrefixShape | None:
        """The template's shape when it renders incrementally (above), else None."""
        if template.source in self._incremental_shapes:
            return self._incremental_shapes[template.source]
        shape = template_shape(template)
        reason = shape.refusal
        if reason is None and not incremental_render_agrees(template, self.special_tokens, shape):
            reason = "probe conversations rendered incrementally differ from whole renders"
        if reason is not None:
            log.info("tokenizer %s: rendering chats whole under this chat template: %s", self.name, reason)
            self._render_refusals[template.source] = reason
        verdict = self._incremental_shapes[template.source] = shape if reason is None else None
        return verdict

    def fast_paths(self) -> FastPaths:
        """Which shortcuts this tokenizer takes (checks every chat template now, if not yet)."""
        templates: dict[str, str | None] = {}
        skeletons: dict[str, str | None] = {}
        tool_skeletons: dict[str, str | None] = {}
        for name, source in self._template_sources.items():
            try:  # (a template that does not compile fails its requests, as before, not this)
                template = self._compiled_template(name)
            except ChatTemplateError as error:
                templates[name] = str(error)
                continue
            templates[name] = None if self.renders_incrementally(template) else self._render_refusals.get(source)
            skeletons[name] = self._skeletons.refusal(template)
            tool_skeletons[name] = self._skeletons.refusal(template, tools=True)
        words = self._words
        return FastPaths(
            pieces=self._incremental,
            context_token=self._context,
            chunks=self._chunks_long_pieces,
            words="off" if words is None else ("ascii+unicode" if words.unicode else "ascii") + _compiled_words(words),
            templates=templates,
            skeletons=skeletons,
            tool_skeletons=tool_skeletons,
        )

    def _skeleton_fill(
        self, template: ChatTemplate, tools: Any, variables: dict[str, Any]
    ) -> Callable[[Sequence[Any], bool], str | None] | None:
        """What fills a short chat (fewer messages than the render memo takes) into its
        skeleton under these settings, or says None: the request itself, and the anchors
        and new messages the render memo renders behind a remembered turn (the tools'
        JSON made once for all of them). None where no skeleton can hold these tools."""
        renders = self._skeletons
        tools_json = tools_key(tools)
        if tools_json is None:
            return None

        def fill(messages: Sequence[Any], add_generation_prompt: bool) -> str | None:
            if type(messages) is not list or len(messages) >= SKELETON_MESSAGES:
                return None

            def render_whole(plain: Sequence[Any]) -> str:  # (only to build or check a skeleton)
                dumped = tools_from_request(tools)
                return RenderSettings(template, dumped, None, variables, add_generation_prompt).render_whole(plain)

            return renders.render(messages, template, add_generation_prompt, render_whole, tools_json)

        return fill

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
    ) -> str:
        """The prompt text vLLM renders for this chat request (see :meth:`encode_chat`)."""
        template = self.chat_template(tools=tools is not None, requested=chat_template)
        variables: dict[str, Any] = {**self.special_tokens}
        keywords = bool(chat_template_kwargs or self._default_kwargs)
        if keywords:
            request_kwargs = {**self._default_kwargs, **(chat_template_kwargs or {})}
            _check_template_kwargs(request_kwargs)
            # Keywords of apply_chat_template itself steer the rendering instead of the template.
            add_generation_prompt = bool(request_kwargs.pop("add_generation_prompt", add_generation_prompt))
            continue_final_message = bool(request_kwargs.pop("continue_final_message", continue_final_message))
            documents = request_kwargs.pop("documents", documents)
            variables.update(request_kwargs)
        # A template the request brought renders whole: probing each one's shape (and keeping
        # the verdicts) would let clients grow that table.
        own = chat_template is None or self._names_template(chat_template)
        fill = None
        if own and documents is None and not continue_final_message and not keywords:
            fill = self._skeleton_fill(template, tools, variables)
            short = type(messages) is list and len(messages) < self._render_memo.min_messages
            text = fill(messages, add_generation_prompt) if fill is not None and short else None
            if text is not None:
                return text
        shape = None if continue_final_message or not own else self._incremental_shape(template)
        if shape is not None:
            settings = RenderSettings(
                template, tools_from_request(tools), documents, variables, add_generation_prompt, shape, fill
            )
            return self._render_memo.render(messages, settings)
        conversation = conversation_from_request(messages, template.content_format)
        return template.render(
            conversation,
            tools=tools_from_request(tools),
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            variables=variables,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
    ) -> list[int]:
        """The prompt token ids vLLM computes for a ``/v1/chat/completions`` request.

        ``messages`` and ``tools`` as in the OpenAI API (content as a string, ``None`` or a
        list of parts; tool calls with JSON-string arguments); the other arguments are the
        request fields of the same names. Raises ``ValueError`` (a client error) for malformed
        messages or when the template refuses them.
        """
        text = self.render_chat(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
            documents=documents,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
        )
        return self.encode_text(text)

    def encode_chat_array(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
    ) -> np.ndarray:
        """:meth:`encode_chat` as a new contiguous int64 array (what the block hasher takes).

        A long prompt is remembered, and one that starts with a remembered prompt of its
        conversation reuses that prefix's ids (see the module docstring).
        """
        text = self.render_chat(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
            documents=documents,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
        )
        return self.encode_rendered_chat_array(text, messages)

    def encode_rendered_chat_array(self, text: str, messages: Sequence[Mapping[str, Any]]) -> np.ndarray:
        """The ids of ``text``, which :meth:`render_chat` rendered from ``messages``: the second
        half of :meth:`encode_chat_array` (``messages`` name the conversation in the memo)."""
        if len(text) >= MEMO_MIN_CHARS and self._memo.max_bytes and self._incremental and self._boundary_re:
            keys = conversation_keys(messages)
            if keys:
                return self._encode_remembering(text, keys)
        return self.encode_text_array(text)

    # --- completions -----------------------------------------------------------------------

    def encode_prompt(self, prompt: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]]) -> list[int]:
        """The prompt token ids of a ``/v1/completions`` request (for a batch: its first prompt).

        A string is tokenized with the tokenizer's special tokens (a BOS, for tokenizers that
        add one), as vLLM does for completions; token ids are returned as they are (JSON
        ``true``/``false`` among them as 1/0). Raises ``ValueError`` for anything else.
        """
        first = _first_prompt(prompt)
        if isinstance(first, str):
            return self.encode_text(first, add_special_tokens=True)
        return _token_id_array(first).tolist()

    def encode_prompt_array(self, prompt: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]]) -> np.ndarray:
        """:meth:`encode_prompt` as a new contiguous int64 array (token ids converted once)."""
        first = _first_prompt(prompt)
        if isinstance(first, str):
            return self.encode_text_array(first, add_special_tokens=True)
        return _token_id_array(first)

    # --- text ------------------------------------------------------------------------------

    def encode_text(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Tokenize ``text`` (incrementally when possible); the hot path of the list encoders."""
        joined: list[int] = []
        for part in self._parts(text, add_special_tokens=add_special_tokens, arrays=False):
            joined += part  # += is several times faster than chain() for long lists
        return joined

    def encode_text_array(self, text: str, *, add_special_tokens: bool = False) -> np.ndarray:
        """:meth:`encode_text` as a new int64 array: the pieces' cached arrays, joined in one copy."""
        return join_ids(self._parts(text, add_special_tokens=add_special_tokens, arrays=True))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Token ids back to text."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _parts(self, text: str, *, add_special_tokens: bool, arrays: bool) -> list[Any]:
        """Runs of ``text``'s ids, int64 arrays or lists, that joined in order are all of them."""
        if add_special_tokens and self._prompt_prefix is None:
            return [self._encode_whole(text, add_special_tokens=True, array=arrays)]
        if self._incremental:
            parts, _ = self._unit_ids(self._pieces(text), arrays=arrays)
        else:
            parts = [self._encode_whole(text, add_special_tokens=False, array=arrays)]
        if add_special_tokens:
            prefix, suffix = self._prompt_prefix, self._prompt_suffix
            assert prefix is not None and suffix is not None  # else encoded whole above
            if not arrays:
                prefix, suffix = prefix.tolist(), suffix.tolist()
            parts = [prefix, *parts, suffix]
        return parts

    def _encode_whole(self, text: str, *, add_special_tokens: bool, array: bool) -> list[int] | np.ndarray:
        # The batch encoder, not encode(): it releases the GIL while it works (encode() held it
        # for all 3.5 s of a 1M-token text, stalling a router's event loop in a worker thread)
        # and skips the character offsets routing never reads; the ids are the same.
        [encoding] = self._tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        ids = encoding.ids
        self._new_units["library"] += 1  # the whole text, one unit
        return np.array(ids, dtype=np.int64) if array else ids

    def _encode_remembering(self, text: str, keys: list[int]) -> np.ndarray:
        """``text``'s ids, from the longest usable prefix a remembered prompt gives and the
        pieces after it; then ``text`` is remembered under ``keys[0]`` (its last message)."""
        start = reused_tokens = 0
        kept = -1  # the last of the remembered prompt's pieces that is reused
        previous = None
        previous_key: int | None = None
        for key, candidate in self._memo.candidates(keys):
            kept = self._reusable_pieces(candidate, text)
            if kept >= 0:
                previous, previous_key = candidate, key
                self._memo.reused()
                break
        if previous is not None:
            start = int(previous.piece_ends[kept])
            reused_tokens = int(previous.token_ends[kept])
        pieces = self._pieces(text, start)
        parts, units = self._unit_ids(pieces, arrays=True, at_text_start=start == 0)
        # This turn's pieces as one run: a conversation adds a run or two a turn, so the memo
        # joins all its ids (0.1-0.4 ms per 100K) every few dozen turns, not every few.
        fresh = _one_run(parts)
        runs = [*previous.runs_up_to(reused_tokens), fresh] if previous is not None else [fresh]
        ids = join_ids(runs)
        piece_ends = start + np.cumsum([len(piece) for piece in pieces], dtype=np.int64)
        # Where each piece's ids end: at its last unit's end.
        unit_token_ends = np.cumsum([len(part) for part in parts], dtype=np.int64)
        token_ends = reused_tokens + unit_token_ends[np.cumsum(units, dtype=np.int64) - 1]
        if previous is not None:
            piece_ends = np.concatenate((previous.piece_ends[: kept + 1], piece_ends))
            token_ends = np.concatenate((previous.token_ends[: kept + 1], token_ends))
        # The memo keeps the read-only runs ids was joined from, not ids: the caller owns ids
        # and may change them, and a copy of 100K ids cost up to 0.4 ms.
        self._memo.remember(keys[0], RememberedPrompt.of(text, piece_ends, token_ends, runs), supersedes=previous_key)
        return ids

    def _reusable_pieces(self, previous: RememberedPrompt, text: str) -> int:
        """Index of the last of ``previous``'s pieces whose ids ``text`` may reuse (-1: none).

        ``text`` must start with those pieces, and a scan of ``text`` for added tokens must
        find the same ones there: it does up to the last piece ending at least one added
        token's length before where the two texts may part, because the scan decides each
        position from the characters that follow it, no more than that length.
        """
        old = previous.text
        ends = previous.piece_ends
        if text.startswith(old):
            common = len(old)
        else:
            common = -1
            for index in range(len(ends) - 2, max(-1, len(ends) - 2 - MEMO_LOOK_BACK_PIECES), -1):
                end = int(ends[index])
                begin = int(ends[index - 1]) if index else 0
                # The piece that ends there first: it sets other conversations' prompts aside
                # without copying the whole prefix for the comparison.
                if text.startswith(old[begin:end], begin) and text.startswith(old[:end]):
                    common = end
                    break
            if common < 0:
                return -1
        return int(np.searchsorted(ends, common - self._longest_added_token, side="right")) - 1

    def _pieces(self, text: str, start: int = 0) -> list[str]:
        """``text`` from ``start`` (where a piece ends) cut right after each added token the
        tokenizer itself cuts at."""
        pattern = self._boundary_re
        if pattern is None:
            return [text[start:]]
        pieces: list[str]
        if start == 0 and self._boundary_split is not None:
            parts = self._boundary_split.split(text)  # text, token, text, token... text
            pieces = [before + token for before, token in zip(parts[::2], parts[1::2])]
            if parts[-1] or not pieces:
                pieces.append(parts[-1])
            return pieces
        pieces = []
        non_boundaries = self._non_boundaries
        for match in pattern.finditer(text, start):
            end = match.end()
            if end == match.start() or (non_boundaries and match.group() in non_boundaries):
                continue
            pieces.append(text[start:end])
            start = end
        if start < len(text) or not pieces:
            pieces.append(text[start:])
        return pieces

    def _unit_ids(self, pieces: list[str], *, arrays: bool, at_text_start: bool = True) -> tuple[list[Any], list[int]]:
        """The ids of every piece's units (shared arrays or lists, in order) from the cache,
        misses tokenized in one batch; and how many units each piece has. ``at_text_start``:
        the first piece starts the text (else it follows an added token).

        A piece longer than the chunk size is looked up as its chunks (:meth:`_units`), so a
        prompt that repeats most of an earlier one tokenizes only the chunks where it differs.
        Under a context token (:attr:`_context`) the cache holds units as they read after it,
        and a text's first unit is kept apart (:meth:`_lead_ids`).
        """
        longest = self._chunk_chars
        if not self._chunks_long_pieces or max(map(len, pieces), default=0) <= longest:
            flat = pieces  # (every piece one unit: the common case, kept fast)
            counts = [1] * len(pieces)
        else:  # only the long pieces are cut (a system prompt with tools, a document)
            flat = []
            counts = []
            for piece in pieces:
                if len(piece) > longest:
                    chunks = self._units(piece)
                    flat += chunks
                    counts.append(len(chunks))
                else:
                    flat.append(piece)
                    counts.append(1)
        cache = self._cache
        lead: list[Any] = []
        if self._context is not None and at_text_start and flat:
            lead_array, lead_list = self._lead_ids(flat[0])
            lead = [lead_array] if arrays else [lead_list]
            flat = flat[1:]
        found: list[Any] = cache.get_arrays(flat) if arrays else cache.get_lists(flat)
        missing = [index for index, ids in enumerate(found) if ids is None]
        if missing and self._words is not None:
            missing = self._by_words(flat, missing, found, arrays=arrays)
        self._new_units["library"] += len(missing)
        # In slices: the library returns a batch's encodings holding the GIL, ~15 ms for the
        # 6,700 chunks of a 1M-token document, a stall for the event loop; 256 at a time
        # hold it ~4 ms at most and cost no time.
        for start in range(0, len(missing), ENCODE_SLICE_UNITS):
            chosen = missing[start : start + ENCODE_SLICE_UNITS]
            new_entries = []
            for index, ids in zip(chosen, self._units_ids([flat[index] for index in chosen], at_text_start=False)):
                array, as_list = self._converted_ids(ids, as_list=not arrays)
                found[index] = array if arrays else as_list
                new_entries.append((flat[index], array, as_list))
            cache.put_many(new_entries)
        return [*lead, *found], counts

    def _lead_ids(self, unit: str) -> tuple[np.ndarray, list[int]]:
        """The ids of a unit that starts a text, under a context token: remembered apart from
        the piece cache (a chat's is its BOS, the same in every request), up to
        :data:`LEAD_UNITS` short ones."""
        known = self._leads.get(unit)
        if known is None:
            [ids] = self._units_ids([unit], at_text_start=True)
            array, as_list = self._converted_ids(ids, as_list=True)
            assert as_list is not None
            known = (array, as_list)
            if len(unit) <= CHUNK_CHARS:  # (a long completions prompt is not kept)
                if len(self._leads) >= LEAD_UNITS:
                    self._leads.clear()
                self._leads[unit] = known
        return known

    def _by_words(self, units: list[str], missing: list[int], found: list[Any], *, arrays: bool) -> list[int]:
        """Tokenize the ``missing`` of ``units`` that the word splitter handles (but for an
        added token at their end) word by word, when they are few characters in all; fill
        ``found`` and the piece cache; return the indexes left for the library."""
        words = self._words
        if words is None or sum(len(units[index]) for index in missing) > WORD_SPLIT_MAX_CHARS:
            return missing
        left: list[int] = []
        handled: list[tuple[int, str, int | None]] = []
        for index in missing:
            split = self._text_and_final_token(units[index])
            if split is None:
                left.append(index)
            else:
                handled.append((index, *split))
        entries = []
        for (index, _, token), ids in zip(handled, words.ids_of([text for _, text, _ in handled]), strict=True):
            unit = units[index]
            array, as_list = self._converted_ids(ids, as_list=not arrays, final=token)
            self._word_texts += 1
            if self._word_texts % VERIFY_EVERY == 0 and not self._words_agree(unit, array.tolist()):
                return missing
            self._new_units["words_compiled" if isinstance(ids, np.ndarray) else "words"] += 1
            found[index] = array if arrays else as_list
            entries.append((unit, array, as_list))
        self._cache.put_many(entries)
        return left

    def _text_and_final_token(self, unit: str) -> tuple[str, int | None] | None:
        """``unit`` as its text and the id of the added token it ends with, if any; None for
        a unit the library must tokenize (text the word splitter does not handle, an added
        token elsewhere, or one that takes the whitespace before it: ``lstrip``)."""
        words = self._words
        if words is None or not words.handles(unit):  # (its text, shorter, is handled too)
            return None
        pattern = self._boundary_re
        match = pattern.search(unit) if pattern is not None else None
        if match is None:
            return unit, None
        token = match.group()
        if match.end() != len(unit) or token in self._non_boundaries or token in self._left_stripping:
            return None
        return unit[: match.start()], self._tokenizer.token_to_id(token)

    def _words_agree(self, unit: str, ids: list[int]) -> bool:
        """The periodic check: the library's ids for ``unit`` are ``ids``; else word-by-word
        tokenization stops for good (and says so), and the ids it cached are forgotten."""
        if self._encode_each([unit]) == [ids]:
            return True
        self._words = None
        self._cache.clear()
        self._memo.clear()
        log.error(
            "tokenizer %s: a text tokenized word by word differed from the library's; stopped doing it", self.name
        )
        return False

    def _units(self, piece: str) -> list[str]:
        """What ``piece`` is cached as: itself, or, when it is longer than the chunk size and
        cuts between words are exact, its chunks of about that size cut at such spaces.

        A chunk's end depends only on the text up to one character after it, so two texts
        that share a prefix are cut alike up to the chunk where they part."""
        if self._chunks_long_pieces and len(piece) > self._chunk_chars:
            return _cut_at_word_spaces(piece, self._chunk_chars)
        return [piece]

    def _converted_ids(
        self, ids: list[int] | np.ndarray, *, as_list: bool, final: int | None = None
    ) -> tuple[np.ndarray, list[int] | None]:
        """One unit's ids (and the ``final`` token after them, if any) as the cache keeps
        them: a read-only array (a copy), and the list form.

        Converted unit by unit: converting a 1M-token text's ids in one call holds the GIL
        for ~70 ms; a few thousand short calls let other threads in between.
        """
        if final is None:
            array = frozen_ids(ids)
        elif isinstance(ids, list):
            array = frozen_ids([*ids, final])
        else:  # (one copy: np.append and then a frozen copy were two)
            array = np.empty(len(ids) + 1, dtype=np.int64)
            array[:-1] = ids
            array[-1] = final
            array.flags.writeable = False
        return array, self._canonical_list(array) if as_list else None

    def _canonical_list(self, ids: np.ndarray) -> list[int]:
        """``ids`` as a list of the vocabulary's shared int objects (what the cache keeps)."""
        return list(map(self._canonical_id, ids.tolist()))
