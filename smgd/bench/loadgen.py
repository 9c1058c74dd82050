"""The benchmark's load generator: C streaming completions in flight over raw HTTP/1.1.

Runs as its own process (``python -m smgd.bench.loadgen < spec.json``) so its CPU is never
counted as the server's, and prints one JSON summary on stdout. It is built to be cheap: C
keep-alive sockets multiplexed on one epoll in a plain loop (:class:`_Driver`; no event-loop
framework, no task per connection), a tiny chunked-transfer + SSE parser (:class:`SSEParser`,
sans-IO) and a typed msgspec decoder per event. Loopback only; bounded by a request count, a
duration (no new request starts after it) and a hard time limit (everything still open is
closed and counted as failed).
"""

from __future__ import annotations

import errno
import math
import os
import select
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from smgd.bench.stats import percentile, token_errors, tokens_in

if TYPE_CHECKING:
    from collections.abc import Callable

# Latencies go out in milliseconds rounded to 10 µs: finer digits are noise on this machine.
_MS_DIGITS = 2
# Error messages kept in the summary: enough to diagnose, bounded so a failing run stays small.
_MAX_ERRORS = 5
_RECV_BYTES = 65536  # one recv per readable socket; SSE chunks are ~250 bytes each
# Connects in flight at once while the pool warms up. A client completes its handshake before
# the server has accept()ed, so 10,000 simultaneous connects overflow any accept queue (capped
# by net.core.somaxconn, 4096 here) and the overflowed connections are reset when they send;
# real clients do not arrive in one burst of 10k. 512 stays far below the queue.
CONNECTS_IN_FLIGHT = 512
# Longest wait for the initial connections: covers five SYN retransmissions (1+3+7+15+31 s)
# after a listen-backlog overflow, so a slow accept shows up as a figure, not a failure.
CONNECT_LIMIT_S = 70.0
# A connection opened again after a failure, and a request's send, give up after this long:
# on loopback either takes microseconds unless the server is gone.
CONNECT_RETRY_S = 5.0


class Spec(msgspec.Struct, kw_only=True):
    host: str = "127.0.0.1"
    port: int
    path: str = "/v1/completions"
    model: str
    prompt_ids: list[int]
    max_tokens: int
    concurrency: int
    duration_s: float
    max_requests: int
    time_limit_s: float
    expected_text: str
    prefix_lens: list[int]
    extra: dict[str, Any] = {}
    # "tools": streaming /v1/chat/completions with ``tools`` (:class:`_ToolStream`); each
    # stream's reasoning_content, content and tool calls, flattened, must equal expected_text.
    mode: str = "plain"
    messages: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    expected_tokens: int = 0  # tools: completion tokens each stream reports (reply + EOS)
    expected_finish: str = "tool_calls"  # tools: "stop" when the engine parses nothing
    # "count" (a real engine, whose text is not known in advance): plain completions counted
    # by their usage alone (:class:`_CountStream`); expected_text and prefix_lens are unused.
    # A request's connection closes after its response, and the next request connects anew
    # (its TTFT counts from before the connect); else connections are kept alive.
    new_connections: bool = False


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None
    finish_reason: str | None = None


