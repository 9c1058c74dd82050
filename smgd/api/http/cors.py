"""CORS: which browser pages may call the public API (``[server] cors_*``), as headers.

A page served from another origin (a chat UI on ``https://ui.example`` calling smgd on
``https://llm.example``) may only read smgd's answers when they name its origin in
``Access-Control-Allow-Origin``. A request with ``Authorization`` or a JSON ``Content-Type``
is not "simple" (Fetch standard), so the browser first sends a *preflight*: ``OPTIONS`` with
``Origin`` and ``Access-Control-Request-Method`` (and ``-Headers``), and no credentials.

:class:`CorsPolicy` computes both answers, sans-IO; the dispatcher
(:mod:`smgd.api.http.dispatch`) applies them:

- a preflight from an allowed origin, to a path a route serves, is answered ``204`` before the
  API key check (a browser never sends ``Authorization`` on one) with the methods, the
  request headers it may send, and :data:`MAX_AGE_S`;
- every other response to an allowed origin, errors and SSE streams included, carries
  ``Access-Control-Allow-Origin`` and exposes ``X-Request-Id`` and ``Retry-After``;
- an origin not allowed gets no CORS header: its browser refuses the answer to the page (the
  request itself is served as it would be without CORS: CORS protects the browser's user,
  it is not access control; API keys are);
- off (no origins configured) the dispatcher holds no policy and does no CORS work at all.

The policy is rebuilt on reload and swapped whole (:func:`smgd.api.http.app.create_app`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

    from smgd.config import ServerConfig

__all__ = ["EXPOSED", "MAX_AGE_S", "CorsPolicy"]

# How long a browser may reuse a preflight's answer: Chromium's cap (7200 s; Firefox's is a
# day). Each reuse saves a round trip before a request. A longer cache cannot leak access
# after a reload removes an origin: the actual response must still name the origin, and no
# longer does.
MAX_AGE_S = 7200
# Response headers a page's script may read besides the CORS-safelisted ones: the request id
# (to quote in a bug report) and the wait a 429/503 asks for.
EXPOSED = "X-Request-Id, Retry-After"
# A preflight's answer may differ by these request headers: caches must key on them.
_PREFLIGHT_VARY = "Origin, Access-Control-Request-Method, Access-Control-Request-Headers"


class CorsPolicy:
    """The ``[server] cors_*`` keys as response headers."""

    __slots__ = ("_any_origin", "_credentials", "_headers", "_methods", "_origins", "_vary")

    def __init__(self, server: ServerConfig) -> None:
        self._origins = frozenset(server.cors_allowed_origins)
        self._credentials = server.cors_allow_credentials
        # The config refuses credentials with "*" (a browser would refuse the answer anyway).
        self._any_origin = "*" in self._origins and not self._credentials
        methods = server.cors_allowed_methods
        headers = server.cors_allowed_headers
        self._methods = None if "*" in methods else ", ".join(m.upper() for m in methods)
        self._headers = None if "*" in headers else ", ".join(headers)
        # With a list of origins the answer depends on the request's Origin, whether or not
        # it has one: a cache must not hand one origin's answer to another.
        self._vary = not self._any_origin

    @classmethod
    def from_config(cls, server: ServerConfig) -> CorsPolicy | None:
        """The policy, or None when CORS is off (no allowed origin)."""
        return cls(server) if server.cors_allowed_origins else None

    def _allow_origin(self, origin: str | None) -> str | None:
        if origin is None:
            return None
        if self._any_origin:
            return "*"
        return origin if origin in self._origins else None

    def response_headers(self, origin: str | None) -> Mapping[str, str]:
        """Headers for an actual (non-preflight) response to a request from ``origin``."""
        allowed = self._allow_origin(origin)
        if allowed is None:
            return {"Vary": "Origin"} if self._vary else {}
        headers = {"Access-Control-Allow-Origin": allowed, "Access-Control-Expose-Headers": EXPOSED}
        if self._credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        if self._vary:
            headers["Vary"] = "Origin"
        return headers

    def preflight_headers(
        self, origin: str, route_methods: str, request_headers: str | None
    ) -> Mapping[str, str] | None:
        """A preflight's answer headers; None when ``origin`` is not allowed.

        ``route_methods``: what the path serves (its ``Allow``), the answer when any method is
        allowed. ``request_headers``: the preflight's ``Access-Control-Request-Headers``,
        echoed when any header is allowed (a literal ``*`` would not cover ``Authorization``,
        and means nothing at all to a browser on a credentialed request).
        """
        allowed = self._allow_origin(origin)
        if allowed is None:
            return None
        headers = {
            "Access-Control-Allow-Origin": allowed,
            "Access-Control-Allow-Methods": self._methods or route_methods,
            "Access-Control-Max-Age": str(MAX_AGE_S),
            "Vary": _PREFLIGHT_VARY,
        }
        allow_headers = self._headers if self._headers is not None else request_headers
        if allow_headers:
            headers["Access-Control-Allow-Headers"] = allow_headers
        if self._credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        return headers
