"""The raw floor: the least any front end must spend to receive the same token batches.

A bare pyzmq loop (no trio, no HTTP, no detokenization) binds the same two ipc sockets smgd
binds for an SGLang-wire engine, keeps C requests in flight on the same mock engine, decodes
every ``BatchTokenIDOutput`` with smgd's codec and demuxes it by rid. Its CPU per token is the
decode-only cost, the floor smgd's CPU per token is compared with. Latencies are measured at
the socket, so the TTFT and inter-token figures are the engine's plus ZMQ's, nothing else.

With ``sse`` set (the ``floor-sse`` target) the floor also writes every delivery to a client,
as one HTTP/1.1 chunk the size of smgd's completion event, over one loopback TCP connection per
stream to a sink process that reads and discards (started by the floor; its CPU is the
client's, not counted). That is the least a front end must spend per token: receive, decode,
demux, and one small socket write, which on loopback also runs the client's receive path and
its wakeup. No HTTP parsing, no detokenizing, no rendering.

Run as ``python -m smgd.bench.floor < spec.json``: prints ``BOUND`` once the sockets are bound,
waits for ``GO`` on stdin (the orchestrator starts the mock in between), runs, prints JSON.
``python -m smgd.bench.floor --sink PORT N`` is the sink.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from smgd.bench.stats import percentile
from smgd.wire.common import GenerateRequest, SamplingParams
from smgd.wire.sglang.decode import decode_output
from smgd.wire.sglang.encode import encode_generate

# How long one poll waits before re-checking the deadlines: short enough that the hard time
# limit is honoured promptly, long enough to cost nothing while the engine steps.
_POLL_MS = 100
# The event the SSE floor writes per delivery: the size of smgd's completion chunk (a
# `data: {...}` line of ~195 bytes with a one-token text), framed as one HTTP/1.1 chunk, as
# smgd's direct path writes it. The bytes' content costs nothing; their count and the one
# write per event are what the kernel charges.
_EVENT_BODY = b"data: " + b"x" * 187 + b"\n\n"
EVENT = b"%x\r\n%b\r\n" % (len(_EVENT_BODY), _EVENT_BODY)
_SINK_READ = 65536  # one read per readable socket, as the loadgen reads
# How long the floor waits for its sink's connections: a Python start-up takes well under a
# second; a sink that never connects fails the point instead of hanging it.
_SINK_CONNECT_S = 30.0


class FloorSpec(msgspec.Struct, kw_only=True):
    input_addr: str
    output_addr: str
    prompt_ids: list[int]
    expected_ids: list[int]
    max_tokens: int
    concurrency: int
    duration_s: float
    max_requests: int
    time_limit_s: float
    sse: bool = False  # also write each delivery to a loopback TCP client (floor-sse)


@dataclass(slots=True)
class _Stream:
    start: float
    last: float = -1.0
    got: int = 0
    ok: bool = True
    fd: int = -1  # the client connection this stream writes to (SSE floor only)


class SseClients:
    """``n`` loopback TCP connections whose far ends a sink process reads and discards.

    A stream takes a free connection when it starts and gives it back when it ends, as a
    keep-alive HTTP client reuses its connection. :meth:`close` ends the connections and
    returns the bytes the sink read, which must equal :attr:`written`.
    """

    def __init__(self, n: int) -> None:
        listener = socket.create_server(("127.0.0.1", 0), backlog=n)
        port = listener.getsockname()[1]
        self.sink = subprocess.Popen(
            [sys.executable, "-m", "smgd.bench.floor", "--sink", str(port), str(n)],
            stdout=subprocess.PIPE,
        )
        listener.settimeout(_SINK_CONNECT_S)
        self.socks = [listener.accept()[0] for _ in range(n)]
        listener.close()
        for sock in self.socks:
            sock.setblocking(True)  # write() blocks rather than handle a partial write
            # As every HTTP server sets it: a small event goes out at once, not with the next.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.free = [sock.fileno() for sock in self.socks]
        self.written = 0

    def write(self, fd: int) -> None:
        """One event on connection ``fd`` (blocking: the sink reads as fast as it arrives)."""
        view = memoryview(EVENT)
        while view:
            view = view[os.write(fd, view) :]
        self.written += len(EVENT)

    def close(self) -> int:
        for sock in self.socks:
            sock.close()
        out, _ = self.sink.communicate(timeout=30)
        return int(out or b"-1")


@dataclass(slots=True)
class FloorRun:
    """The floor's accumulators; :meth:`summary` reduces them (same keys as the loadgen)."""

    spec: FloorSpec
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    started: int = 0
    completed: int = 0
    tokens: int = 0
    window_tokens: int = 0
    messages: int = 0
    lost: int = 0
    duplicated: int = 0
    bad_streams: int = 0

    def on_tokens(self, st: _Stream, ids: list[int], now: float, t_stop: float) -> None:
        if ids:
            if st.last < 0:
                self.ttft.append(now - st.start)
            else:
                self.gaps.append(now - st.last)
            st.last = now
        expected = self.spec.expected_ids[st.got : st.got + len(ids)]
        if ids != expected:
            st.ok = False
        st.got += len(ids)
        self.tokens += len(ids)
        if now <= t_stop:
            self.window_tokens += len(ids)

    def on_finish(self, st: _Stream) -> None:
        m = self.spec.max_tokens
        self.lost += max(0, m - st.got)
        self.duplicated += max(0, st.got - m)
        self.bad_streams += int(not st.ok or st.got != m)
        self.completed += 1

    def summary(self, wall: float, cpu_s: float) -> dict[str, Any]:
        window = min(self.spec.duration_s, wall)
        deliveries = len(self.ttft) + len(self.gaps)
        ms = 1000.0
        return {
            "concurrency": self.spec.concurrency,
            "requests_started": self.started,
            "requests_completed": self.completed,
            "requests_failed": self.started - self.completed,
            "errors": [],
            "wall_s": round(wall, 3),
            "window_s": round(window, 3),
            "output_tokens": self.tokens,
            "window_tokens": self.window_tokens,
            "tokens_per_s": round(self.window_tokens / window, 1) if window > 0 else 0.0,
            # A "chunk" is one per-request delivery (what one SSE event would carry).
            "chunks": deliveries,
            "messages": self.messages,
            "tokens_per_chunk": round(self.tokens / deliveries, 3) if deliveries else 0.0,
            "ttft_p50_ms": round(percentile(self.ttft, 50) * ms, 2),
            "ttft_p99_ms": round(percentile(self.ttft, 99) * ms, 2),
            "itl_p50_ms": round(percentile(self.gaps, 50) * ms, 2),
            "itl_p99_ms": round(percentile(self.gaps, 99) * ms, 2),
            "lost_tokens": self.lost,
            "duplicated_tokens": self.duplicated,
            "bad_streams": self.bad_streams,
            "server_cpu_s": round(cpu_s, 6),
            "server_cpu_grain_s": 1e-9,  # CLOCK_PROCESS_CPUTIME_ID, every thread
        }