class _Event(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: Any = None


_decode_event = msgspec.json.Decoder(_Event).decode


class _Function(msgspec.Struct):
    name: str | None = None
    arguments: str | None = None


class _CallPiece(msgspec.Struct):
    index: int = 0
    id: str | None = None
    type: str | None = None
    function: _Function | None = None


class _ChatDelta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[_CallPiece] | None = None


class _ChatChoice(msgspec.Struct):
    delta: _ChatDelta | None = None
    finish_reason: str | None = None


class _ChatEvent(msgspec.Struct):
    choices: list[_ChatChoice] = []
    usage: _Usage | None = None
    error: Any = None


_decode_chat_event = msgspec.json.Decoder(_ChatEvent).decode


class ProtocolError(Exception):
    pass


class SSEParser:
    """Incremental HTTP/1.1 response parser for one streaming response (sans-IO).

    Feed raw bytes; get back complete SSE ``data:`` payloads. ``done`` is set at the end of the
    body (the 0-size chunk, or Content-Length reached). ``status`` and ``body`` (non-SSE
    bodies, e.g. an error JSON) are available once parsed.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._sse = bytearray()
        self.status = 0
        self._chunked = False
        self._remaining = -1  # Content-Length body bytes left; -1: unknown
        self._chunk_left = 0  # bytes left in the current chunk (chunked mode)
        self._headers_done = False
        self.done = False
        self.body = bytearray()
        self._is_sse = False

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        if not self._headers_done and not self._parse_headers():
            return []
        if self._chunked:
            self._dechunk()
        else:
            take = len(self._buf) if self._remaining < 0 else min(self._remaining, len(self._buf))
            self._body_bytes(bytes(self._buf[:take]))
            del self._buf[:take]
            if self._remaining >= 0:
                self._remaining -= take
                self.done = self._remaining == 0
        return self._events()

    def _parse_headers(self) -> bool:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            return False
        head = bytes(self._buf[:end]).decode("latin-1").split("\r\n")
        del self._buf[: end + 4]
        parts = head[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise ProtocolError(f"bad status line {head[0]!r}")
        self.status = int(parts[1])
        for line in head[1:]:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "transfer-encoding" and "chunked" in value:
                self._chunked = True
            elif name == "content-length":
                self._remaining = int(value)
            elif name == "content-type":
                self._is_sse = value.startswith("text/event-stream")
        self._headers_done = True
        if not self._chunked and self._remaining == 0:
            self.done = True
        return True

    def _dechunk(self) -> None:
        buf = self._buf
        while buf and not self.done:
            if self._chunk_left == 0:
                eol = buf.find(b"\r\n")
                if eol < 0:
                    return
                size = int(bytes(buf[:eol]).split(b";", 1)[0], 16)
                if size == 0:
                    self.done = True  # trailers (none expected) are ignored
                    del buf[:]
                    return
                if len(buf) < eol + 2 + size + 2:
                    # Wait for the whole chunk: smaller pieces would only cost more calls.
                    return
                self._body_bytes(bytes(buf[eol + 2 : eol + 2 + size]))
                del buf[: eol + 2 + size + 2]

    def _body_bytes(self, data: bytes) -> None:
        if self._is_sse:
            self._sse += data
        else:
            self.body += data

    def _events(self) -> list[bytes]:
        out: list[bytes] = []
        sse = self._sse
        start = 0
        while True:
            end = sse.find(b"\n\n", start)
            if end < 0:
                break
            block = bytes(sse[start:end])
            start = end + 2
            for line in block.split(b"\n"):
                if line.startswith(b"data:"):
                    out.append(line[5:].lstrip())
        if start:
            del sse[:start]
        return out


@dataclass(slots=True)
class Results:
    """Raw per-run accumulators, reduced by :func:`summarize`."""

    started: int = 0
    completed: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    chunks: int = 0
    usage_tokens: int = 0
    text_tokens: int = 0
    window_tokens: int = 0
    lost: int = 0
    duplicated: int = 0
    bad_streams: int = 0

    def error(self, message: str) -> None:
        self.failed += 1
        if len(self.errors) < _MAX_ERRORS:
            self.errors.append(message)


def build_request(spec: Spec) -> bytes:
    body: dict[str, Any] = {
        "model": spec.model,
        "prompt": spec.prompt_ids,
        "max_tokens": spec.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
        **spec.extra,
    }
    if spec.mode == "tools":
        body = {
            "model": spec.model,
            "messages": spec.messages,
            "tools": spec.tools,
            "max_tokens": spec.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.0,
            **spec.extra,
        }
    payload = msgspec.json.encode(body)
    head = (
        f"POST {spec.path} HTTP/1.1\r\nHost: {spec.host}:{spec.port}\r\n"
        "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


class _Stream:
    """One streamed request seen from the client (sans-IO): response bytes in, figures out."""

    __slots__ = ("_chars", "_done_marker", "_last", "_pieces", "_res", "_spec", "_t0", "_t_end",
                 "_usage", "parser")  # fmt: skip

    def __init__(self, spec: Spec, res: Results, t0: float, t_end: float) -> None:
        self._spec = spec
        self._res = res
        self._t0 = t0  # when the request was sent
        self._t_end = t_end  # tokens after this are outside the measured window
        self.parser = SSEParser()
        self._pieces: list[str] = []
        self._chars = 0
        self._last = -1.0
        self._usage = -1
        self._done_marker = False

    def feed(self, data: bytes, now: float) -> bool:
        """Take bytes received at ``now``; True once the response has ended."""
        for payload in self.parser.feed(data):
            if payload == b"[DONE]":
                self._done_marker = True
                continue
            event = self._decode(payload)
            if event.error is not None:
                raise ProtocolError(f"error event: {event.error}")
            if event.usage is not None:
                self._usage = event.usage.completion_tokens
            for choice in event.choices:
                chars = self._take(choice)
                if chars:
                    self._arrived(chars, now)
        return self.parser.done

    @staticmethod
    def _decode(payload: bytes) -> Any:
        return _decode_event(payload)

    def _take(self, choice: Any) -> int:
        """Keep one choice's piece of an event; the characters it adds to the stream."""
        text = choice.text if choice.delta is None else choice.delta.content
        if text:
            self._pieces.append(text)
            return len(text)
        return 0

    def _arrived(self, chars: int, now: float) -> None:
        """``chars`` more characters arrived at ``now``: latency and window figures."""
        self._timing(now)
        before = tokens_in(self._spec.prefix_lens, self._chars)
        self._chars += chars
        if now <= self._t_end:
            self._res.window_tokens += tokens_in(self._spec.prefix_lens, self._chars) - before

    def _timing(self, now: float) -> None:
        """An event with text arrived at ``now``: TTFT or the gap since the last one."""
        res = self._res
        if self._last < 0:
            res.ttft.append(now - self._t0)
        else:
            res.gaps.append(now - self._last)
        self._last = now
        res.chunks += 1

    def finish(self) -> None:
        """Check the ended response and count its tokens (raises ProtocolError if it failed)."""
        res, spec, parser = self._res, self._spec, self.parser
        if parser.status != 200:
            raise ProtocolError(f"HTTP {parser.status}: {bytes(parser.body[:200])!r}")
        if not self._done_marker:
            raise ProtocolError("stream ended without [DONE]")
        received = "".join(self._pieces)
        lost, dup, corrupt = token_errors(received, spec.expected_text, spec.prefix_lens)
        if self._usage >= 0:
            res.usage_tokens += self._usage
            lost = max(lost, spec.max_tokens - self._usage)
        else:
            corrupt = True  # include_usage was asked for: a missing usage chunk is a bug
        if not corrupt:
            res.text_tokens += len(spec.prefix_lens)
        res.lost += lost
        res.duplicated += dup
        res.bad_streams += int(corrupt)
        res.completed += 1


class _ToolStream(_Stream):
    """A streamed chat request with tools: reasoning, content and call pieces are accumulated
    apart and checked at the end (``finish_reason`` as expected, each call with an id)."""

    __slots__ = ("_calls", "_content", "_finish", "_reasoning")

    def __init__(self, spec: Spec, res: Results, t0: float, t_end: float) -> None:
        super().__init__(spec, res, t0, t_end)
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: dict[int, list[Any]] = {}  # index -> [id, type, name, argument pieces]
        self._finish: str | None = None

    @staticmethod
    def _decode(payload: bytes) -> Any:
        return _decode_chat_event(payload)

    def _take(self, choice: Any) -> int:
        if choice.finish_reason is not None:
            self._finish = choice.finish_reason
        return 0 if choice.delta is None else self._take_delta(choice.delta)

    def _take_delta(self, delta: _ChatDelta) -> int:
        """Accumulate one delta; the characters it adds to the flattened stream."""
        chars = 0
        if delta.reasoning_content:
            self._reasoning.append(delta.reasoning_content)
            chars += len(delta.reasoning_content)
        if delta.content:
            self._content.append(delta.content)
            chars += len(delta.content)
        for piece in delta.tool_calls or ():
            call = self._calls.setdefault(piece.index, [None, None, "", []])
            if piece.id is not None:
                call[0] = piece.id
            if piece.type is not None:
                call[1] = piece.type
            if piece.function is not None:
                if piece.function.name:
                    call[2] += piece.function.name
                    chars += len(piece.function.name)
                if piece.function.arguments:
                    call[3].append(piece.function.arguments)
                    chars += len(piece.function.arguments)
        return chars

    def finish(self) -> None:
        res, spec, parser = self._res, self._spec, self.parser
        if parser.status != 200:
            raise ProtocolError(f"HTTP {parser.status}: {bytes(parser.body[:200])!r}")
        if not self._done_marker:
            raise ProtocolError("stream ended without [DONE]")
        calls = [self._calls[i] for i in sorted(self._calls)]
        received = "".join(self._reasoning) + "".join(self._content)
        received += "".join(call[2] + "".join(call[3]) for call in calls)
        lost, dup, corrupt = token_errors(received, spec.expected_text, spec.prefix_lens)
        unnamed = any(not c[0] or c[1] != "function" for c in calls)
        if self._finish != spec.expected_finish or unnamed:
            corrupt = True
        if self._usage >= 0:
            res.usage_tokens += self._usage
            lost = max(lost, spec.expected_tokens - self._usage)
        else:
            corrupt = True
        if not corrupt:
            res.text_tokens += len(spec.prefix_lens)
        res.lost += lost
        res.duplicated += dup
        res.bad_streams += int(corrupt)
        res.completed += 1


class _CountStream(_Stream):
    """A streamed completion from a real engine: its text is not known in advance, so only
    the usage is checked (``ignore_eos``: exactly ``max_tokens``). Tokens inside the measured
    window are the usage times the share of the text's characters that arrived inside it."""

    __slots__ = ("_window_chars",)

    def __init__(self, spec: Spec, res: Results, t0: float, t_end: float) -> None:
        super().__init__(spec, res, t0, t_end)
        self._window_chars = 0

    def _take(self, choice: Any) -> int:
        return len(choice.text) if choice.text else 0

    def _arrived(self, chars: int, now: float) -> None:
        self._timing(now)
        self._chars += chars
        if now <= self._t_end:
            self._window_chars += chars

    def finish(self) -> None:
        res, spec, parser = self._res, self._spec, self.parser
        if parser.status != 200:
            raise ProtocolError(f"HTTP {parser.status}: {bytes(parser.body[:200])!r}")
        if not self._done_marker:
            raise ProtocolError("stream ended without [DONE]")
        if self._usage < 0:
            res.bad_streams += 1  # include_usage was asked for: a missing usage chunk is a bug
            res.lost += spec.max_tokens
        else:
            res.usage_tokens += self._usage
            res.lost += max(0, spec.max_tokens - self._usage)
            res.duplicated += max(0, self._usage - spec.max_tokens)
            if self._chars:
                res.window_tokens += round(self._usage * self._window_chars / self._chars)
        res.completed += 1


def _address(spec: Spec) -> tuple[socket.AddressFamily, Any]:
    family, _, _, _, addr = socket.getaddrinfo(spec.host, spec.port, type=socket.SOCK_STREAM)[0]
    return family, addr


def _new_socket(family: socket.AddressFamily) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # requests go out at once
    return sock


def connect_all(spec: Spec, clock: Callable[[], float]) -> tuple[list[socket.socket], list[float]]:
    """Open up to ``spec.concurrency`` connections, CONNECTS_IN_FLIGHT handshakes at a time,
    within CONNECT_LIMIT_S; the connected (non-blocking) sockets and each one's connect time."""
    family, addr = _address(spec)
    poller = select.epoll()
    pending: dict[int, tuple[socket.socket, float]] = {}
    connected: list[socket.socket] = []
    times: list[float] = []
    launched = 0
    deadline = clock() + CONNECT_LIMIT_S
    try:
        while launched < spec.concurrency or pending:
            while launched < spec.concurrency and len(pending) < CONNECTS_IN_FLIGHT:
                launched += 1
                sock = _new_socket(family)
                sock.setblocking(False)
                if sock.connect_ex(addr) not in (0, errno.EINPROGRESS):
                    sock.close()  # refused at once: that slot connects again when it starts
                    continue
                pending[sock.fileno()] = (sock, clock())
                poller.register(sock.fileno(), select.EPOLLOUT)
            left = deadline - clock()
            if left <= 0:
                break
            for fd, _ in poller.poll(min(left, 1.0)):
                sock, started = pending.pop(fd)
                poller.unregister(fd)
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    sock.close()
                    continue
                connected.append(sock)
                times.append(clock() - started)
    finally:
        for sock, _ in pending.values():
            sock.close()
        poller.close()
    return connected, times


_STREAMS: dict[str, type[_Stream]] = {"tools": _ToolStream, "count": _CountStream}


class _Slot:
    """One of the C request loops: a keep-alive connection and its request in flight."""

    __slots__ = ("sock", "stream")

    def __init__(self, sock: socket.socket | None) -> None:
        self.sock = sock
        self.stream: _Stream | None = None


class _Driver:
    """C request loops multiplexed on one epoll: one ``recv`` per readable socket, no tasks.

    A trio task per connection cost ~50 µs of the client's CPU per SSE event (a wait, an epoll
    re-registration and a reschedule per receive); at C = 256 that was 0.6-0.7 of this 2-core
    machine's cores, taken from the server being measured. Here an event costs a ``recv``,
    the SSE parse and the token accounting.
    """

    def __init__(self, spec: Spec, res: Results, clock: Callable[[], float]) -> None:
        self.spec = spec
        self.res = res
        self.clock = clock
        self.request = build_request(spec)
        self.stream_type: type[_Stream] = _STREAMS.get(spec.mode, _Stream)
        self.family, self.addr = _address(spec)
        self.poller = select.epoll()
        self.live: dict[int, _Slot] = {}
        self.budget = spec.max_requests
        self.t_stop = math.inf

    def start(self, slot: _Slot, now: float) -> None:
        """Send the slot's next request, or retire it (window over, budget spent)."""
        while now < self.t_stop and self.budget > 0:
            self.budget -= 1
            self.res.started += 1
            try:
                if slot.sock is None:
                    slot.sock = _new_socket(self.family)
                    slot.sock.settimeout(CONNECT_RETRY_S)
                    slot.sock.connect(self.addr)
                    slot.sock.setblocking(False)
                sock = slot.sock
                sent = sock.send(self.request)  # ~1 KB into an idle socket: taken at once
                if sent < len(self.request):
                    sock.settimeout(CONNECT_RETRY_S)
                    sock.sendall(self.request[sent:])
                    sock.setblocking(False)
            except OSError as exc:
                self._failed(slot, exc)
                now = self.clock()
                continue
            slot.stream = self.stream_type(self.spec, self.res, now, self.t_stop)
            fd = sock.fileno()
            if fd not in self.live:
                self.live[fd] = slot
                self.poller.register(fd, select.EPOLLIN)
            return
        self._close(slot)

    def readable(self, slot: _Slot, now: float) -> None:
        assert slot.sock is not None
        assert slot.stream is not None
        try:
            data = slot.sock.recv(_RECV_BYTES)
        except BlockingIOError:
            return
        except OSError as exc:
            self._failed(slot, exc)
            self.start(slot, now)
            return
        try:
            if not data:
                raise ProtocolError("connection closed mid-response")
            if not slot.stream.feed(data, now):
                return
            slot.stream.finish()
        except (ProtocolError, msgspec.DecodeError) as exc:
            self._failed(slot, exc)
        slot.stream = None
        if self.spec.new_connections:
            self._close(slot)  # the next request connects anew
        self.start(slot, now)

    def _failed(self, slot: _Slot, exc: Exception) -> None:
        self.res.error(f"{type(exc).__name__}: {exc}")
        slot.stream = None
        self._close(slot)  # the next request opens a new connection

    def _close(self, slot: _Slot) -> None:
        if slot.sock is None:
            return
        fd = slot.sock.fileno()
        if self.live.pop(fd, None) is not None:
            self.poller.unregister(fd)
        slot.sock.close()
        slot.sock = None

    def run(self, slots: list[_Slot], duration_s: float, time_limit_s: float) -> tuple[float, bool]:
        """Keep every slot busy for ``duration_s``; (wall seconds, hard limit hit)."""
        t0 = self.clock()
        self.t_stop = t0 + duration_s
        hard = t0 + time_limit_s
        for slot in slots:
            self.start(slot, self.clock())
        cut = False
        while self.live:
            left = hard - self.clock()
            if left <= 0:
                cut = True
                break
            events = self.poller.poll(min(left, 1.0))
            now = self.clock()
            for fd, _ in events:
                ready = self.live.get(fd)
                if ready is not None and ready.stream is not None:
                    self.readable(ready, now)
        wall = self.clock() - t0
        for slot in [*self.live.values()]:
            self._close(slot)
        self.poller.close()
        return wall, cut


def run(spec: Spec) -> dict[str, Any]:
    res = Results()
    clock = time.perf_counter
    # Open every connection before the clock starts, as a client with a warm pool does: a
    # burst of C connects is its own test (the server's listen backlog; SYN retries after an
    # overflow take 1, 3, 7, 15, 31 s), reported as connect_*_ms instead of polluting TTFT.
    connected, connect_times = connect_all(spec, clock)
    slots = [_Slot(sock) for sock in connected]
    slots += [_Slot(None) for _ in range(spec.concurrency - len(slots))]
    wall, cut_short = _Driver(spec, res, clock).run(slots, spec.duration_s, spec.time_limit_s)
    cut = res.started - res.completed - res.failed
    if cut_short and cut:
        for _ in range(cut):
            res.error(f"hard time limit {spec.time_limit_s:g} s hit")
    summary = summarize(res, spec, wall)
    summary["connect_p50_ms"] = _ms(percentile(connect_times, 50))
    summary["connect_max_ms"] = _ms(max(connect_times, default=math.nan))
    return summary


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, _MS_DIGITS)


