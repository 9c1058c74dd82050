"""smgd.api.http.h1, sans-IO: the fast path's request-head parser and its response heads.

h11 is the oracle: every head :func:`parse_head` reads must read the same through h11, and
every response head :func:`response_head` builds must be a response h11 accepts.
"""

from __future__ import annotations

import h11
import pytest

from smgd.api.http.h1 import NEED_DATA, UNSUPPORTED, Head, parse_head, response_head

MAX = 16 * 1024

COMMON = (
    b"POST /v1/chat/completions?x=1 HTTP/1.1\r\n"
    b"Host: example.com:8080\r\n"
    b"User-Agent: OpenAI/Python 1.40.0\r\n"
    b"Content-Type: application/json\r\n"
    b"Authorization: Bearer sk-abc\r\n"
    b"Connection: keep-alive\r\n"
    b"Content-Length: 42\r\n"
    b"\r\n"
)


def _head(data: bytes | bytearray, max_size: int = MAX) -> Head:
    head = parse_head(data, max_size)
    assert isinstance(head, Head), head
    return head


# --------------------------------------------------------------------------- parse_head


def test_the_common_request_is_read_whole() -> None:
    body = b"x" * 42
    head = _head(COMMON + body)
    assert head.method == b"POST"
    assert head.target == b"/v1/chat/completions?x=1"
    assert head.headers == [
        (b"host", b"example.com:8080"),
        (b"user-agent", b"OpenAI/Python 1.40.0"),
        (b"content-type", b"application/json"),
        (b"authorization", b"Bearer sk-abc"),
        (b"connection", b"keep-alive"),
        (b"content-length", b"42"),
    ]
    assert head.length == 42
    assert head.size == len(COMMON)  # the body (and what follows) is not the head's


def test_a_bytearray_buffer_reads_the_same() -> None:
    assert _head(bytearray(COMMON)) == _head(COMMON)


def test_a_bodiless_get_has_length_zero() -> None:
    data = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    head = _head(data + b"GET /next HTTP/1.1\r\n")  # a pipelined request's start follows
    assert (head.method, head.target, head.length, head.size) == (b"GET", b"/health", 0, len(data))
    assert head.headers == [(b"host", b"x")]


