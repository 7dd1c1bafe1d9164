"""A backend URL as the operator wrote it, split into what each call to that backend needs.

``http://user:pw@gw:8080/serving/llama`` means: connect to ``gw:8080``, send ``Host:
gw:8080`` (never the credentials), put ``/serving/llama`` in front of every path
(``/serving/llama/v1/chat/completions``, ``/serving/llama/health``, ...) and authenticate
with ``Authorization: Basic base64(user:pw)``. The backend's identity -- its key in the
pool, its metrics label, the ``x-kvroute-backend`` header -- is :attr:`BackendURL.base`,
which keeps the prefix and drops the credentials, so they never reach a client or a
dashboard. One parser serves the configuration (validation), the lean upstream client
(:class:`Origin`) and the probes.

One rank of a data-parallel vLLM engine (``--data-parallel-size N`` behind one API server)
is its own backend: same URL, its own cache. Its name is the URL with ``#dp<rank>``
(:func:`rank_name`); requests reach the rank by vLLM's ``X-data-parallel-rank`` header.
"""

from __future__ import annotations

import base64
import ssl
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

# RFC 3986 path characters, plus "%" so that a prefix written percent-encoded stays as written.
_PATH_SAFE = "/%:@!$&'()*+,;=-._~"


@dataclass(frozen=True, slots=True)
class BackendURL:
    """The parts of one backend URL; see the module docstring."""

    scheme: str
    #: Host name or address to connect to (IPv6 without brackets).
    host: str
    port: int
    #: ``host[:port]`` as written, without userinfo: the ``Host`` header.
    authority: str
    #: The path every call is sent under: ``""`` or ``"/serving/llama"`` (no trailing slash).
    prefix: str
    username: str | None = None
    password: str | None = None

    @property
    def tls(self) -> bool:
        return self.scheme == "https"

    @property
    def base(self) -> str:
        """``scheme://authority/prefix``: the backend's identity, free of credentials."""
        return f"{self.scheme}://{self.authority}{self.prefix}"


#: What a data-parallel rank's name adds to its engine's URL (a fragment: never sent anywhere).
RANK_MARK = "#dp"


def rank_name(base: str, rank: int | None) -> str:
    """The name of a backend: ``base``, or for one data-parallel rank ``base#dp<rank>``."""
    return base if rank is None else f"{base}{RANK_MARK}{rank}"


def split_rank_name(name: str) -> tuple[str, int | None]:
    """A backend's name as its engine's URL and its data-parallel rank (None: not a rank)."""
    base, mark, rank = name.rpartition(RANK_MARK)
    if mark and rank.isdigit():
        return base, int(rank)
    return name, None


def rank_names(base: str, ranks: int) -> list[str]:
    """The backends an engine of ``ranks`` data-parallel ranks is: itself, or each rank."""
    return [base] if ranks == 1 else [rank_name(base, rank) for rank in range(ranks)]


def endpoint_with_port(endpoint: str, port: int) -> str:
    """The same host as a ``tcp://host:port`` endpoint, another port."""
    head, _, _ = endpoint.rpartition(":")
    return f"{head}:{port}"


def offset_endpoint_port(endpoint: str, offset: int) -> str:
    """A ``tcp://host:port`` endpoint with its port moved by ``offset``: where data-parallel
    rank ``offset`` of a vLLM engine publishes the KV events configured at ``endpoint``."""
    port = endpoint.rpartition(":")[2]
    if ":" not in endpoint or not port.isdigit():
        raise ValueError(f"expected an endpoint ending in :PORT, got {endpoint!r}")
    return endpoint_with_port(endpoint, int(port) + offset)


def basic_authorization(username: str, password: str | None) -> str:
    """``Authorization: Basic`` value for a user and password (RFC 7617, UTF-8)."""
    pair = f"{username}:{password or ''}".encode()
    return "Basic " + base64.b64encode(pair).decode("ascii")


def parse_backend_url(url: str) -> BackendURL:
    """Split ``url``; raises ValueError naming what is wrong with it."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"backend URL must start with http:// or https://, got {_shown(url)!r}")
    if not parts.hostname:
        raise ValueError(f"backend URL has no host: {_shown(url)!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"backend URL must not have a query or fragment: {_shown(url)!r}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"backend URL has an invalid port: {_shown(url)!r}") from None
    tls = parts.scheme == "https"
    userinfo, at, authority = parts.netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user)
        password = unquote(secret) if colon else None
    return BackendURL(
        scheme=parts.scheme,
        host=parts.hostname,
        port=port or (443 if tls else 80),
        authority=authority,
        prefix=quote(parts.path.rstrip("/"), safe=_PATH_SAFE),
        username=username,
        password=password,
    )


def _shown(url: str) -> str:
    """``url`` without its userinfo, for error messages."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, path = rest.partition("/")
    return scheme + sep + netloc.rpartition("@")[2] + slash + path


class Origin:
    """Where one backend listens: address, TLS, the precomputed ``Host`` header (never with
    the URL's userinfo) and the path prefix every request goes under (the URL as written)."""

    __slots__ = ("host", "host_header", "key", "port", "prefix", "ssl", "ssl_context")

    def __init__(self, url: str, ssl_context: ssl.SSLContext | None = None) -> None:
        parsed = parse_backend_url(url)
        self.key = parsed.base
        self.host = parsed.host
        self.ssl = parsed.tls
        self.ssl_context = ssl_context
        self.port = parsed.port
        authority = parsed.authority
        self.host_header = authority.encode("idna" if not authority.isascii() else "ascii")
        self.prefix = parsed.prefix.encode("ascii")