def summarize(res: Results, spec: Spec, wall_s: float) -> dict[str, Any]:
    window = min(spec.duration_s, wall_s)
    return {
        "concurrency": spec.concurrency,
        "requests_started": res.started,
        "requests_completed": res.completed,
        "requests_failed": res.failed,
        "errors": res.errors,
        "wall_s": round(wall_s, 3),
        "window_s": round(window, 3),
        "output_tokens": res.usage_tokens,
        "window_tokens": res.window_tokens,
        "tokens_per_s": round(res.window_tokens / window, 1) if window > 0 else 0.0,
        "chunks": res.chunks,
        "tokens_per_chunk": round(res.usage_tokens / res.chunks, 3) if res.chunks else 0.0,
        "ttft_p50_ms": _ms(percentile(res.ttft, 50)),
        "ttft_p99_ms": _ms(percentile(res.ttft, 99)),
        "itl_p50_ms": _ms(percentile(res.gaps, 50)),
        "itl_p99_ms": _ms(percentile(res.gaps, 99)),
        "lost_tokens": res.lost,
        "duplicated_tokens": res.duplicated,
        "bad_streams": res.bad_streams,
    }


def main() -> int:
    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=Spec)
    if spec.host not in ("127.0.0.1", "localhost", "::1"):
        print("loadgen: loopback only", file=sys.stderr)
        return 2
    cpu0 = sum(os.times()[:2])
    summary = run(spec)
    # The loadgen's own CPU: shows when the client, not the server, is the limit.
    summary["loadgen_cpu_s"] = round(sum(os.times()[:2]) - cpu0, 3)
    sys.stdout.write(msgspec.json.encode(summary).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