@pytest.mark.parametrize(
    "full",
    [COMMON, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n", b"GET / HTTP/1.1\r\nhost:\r\na: b \t \r\n\r\n"],
    ids=["common", "get", "empty-and-padded-values"],
)
def test_every_prefix_of_a_valid_head_needs_more_data(full: bytes) -> None:
    assert isinstance(parse_head(full, MAX), Head)
    for end in range(len(full)):
        assert parse_head(full[:end], MAX) == NEED_DATA, full[:end]


UNSUPPORTED_HEADS = [
    ("transfer-encoding", b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"),
    (
        "transfer-encoding-and-length",
        b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
    ),
    ("expect", b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\nexpect: 100-continue\r\n\r\n"),
    ("upgrade", b"GET / HTTP/1.1\r\nhost: x\r\nconnection: keep-alive\r\nupgrade: h2c\r\n\r\n"),
    ("te", b"GET / HTTP/1.1\r\nhost: x\r\nTE: trailers\r\n\r\n"),
    ("connection-upgrade", b"GET / HTTP/1.1\r\nhost: x\r\nconnection: Upgrade\r\n\r\n"),
    ("connection-list", b"GET / HTTP/1.1\r\nhost: x\r\nconnection: keep-alive, te\r\n\r\n"),
    (
        "duplicate-content-length",
        b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\ncontent-length: 3\r\n\r\n",
    ),
    ("content-length-list", b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 3, 3\r\n\r\n"),
    ("content-length-sign", b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: +3\r\n\r\n"),
    ("content-length-negative", b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: -1\r\n\r\n"),
    ("content-length-hex", b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 0x10\r\n\r\n"),
    ("content-length-empty", b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length:\r\n\r\n"),
    ("content-length-inner-space", b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1 2\r\n\r\n"),
    (
        "content-length-19-digits",
        b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000000000000000\r\n\r\n",
    ),
    (
        "content-length-19-digits-leading-zero",
        b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 0000000000000000001\r\n\r\n",
    ),
    ("duplicate-host", b"GET / HTTP/1.1\r\nhost: x\r\nHost: y\r\n\r\n"),
    ("missing-host", b"GET / HTTP/1.1\r\naccept: */*\r\n\r\n"),
    ("no-headers", b"GET / HTTP/1.1\r\n\r\n"),
    ("obs-fold", b"GET / HTTP/1.1\r\nhost: x\r\nx-a: one\r\n two\r\n\r\n"),
    ("obs-fold-tab", b"GET / HTTP/1.1\r\nhost: x\r\nx-a: one\r\n\ttwo\r\n\r\n"),
    ("bare-lf-request-line", b"GET / HTTP/1.1\nhost: x\r\n\r\n"),
    ("bare-lf-field", b"GET / HTTP/1.1\r\nhost: x\nx-a: b\r\n\r\n"),
    ("bare-lf-end", b"GET / HTTP/1.1\r\nhost: x\r\n\n"),
    ("bare-lf-only", b"GET / HTTP/1.1\nhost: x\n\n"),
    ("bare-lf-incomplete", b"GET / HTTP/1.1\nhost: x\n\nbody"),
    ("bare-cr-in-value", b"GET / HTTP/1.1\r\nhost: x\r\nx-a: b\rc\r\n\r\n"),
    ("nul-in-value", b"GET / HTTP/1.1\r\nhost: x\r\nx-a: b\x00c\r\n\r\n"),
    ("del-in-value", b"GET / HTTP/1.1\r\nhost: x\r\nx-a: b\x7fc\r\n\r\n"),
    ("control-in-value", b"GET / HTTP/1.1\r\nhost: x\r\nx-a: b\x01c\r\n\r\n"),
    ("space-before-colon", b"GET / HTTP/1.1\r\nhost: x\r\nx-a : b\r\n\r\n"),
    ("empty-name", b"GET / HTTP/1.1\r\nhost: x\r\n: b\r\n\r\n"),
    ("no-colon", b"GET / HTTP/1.1\r\nhost: x\r\nx-a\r\n\r\n"),
    ("bad-name-byte", b"GET / HTTP/1.1\r\nhost: x\r\nx(a): b\r\n\r\n"),
    ("non-ascii-name", b"GET / HTTP/1.1\r\nhost: x\r\nx\xe9: b\r\n\r\n"),
    ("leading-space-line", b"GET / HTTP/1.1\r\n host: x\r\n\r\n"),
    ("leading-crlf", b"\r\nGET / HTTP/1.1\r\nhost: x\r\n\r\n"),
    ("head", b"HEAD / HTTP/1.1\r\nhost: x\r\n\r\n"),
    ("put", b"PUT / HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"),
    ("options", b"OPTIONS * HTTP/1.1\r\nhost: x\r\n\r\n"),
    ("delete", b"DELETE /v1/files/1 HTTP/1.1\r\nhost: x\r\n\r\n"),
    ("connect", b"CONNECT x:443 HTTP/1.1\r\nhost: x:443\r\n\r\n"),
    ("lower-case-method", b"get / HTTP/1.1\r\nhost: x\r\n\r\n"),
    ("http-1.0", b"GET / HTTP/1.0\r\nhost: x\r\n\r\n"),
    ("http-1.0-no-host", b"GET / HTTP/1.0\r\n\r\n"),
    ("http-2.0", b"GET / HTTP/2.0\r\nhost: x\r\n\r\n"),
    ("http-lower-case", b"GET / http/1.1\r\nhost: x\r\n\r\n"),
    ("http-0.9", b"GET /\r\n\r\n"),
    ("double-space", b"GET  / HTTP/1.1\r\nhost: x\r\n\r\n"),
    ("tab-separator", b"GET\t/ HTTP/1.1\r\nhost: x\r\n\r\n"),
    ("trailing-space-request-line", b"GET / HTTP/1.1 \r\nhost: x\r\n\r\n"),
    ("space-in-target", b"GET /a b HTTP/1.1\r\nhost: x\r\n\r\n"),
    ("non-ascii-target", b"GET /\xe9 HTTP/1.1\r\nhost: x\r\n\r\n"),
    ("nul-in-target", b"GET /\x00 HTTP/1.1\r\nhost: x\r\n\r\n"),
    ("tls-client-hello", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n"),
    ("h2-preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
    ("garbage", b"hello\r\n\r\n"),
]


@pytest.mark.parametrize(
    "data", [data for _, data in UNSUPPORTED_HEADS], ids=[name for name, _ in UNSUPPORTED_HEADS]
)
def test_anything_but_the_common_shape_is_left_to_h11(data: bytes) -> None:
    assert parse_head(data, MAX) == UNSUPPORTED
    # and still with more bytes behind it (a body, a pipelined request)
    assert parse_head(data + b"GET / HTTP/1.1\r\nhost: x\r\n\r\n", MAX) == UNSUPPORTED


@pytest.mark.parametrize("name", [b"Transfer-Encoding", b"EXPECT", b"Upgrade", b"te"])
def test_h11_only_header_names_are_matched_in_any_case(name: bytes) -> None:
    data = b"GET / HTTP/1.1\r\nhost: x\r\n%s: whatever\r\n\r\n" % name
    assert parse_head(data, MAX) == UNSUPPORTED


@pytest.mark.parametrize("value", [b"keep-alive", b"Keep-Alive", b"KEEP-ALIVE"])
def test_connection_keep_alive_in_any_case_is_common(value: bytes) -> None:
    head = _head(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: %s\r\n\r\n" % value)
    assert (b"connection", value) in head.headers
    assert not head.close


@pytest.mark.parametrize(
    "fields",
    [
        [b"connection: close"],
        [b"Connection: CLOSE"],
        [b"connection: keep-alive", b"connection: close"],  # close wins, as in h11
    ],
)
def test_connection_close_is_common_and_noted(fields: list[bytes]) -> None:
    head = _head(b"GET / HTTP/1.1\r\nhost: x\r\n%s\r\n\r\n" % b"\r\n".join(fields))
    assert head.close
    assert head.headers[-1][1].lower() == fields[-1].split(b": ")[1].lower()


def test_a_head_over_max_size_is_h11s_without_waiting_for_its_end() -> None:
    # no CRLF CRLF yet, but already max_size bytes: h11 answers 431
    data = b"GET / HTTP/1.1\r\nhost: x\r\nx-a: " + b"a" * 200
    assert parse_head(data[:99], 100) == NEED_DATA
    assert parse_head(data[:100], 100) == UNSUPPORTED
    assert parse_head(data, 100) == UNSUPPORTED


def test_a_head_exactly_at_max_size_is_read_and_one_byte_more_is_not() -> None:
    base = b"GET / HTTP/1.1\r\nhost: x\r\nx-pad: \r\n\r\n"
    size = 300
    exact = base.replace(b"x-pad: ", b"x-pad: " + b"p" * (size - len(base)))
    assert len(exact) == size
    head = _head(exact + b"body", size)
    assert head.size == size
    assert head.headers[-1] == (b"x-pad", b"p" * (size - len(base)))
    over = exact.replace(b"x-pad: ", b"x-pad: p")
    assert parse_head(over, size) == UNSUPPORTED
    assert parse_head(over, size + 1) != UNSUPPORTED


def test_value_whitespace_around_is_trimmed_and_inside_kept() -> None:
    head = _head(
        b"GET / HTTP/1.1\r\nhost:x\r\nx-a: \t one  two\tthree \t \r\nx-b:\t\r\nx-c:   \r\n\r\n"
    )
    assert head.headers == [
        (b"host", b"x"),
        (b"x-a", b"one  two\tthree"),
        (b"x-b", b""),
        (b"x-c", b""),
    ]


def test_obs_text_is_allowed_in_values() -> None:
    value = bytes(range(0x80, 0x100))
    head = _head(b"GET / HTTP/1.1\r\nhost: x\r\nx-a: caf\xc3\xa9 " + value + b"\r\n\r\n")
    assert head.headers[1] == (b"x-a", b"caf\xc3\xa9 " + value)


@pytest.mark.parametrize(
    ("value", "length"),
    [(b"0", 0), (b"007", 7), (b"999999999999999999", 999_999_999_999_999_999)],
    ids=["zero", "leading-zeros", "18-digits"],
)
def test_content_length_up_to_18_digits(value: bytes, length: int) -> None:
    head = _head(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %s\r\n\r\n" % value)
    assert head.length == length


def test_content_length_with_ows_is_read() -> None:
    head = _head(b"POST / HTTP/1.1\r\nhost: x\r\nContent-Length: \t 12 \r\n\r\n")
    assert head.length == 12
    assert (b"content-length", b"12") in head.headers


# --------------------------------------------------------------------------- h11 as the oracle

VALID_HEADS = [
    COMMON,
    b"GET / HTTP/1.1\r\nhost: x\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\nAccept-Encoding: gzip\r\n\r\n",
    b"GET * HTTP/1.1\r\nhost: x\r\n\r\n",
    b"GET http://example.com/v1/models?a=b&c=%20d HTTP/1.1\r\nHost: example.com\r\n\r\n",
    b"GET /%7Euser/a%2Fb;p=1?q=%E2%82%AC#frag HTTP/1.1\r\nhost: x\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nContent-Length: 0\r\nHost: x\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 0000123\r\n\r\n",
    b"POST / HTTP/1.1\r\nhost: [::1]:8080\r\ncontent-length:5\r\nx-empty:\r\nx-pad: \t\r\n\r\n",
    b"POST / HTTP/1.1\r\nhost: x\r\nX-A: 1\r\nx-a: 2\r\nX-a: 3\r\ncontent-length: 1\r\n\r\n",
    b"GET / HTTP/1.1\r\nhost: x\r\nx-sp: a b  c\t\td \t\r\n"
    b"x-utf8: caf\xc3\xa9\r\nx-obs: \x80\xff\r\n\r\n",
    b"GET / HTTP/1.1\r\nhost: x\r\n!#$%&'*+-.^_`|~09AZaz: token-chars\r\n\r\n",
    b"GET / HTTP/1.1\r\nhost: x\r\nConnection: Keep-Alive\r\nKeep-Alive: timeout=5\r\n\r\n",
    b'GET / HTTP/1.1\r\nhost: x\r\nx-punct: "quoted", (comment); a=b, <>?/\\[]{}\r\n\r\n',
    b"GET /" + b"a" * 2000 + b" HTTP/1.1\r\nhost: x\r\nx-long: " + b"v" * 5000 + b"\r\n\r\n",
    b"GET / HTTP/1.1\r\nhost: x\r\n"
    + b"".join(b"x-h%d: %d\r\n" % (i, i) for i in range(100))
    + b"\r\n",
]


@pytest.mark.parametrize("data", VALID_HEADS, ids=[f"head-{i}" for i in range(len(VALID_HEADS))])
def test_a_head_read_here_reads_the_same_through_h11(data: bytes) -> None:
    head = _head(data)
    server = h11.Connection(h11.SERVER)
    server.receive_data(data)
    request = server.next_event()
    assert isinstance(request, h11.Request)
    assert request.method == head.method
    assert request.target == head.target
    assert request.http_version == b"1.1"
    assert list(request.headers) == head.headers
    lengths = [v for n, v in request.headers if n == b"content-length"]
    assert head.length == (int(lengths[0]) if lengths else 0)
    # h11 reads the same amount as the head: the body (Content-Length of it) is next
    body = server.next_event()
    if head.length:
        assert body is h11.NEED_DATA
    else:
        assert isinstance(body, h11.EndOfMessage)
    assert head.size == len(data)


@pytest.mark.parametrize("data", VALID_HEADS, ids=[f"head-{i}" for i in range(len(VALID_HEADS))])
def test_each_valid_head_loses_its_shape_when_one_byte_is_spoiled(data: bytes) -> None:
    # Whatever single byte of a valid head becomes a NUL, the result is not a head that h11
    # would read differently: either UNSUPPORTED, NEED_DATA, or what h11 reads too.
    for i in range(0, len(data), max(1, len(data) // 64)):
        spoiled = data[:i] + b"\x00" + data[i + 1 :]
        got = parse_head(spoiled, MAX)
        if not isinstance(got, Head):
            continue
        server = h11.Connection(h11.SERVER)
        server.receive_data(spoiled)
        request = server.next_event()
        assert isinstance(request, h11.Request), (i, spoiled)
        assert list(request.headers) == got.headers


# --------------------------------------------------------------------------- response_head


def _client_reads(data: bytes, method: str = "POST") -> list[h11.Event]:
    """``data`` as the response to a request, parsed by h11's client; its events to the end."""
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method=method, target="/", headers=[("host", "x")]))
    client.send(h11.EndOfMessage())
    client.receive_data(data)
    events: list[h11.Event] = []
    while True:
        event = client.next_event()
        assert event is not h11.NEED_DATA, events
        assert not isinstance(event, type), event
        events.append(event)
        if isinstance(event, h11.EndOfMessage):
            return events


def test_a_response_without_a_length_is_chunked() -> None:
    head, chunked = response_head(
        200,
        [(b"content-type", b"text/event-stream"), (b"x-request-id", b"abc")],
        [(b"date", b"Sat, 05 Dec 2026 00:00:00 GMT"), (b"server", b"smgd")],
    )
    assert chunked
    assert head == (
        b"HTTP/1.1 200 OK\r\n"
        b"content-type: text/event-stream\r\n"
        b"x-request-id: abc\r\n"
        b"date: Sat, 05 Dec 2026 00:00:00 GMT\r\n"
        b"server: smgd\r\n"
        b"transfer-encoding: chunked\r\n"
        b"\r\n"
    )
    events = _client_reads(head + b"5\r\nhello\r\n0\r\n\r\n")
    response = events[0]
    assert isinstance(response, h11.Response)
    assert (response.status_code, response.reason) == (200, b"OK")
    assert list(response.headers)[-1] == (b"transfer-encoding", b"chunked")
    assert [e.data for e in events if isinstance(e, h11.Data)] == [b"hello"]


def test_a_response_with_a_length_is_not_chunked() -> None:
    body = b'{"error":{}}'
    head, chunked = response_head(
        404,
        [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))],
        [(b"date", b"Thu, 01 Jan 1970 00:00:00 GMT")],
    )
    assert not chunked
    assert head.startswith(b"HTTP/1.1 404 Not Found\r\n")
    assert b"transfer-encoding" not in head
    events = _client_reads(head + body)
    response = events[0]
    assert isinstance(response, h11.Response)
    assert response.status_code == 404
    assert list(response.headers) == [
        (b"content-type", b"application/json"),
        (b"content-length", b"12"),
        (b"date", b"Thu, 01 Jan 1970 00:00:00 GMT"),
    ]
    assert b"".join(e.data for e in events if isinstance(e, h11.Data)) == body


@pytest.mark.parametrize("length", [True, False], ids=["with-length", "without-length"])
def test_the_apps_own_transfer_encoding_is_dropped(length: bool) -> None:
    headers = [(b"transfer-encoding", b"gzip, chunked"), (b"x-a", b"1")]
    if length:
        headers.append((b"content-length", b"2"))
    head, chunked = response_head(200, headers, [])
    assert chunked is not length
    assert b"gzip" not in head
    assert head.count(b"transfer-encoding") == (0 if length else 1)
    events = _client_reads(head + (b"ok" if length else b"2\r\nok\r\n0\r\n\r\n"))
    assert b"".join(e.data for e in events if isinstance(e, h11.Data)) == b"ok"


def test_extra_headers_come_after_the_apps() -> None:
    head, _ = response_head(
        200,
        [(b"content-length", b"0"), (b"x-app", b"1")],
        [(b"date", b"d"), (b"server", b"s"), (b"connection", b"close")],
    )
    names = [line.split(b":")[0] for line in head.split(b"\r\n")[1:-2]]
    assert names == [b"content-length", b"x-app", b"date", b"server", b"connection"]
    response = _client_reads(head)[0]
    assert isinstance(response, h11.Response)
    assert (b"connection", b"close") in list(response.headers)


@pytest.mark.parametrize(
    ("status", "line"),
    [
        (200, b"HTTP/1.1 200 OK\r\n"),
        (400, b"HTTP/1.1 400 Bad Request\r\n"),
        (413, b"HTTP/1.1 413 Content Too Large\r\n"),  # RFC 9110: the same on every Python
        (429, b"HTTP/1.1 429 Too Many Requests\r\n"),
        (503, b"HTTP/1.1 503 Service Unavailable\r\n"),
        (499, b"HTTP/1.1 499 \r\n"),  # no phrase known: an empty one, which h11 reads
    ],
)
def test_the_status_line_has_the_reason_phrase(status: int, line: bytes) -> None:
    head, _ = response_head(status, [(b"content-length", b"0")], [])
    assert head.startswith(line)
    response = _client_reads(head)[0]
    assert isinstance(response, h11.Response)
    assert response.status_code == status
    assert response.reason == line[13:-2]
