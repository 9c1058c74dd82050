"""The benchmark's load generator: C streaming completions in flight over raw HTTP/1.1.

Runs as its own process (``python -m smgd.bench.loadgen < spec.json``) so its CPU is never
counted as the server's, and prints one JSON summary on stdout. It is built to be cheap: one
keep-alive trio socket per worker, a tiny chunked-transfer + SSE parser (:class:`SSEParser`,
sans-IO), and a typed msgspec decoder per event. Loopback only; bounded by a request count, a
duration (no new request starts after it) and a hard time limit (everything still open is
cancelled and counted as failed).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio

from smgd.bench.stats import percentile, token_errors, tokens_in

# Latencies go out in milliseconds rounded to 10 µs: finer digits are noise on this machine.
_MS_DIGITS = 2
# Error messages kept in the summary: enough to diagnose, bounded so a failing run stays small.
_MAX_ERRORS = 5
_RECV_BYTES = 65536
# Connects in flight at once while the pool warms up. A client completes its handshake before
# the server has accept()ed, so 10,000 simultaneous connects overflow any accept queue (capped
# by net.core.somaxconn, 4096 here) and the overflowed connections are reset when they send;
# real clients do not arrive in one burst of 10k. 512 stays far below the queue.
CONNECTS_IN_FLIGHT = 512
# Longest wait for the initial connections: covers five SYN retransmissions (1+3+7+15+31 s)
# after a listen-backlog overflow, so a slow accept shows up as a figure, not a failure.
CONNECT_LIMIT_S = 70.0  # one recv per TCP read; SSE chunks are ~250 bytes each


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
    body = {
        "model": spec.model,
        "prompt": spec.prompt_ids,
        "max_tokens": spec.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
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


async def _one_request(
    stream: trio.SocketStream, request: bytes, spec: Spec, res: Results, t_end: float
) -> None:
    t0 = trio.current_time()
    await stream.send_all(request)
    parser = SSEParser()
    pieces: list[str] = []
    chars = 0
    last = -1.0
    usage = -1
    done_marker = False
    while not parser.done:
        data = await stream.receive_some(_RECV_BYTES)
        if not data:
            raise ProtocolError("connection closed mid-response")
        now = trio.current_time()
        for payload in parser.feed(data):
            if payload == b"[DONE]":
                done_marker = True
                continue
            event = _decode_event(payload)
            if event.error is not None:
                raise ProtocolError(f"error event: {event.error}")
            if event.usage is not None:
                usage = event.usage.completion_tokens
            for choice in event.choices:
                text = choice.text if choice.delta is None else choice.delta.content
                if not text:
                    continue
                if last < 0:
                    res.ttft.append(now - t0)
                else:
                    res.gaps.append(now - last)
                last = now
                res.chunks += 1
                before = tokens_in(spec.prefix_lens, chars)
                chars += len(text)
                if now <= t_end:
                    res.window_tokens += tokens_in(spec.prefix_lens, chars) - before
                pieces.append(text)
    if parser.status != 200:
        raise ProtocolError(f"HTTP {parser.status}: {bytes(parser.body[:200])!r}")
    if not done_marker:
        raise ProtocolError("stream ended without [DONE]")
    received = "".join(pieces)
    lost, dup, corrupt = token_errors(received, spec.expected_text, spec.prefix_lens)
    if usage >= 0:
        res.usage_tokens += usage
        lost = max(lost, spec.max_tokens - usage)
    else:
        corrupt = True  # include_usage was asked for: a missing usage chunk is a bug
    if not corrupt:
        res.text_tokens += len(spec.prefix_lens)
    res.lost += lost
    res.duplicated += dup
    res.bad_streams += int(corrupt)
    res.completed += 1


async def _worker(
    spec: Spec,
    request: bytes,
    res: Results,
    t_stop: float,
    budget: list[int],
    stream: trio.SocketStream | None,
) -> None:
    try:
        while trio.current_time() < t_stop and budget[0] > 0:
            budget[0] -= 1
            res.started += 1
            try:
                if stream is None:
                    stream = await trio.open_tcp_stream(spec.host, spec.port)
                await _one_request(stream, request, spec, res, t_stop)
            except (OSError, trio.BrokenResourceError, ProtocolError, msgspec.DecodeError) as exc:
                res.error(f"{type(exc).__name__}: {exc}")
                if stream is not None:
                    await stream.aclose()
                stream = None
    finally:
        if stream is not None:
            await stream.aclose()


async def _connect(
    spec: Spec, streams: list[trio.SocketStream], times: list[float], limit: trio.CapacityLimiter
) -> None:
    async with limit:
        t = trio.current_time()
        try:
            streams.append(await trio.open_tcp_stream(spec.host, spec.port))
        except OSError:
            return  # the worker retries the connect and records the error
        times.append(trio.current_time() - t)


async def run(spec: Spec) -> dict[str, Any]:
    res = Results()
    request = build_request(spec)
    # Open every connection before the clock starts, as a client with a warm pool does: a
    # burst of C connects is its own test (the server's listen backlog; SYN retries after an
    # overflow take 1, 3, 7, 15, 31 s), reported as connect_*_ms instead of polluting TTFT.
    streams: list[trio.SocketStream] = []
    connect_times: list[float] = []
    limit = trio.CapacityLimiter(CONNECTS_IN_FLIGHT)
    with trio.move_on_after(CONNECT_LIMIT_S):
        async with trio.open_nursery() as nursery:
            for _ in range(spec.concurrency):
                nursery.start_soon(_connect, spec, streams, connect_times, limit)
    t0 = trio.current_time()
    t_stop = t0 + spec.duration_s
    budget = [spec.max_requests]
    with trio.move_on_after(spec.time_limit_s) as scope:
        async with trio.open_nursery() as nursery:
            for i in range(spec.concurrency):
                stream = streams[i] if i < len(streams) else None
                nursery.start_soon(_worker, spec, request, res, t_stop, budget, stream)
    wall = trio.current_time() - t0
    cut = res.started - res.completed - res.failed
    if scope.cancelled_caught and cut:
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
    summary = trio.run(run, spec)
    # The loadgen's own CPU: shows when the client, not the server, is the limit.
    summary["loadgen_cpu_s"] = round(sum(os.times()[:2]) - cpu0, 3)
    sys.stdout.write(msgspec.json.encode(summary).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