def _encode(spec: FloorSpec, rid: str) -> bytes:
    sampling = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
    return encode_generate(GenerateRequest(rid=rid, prompt_ids=spec.prompt_ids, sampling=sampling))


def run_floor(
    spec: FloorSpec,
    push: zmq.Socket[bytes],
    pull: zmq.Socket[bytes],
    clients: SseClients | None = None,
) -> dict[str, Any]:
    run = FloorRun(spec)
    streams: dict[str, _Stream] = {}
    cpu0 = time.process_time()
    t0 = time.monotonic()
    t_stop, t_kill = t0 + spec.duration_s, t0 + spec.time_limit_s

    def submit(now: float) -> None:
        rid = f"floor-{run.started}"
        run.started += 1
        streams[rid] = _Stream(start=now, fd=clients.free.pop() if clients else -1)
        push.send(_encode(spec, rid))

    for _ in range(min(spec.concurrency, spec.max_requests)):
        submit(time.monotonic())
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    while streams and time.monotonic() < t_kill:
        if not poller.poll(_POLL_MS):
            continue
        while True:
            try:
                frame = pull.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            now = time.monotonic()
            run.messages += 1
            deltas = decode_output(frame.buffer)
            if not isinstance(deltas, list):
                continue
            for delta in deltas:
                st = streams.get(delta.rid)
                if st is None:
                    continue
                run.on_tokens(st, delta.token_ids, now, t_stop)
                if clients is not None and delta.token_ids:
                    clients.write(st.fd)
                if delta.finish is not None:
                    del streams[delta.rid]
                    run.on_finish(st)
                    if clients is not None:
                        clients.free.append(st.fd)
                    if now < t_stop and run.started < spec.max_requests:
                        submit(now)
    wall = time.monotonic() - t0
    return run.summary(wall, time.process_time() - cpu0)


def sink(port: int, n: int) -> int:
    """The SSE floor's client: ``n`` connections read until closed; prints the bytes read."""
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
    poller = select.epoll()
    open_socks = {}
    for sock in socks:
        sock.setblocking(False)
        poller.register(sock.fileno(), select.EPOLLIN)
        open_socks[sock.fileno()] = sock
    total = 0
    while open_socks:
        for fd, _ in poller.poll():
            try:
                data = os.read(fd, _SINK_READ)
            except BlockingIOError:
                continue
            if data:
                total += len(data)
            else:
                poller.unregister(fd)
                open_socks.pop(fd).close()
    print(total, flush=True)
    return 0


def main() -> int:
    if sys.argv[1:2] == ["--sink"]:
        return sink(int(sys.argv[2]), int(sys.argv[3]))
    spec = msgspec.json.decode(sys.stdin.buffer.readline(), type=FloorSpec)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    for sock in (push, pull):
        sock.setsockopt(zmq.LINGER, 0)
    # Unbounded queues, as smgd sets them: the floor must never drop or block on a burst.
    push.setsockopt(zmq.SNDHWM, 0)
    pull.setsockopt(zmq.RCVHWM, 0)
    push.bind(spec.input_addr)
    pull.bind(spec.output_addr)
    clients = SseClients(min(spec.concurrency, spec.max_requests)) if spec.sse else None
    print("BOUND", flush=True)
    if sys.stdin.readline().strip() != "GO":
        return 1
    summary = run_floor(spec, push, pull, clients)
    if clients is not None:
        summary["sse_bytes_written"] = clients.written
        summary["sse_bytes_read"] = clients.close()
        if summary["sse_bytes_read"] != clients.written:
            summary["errors"].append(
                f"the sink read {summary['sse_bytes_read']} of {clients.written} bytes written"
            )
    sys.stdout.write(msgspec.json.encode(summary).decode() + "\n")
    push.close()
    pull.close()
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
