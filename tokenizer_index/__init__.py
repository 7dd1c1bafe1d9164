"""Request -> token ids, block hashing, and the approximate prefix index.

Pure and synchronous: no asyncio, no HTTP. Importable alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvroute.tokenizer_index.prefix_index import PrefixIndex
    from kvroute.tokenizer_index.tokenizer import RequestTokenizer

__all__ = ["PrefixIndex", "RequestTokenizer"]


def __getattr__(name: str) -> Any:
    # Lazy so that importing the index does not load the tokenizer library, and vice versa.
    if name == "PrefixIndex":
        from kvroute.tokenizer_index.prefix_index import PrefixIndex

        return PrefixIndex
    if name == "RequestTokenizer":
        from kvroute.tokenizer_index.tokenizer import RequestTokenizer

        return RequestTokenizer
    raise AttributeError(f"module 'tokenizer_index' has no attribute {name!r}")
