"""A strict, sans-IO HTTP/1.1 request-head parser for smgd's fast path, and response heads.

Nearly every request a gateway serves is the same shape: ``GET`` or ``POST``, HTTP/1.1, a
``Host``, a handful of ordinary headers and a ``Content-Length`` body of JSON. For those,
h11 and hypercorn's stream machinery cost more than the rest of the request's handling
(docs/performance.md): h11 validates the request head and then the response's headers four
times over (building the ``Response``, ``set_comma_header`` for ``Content-Length`` and for
``Transfer-Encoding``, and the cleaned-up copy). :func:`parse_head` reads exactly that common
shape with two regular expressions; *anything else* is :data:`UNSUPPORTED` and goes to h11,
unchanged: other methods, HTTP/1.0, ``Transfer-Encoding``, ``Expect``, ``Upgrade``,
``Connection`` other than ``keep-alive`` or ``close``, a repeated or malformed
``Content-Length``, a missing ``Host``, obsolete line folding, a bare ``LF``, a head over the
size limit, any byte the grammar does not allow. So a request h11 would refuse (or frame
differently) is never read here: h11 refuses it as before, with smgd's error envelope
(:class:`smgd.api.http.worker_loop.H11Protocol`).

The grammar is RFC 9112's, narrowed: ``method SP request-target SP "HTTP/1.1" CRLF``, then
``field-name ":" OWS field-value OWS CRLF`` lines (a field value is visible ASCII, obs-text,
spaces and tabs), then ``CRLF``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

__all__ = [
    "FAST_METHODS",
    "NEED_DATA",
    "UNSUPPORTED",
    "Head",
    "parse_head",
    "response_head",
]

# The methods the fast path serves; every other one (HEAD's bodiless answers, OPTIONS,
# CONNECT, ...) is h11's.
FAST_METHODS: Final = frozenset((b"GET", b"POST"))

NEED_DATA: Final = "need_data"  # the head is not complete yet
UNSUPPORTED: Final = "unsupported"  # not the common shape: h11 reads it

_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_REQUEST_LINE = re.compile(rb"(" + _TOKEN + rb") ([\x21-\x7e]+) HTTP/1\.1\r\n")
# OWS around the value is not part of it; the value's own inner spaces and tabs are.
_VCHAR = rb"[\x21-\x7e\x80-\xff]"  # visible ASCII and obs-text
_FIELD = re.compile(
    rb"(" + _TOKEN + rb"):[ \t]*((?:" + _VCHAR + rb"(?:[ \t]*" + _VCHAR + rb")*)?)[ \t]*\r\n"
)
_DIGITS = re.compile(rb"[0-9]{1,18}")  # 18 digits: any body a client can send, no bignums

# RFC 9110's reason phrases for the statuses smgd answers with. A table of its own, not
# http.HTTPStatus: Python 3.13 renamed some (413 "Request Entity Too Large" became "Content
# Too Large"), and the bytes on the wire should not depend on the interpreter. Any other
# status gets an empty phrase, which RFC 9112 allows and clients ignore.
_REASONS: Final = {
    200: b"OK",
    201: b"Created",
    204: b"No Content",
    400: b"Bad Request",
    401: b"Unauthorized",
    403: b"Forbidden",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    409: b"Conflict",
    413: b"Content Too Large",
    415: b"Unsupported Media Type",
    422: b"Unprocessable Content",
    429: b"Too Many Requests",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    501: b"Not Implemented",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
}

# Header names that take a request off the fast path (see the module doc).
_H11_ONLY: Final = frozenset((b"transfer-encoding", b"expect", b"upgrade", b"te"))


@dataclass(frozen=True, slots=True)
class Head:
    """A request head read by :func:`parse_head`.

    ``headers``: (lower-case name, value) pairs in order, as ASGI wants them.
    ``length``: the body's Content-Length (0 without one). ``size``: the head's bytes.
    ``close``: the client asked for the connection to end with the response
    (``Connection: close``).
    """

    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]
    length: int
    size: int
    close: bool = False


def parse_head(buf: bytes | bytearray, max_size: int) -> Head | str:
    """The request head at the start of ``buf``: a :class:`Head`, :data:`NEED_DATA` or
    :data:`UNSUPPORTED`. ``max_size``: the most bytes a head may take (beyond it, h11 answers
    431)."""
    end = buf.find(b"\r\n\r\n", 0, max_size)
    if end < 0:
        # A bare LF anywhere would keep us waiting for a CRLF CRLF that h11 does not need.
        if len(buf) >= max_size or b"\n\n" in buf or b"\n\r\n" in buf:
            return UNSUPPORTED
        return NEED_DATA
    line = _REQUEST_LINE.match(buf)
    if line is None or line[1] not in FAST_METHODS:
        return UNSUPPORTED
    stop = end + 2  # the last field line's CRLF
    pos = line.end()
    headers: list[tuple[bytes, bytes]] = []
    host = False
    close = False
    length: bytes | None = None
    while pos < stop:
        field = _FIELD.match(buf, pos, stop)
        if field is None:
            return UNSUPPORTED
        name = field[1].lower()
        value = field[2]
        if name in _H11_ONLY:
            return UNSUPPORTED
        if name == b"content-length":
            if length is not None or _DIGITS.fullmatch(value) is None:
                return UNSUPPORTED
            length = value
        elif name == b"host":
            if host:
                return UNSUPPORTED
            host = True
        elif name == b"connection":
            token = value.lower()
            if token == b"close":
                close = True
            elif token != b"keep-alive":
                return UNSUPPORTED
        headers.append((name, value))
        pos = field.end()
    if not host:  # HTTP/1.1 requires one; h11 answers 400
        return UNSUPPORTED
    return Head(
        method=line[1],
        target=line[2],
        headers=headers,
        length=int(length) if length is not None else 0,
        size=end + 4,
        close=close,
    )


def response_head(
    status: int, headers: list[tuple[bytes, bytes]], extra: list[tuple[bytes, bytes]]
) -> tuple[bytes, bool]:
    """A response's status line and header block, and whether its body is chunked.

    ``headers`` come from the app (lower-case names, as ASGI gives them), ``extra`` from the
    server (``date``, ``server``). Without a ``content-length`` the body is chunked; a
    ``transfer-encoding`` of the app's own is replaced, as h11 does.
    """
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))]
    chunked = True
    for name, value in headers:
        if name == b"content-length":
            chunked = False
        elif name == b"transfer-encoding":
            continue
        lines.append(b"%s: %s\r\n" % (name, value))
    lines.extend(b"%s: %s\r\n" % pair for pair in extra)
    if chunked:
        lines.append(b"transfer-encoding: chunked\r\n")
    lines.append(b"\r\n")
    return b"".join(lines), chunked
