"""How the router reaches one backend: where, as whom, and over which TLS settings.

Built once per backend from its :class:`~kvroute.router.config.BackendConfig` (and the router-wide
defaults), then read by every call to that backend: the proxied requests
(:attr:`BackendAccess.origin` for the lean upstream client, :meth:`~BackendAccess.proxy_credential`
and :meth:`~BackendAccess.proxy_headers` for the proxy) and the router's own calls --
``/health``, ``/v1/models``, ``/metrics`` -- which get :attr:`~BackendAccess.probe_headers` and
:attr:`~BackendAccess.aiohttp_ssl`.

The credential (``api_key`` as ``Bearer``, or URL userinfo as ``Basic``) always goes with
the router's own calls. On proxied requests it follows ``api_key_on_proxy``: ``if_absent``
(default) sends it only when the client sent no ``Authorization`` of its own, ``always``
replaces the client's, ``never`` keeps it for the router's calls only. The default is
``always`` where the client's ``Authorization`` cannot be meant for this hop: credentials
written in the URL (a gateway's Basic login), a router that checks clients' keys itself
(``--api-keys``: the client's header holds the router's key), or the router-wide
``--backend-api-key`` (documented as "instead of the client's").
"""

from __future__ import annotations

import functools
import logging
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvroute.router.backend_url import Origin, basic_authorization, parse_backend_url
from kvroute.router.config import BackendConfig, ProxyCredential

log = logging.getLogger("kvroute.backends")

RawHeader = tuple[bytes, bytes]

#: The header that sends a request to one data-parallel rank of a vLLM engine.
DATA_PARALLEL_RANK_HEADER = "X-data-parallel-rank"


@functools.cache
def tls_context(ca_file: Path | None = None, verify: bool = True) -> ssl.SSLContext:
    """One client TLS context per distinct setting (loading CA certificates costs milliseconds)."""
    context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


@dataclass(frozen=True, slots=True)
class BackendAccess:
    """See the module docstring. Build with :meth:`build` (or :meth:`for_url`)."""

    #: The backend's identity: ``scheme://host:port/prefix``, never with credentials
    #: (``#dp<rank>`` after it for a data-parallel rank).
    url: str
    #: Where the router's own calls go (``/health``, ``/metrics``...): the URL without the rank.
    base_url: str
    #: The data-parallel rank of the engine at ``base_url`` that this backend is (None: all of it).
    rank: int | None
    origin: Origin
    #: The full ``Authorization`` value for this backend, or None.
    authorization: str | None
    api_key_on_proxy: ProxyCredential
    #: TLS context for an https backend (None: plain http).
    ssl_context: ssl.SSLContext | None
    #: Headers for the router's own calls (extra headers and the credential).
    probe_headers: dict[str, str] | None
    #: Lower-case names of the extra headers: the client's headers of these names are not forwarded.
    header_names: frozenset[bytes]
    _extra: tuple[RawHeader, ...] = field(repr=False)
    _extra_with_credential: tuple[RawHeader, ...] = field(repr=False)

    @classmethod
    def build(
        cls, config: BackendConfig, *, default_api_key: str | None = None, client_keys_checked: bool = False
    ) -> BackendAccess:
        """The access to a configured backend; ``default_api_key`` is ``--backend-api-key``,
        ``client_keys_checked`` whether the router itself checks clients' keys (``--api-keys``)."""
        parsed = parse_backend_url(config.url)
        authorization = None
        if config.username is not None:
            authorization = basic_authorization(config.username, config.password)
        api_key = config.api_key or (None if authorization else default_api_key)
        if api_key:
            authorization = f"Bearer {api_key}"
        mode = config.api_key_on_proxy
        if mode is None:
            # A gateway's own credentials (user:password), a client's key that was the
            # router's, or the router-wide key "instead of the client's": the client's
            # Authorization cannot be meant for this hop.
            replaces = (
                client_keys_checked
                or config.username is not None
                or (api_key is not None and api_key != config.api_key)
            )
            mode = "always" if replaces else "if_absent"
        context = None
        if parsed.tls:
            context = tls_context(config.ca_file, config.verify)
            if not config.verify:
                log.warning(
                    "backend %s: TLS certificate verification is OFF (verify: false); anyone on the path "
                    "can read and alter this engine's traffic, credentials included",
                    parsed.base,
                )
        headers = dict(config.headers)
        if config.data_parallel_rank is not None:
            # vLLM's API server hands the request to that rank's engine (not to its own balancer).
            headers[DATA_PARALLEL_RANK_HEADER] = str(config.data_parallel_rank)
        extra = tuple((name.encode("latin-1"), value.encode("latin-1")) for name, value in headers.items())
        credential = ((b"Authorization", authorization.encode("latin-1")),) if authorization else ()
        probe = dict(config.headers)
        if authorization:
            probe["Authorization"] = authorization
        return cls(
            url=config.name,
            base_url=parsed.base,
            rank=config.data_parallel_rank,
            origin=Origin(parsed.base, ssl_context=context),
            authorization=authorization,
            api_key_on_proxy=mode,
            ssl_context=context,
            probe_headers=probe or None,
            header_names=frozenset(name.lower() for name, _ in extra),
            _extra=extra,
            _extra_with_credential=extra + credential,
        )

    @classmethod
    def for_url(cls, url: str, api_key: str | None = None) -> BackendAccess:
        """The access to a bare URL (credentials in it included)."""
        return cls.build(BackendConfig(url=url, api_key=api_key))

    @property
    def aiohttp_ssl(self) -> ssl.SSLContext | bool:
        """aiohttp's ``ssl=`` for the router's own calls (True: its default verification)."""
        return self.ssl_context if self.ssl_context is not None else True

    def proxy_credential(self, client_headers: Mapping[str, str]) -> bool:
        """Whether a proxied request with these client headers carries the backend's
        credential (and so loses the client's ``Authorization``)."""
        if self.authorization is None or self.api_key_on_proxy == "never":
            return False
        return self.api_key_on_proxy == "always" or "Authorization" not in client_headers

    def proxy_headers(self, with_credential: bool) -> tuple[RawHeader, ...]:
        """The headers the router adds to a proxied request."""
        return self._extra_with_credential if with_credential else self._extra
