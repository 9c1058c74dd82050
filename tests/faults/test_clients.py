"""Fault suite: a client that stops reading mid-stream, beside clients that read.

A stalled client's socket fills, and the daemon's writes to it back up: the engine's reader
holds each event's write to the end of the engine message's delivery, and a write the kernel
refuses then goes to the stream's backlog, which its own task flushes once the client reads
again. Seen from outside: the stalled client gets every token, in order, once it reads, and
nobody else waits for it.
"""

from __future__ import annotations

import itertools
import socket
from typing import TYPE_CHECKING

import pytest
import trio

from ..http_helpers import dechunk, post_bytes
from .harness import StreamOutcome, daemon_toml, mock_engine_toml, serve, sse_outcome, stream

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow

STEP_MS = 2.0
TOKENS = 5000  # 10 s of steps: every stream still runs when the stalled client resumes
OTHERS = 4
PROMPT = "the quick brown fox"
# The stalled client's receive buffer and segment size. On loopback a connection's segments are
# 64 KiB and the kernel sizes the daemon's send buffer from them (~3 MiB taken before a write
# is refused, measured); with 536-byte segments it takes 40-170 KiB.
STALLED_RCVBUF = 4096
STALLED_MSS = 536
STALL_S = 5.0  # ~2,500 events of ~190 bytes: past what the kernel holds, the rest waits in smgd
# Another stream's longest wait for its next event while the stalled one is held up. The step
# is 2 ms; a stream that waited for the stalled client would wait most of STALL_S. Half of it
# leaves room for a loaded CI machine (beside the real engines' tests a stream in another fault
# case once waited 1.46 s for an event, with nothing wrong but the load).
OTHERS_GAP_S = STALL_S / 2


async def _stalled_client(url: str, stalled: trio.Event, resumed: trio.Event) -> bytes:
    """A streamed completion whose client reads its first event, then nothing for ``STALL_S``,
    then the rest; returns the response's dechunked body."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, STALLED_RCVBUF)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, STALLED_MSS)
    await sock.connect((host, int(port)))
    body = {"model": "m", "prompt": PROMPT, "max_tokens": TOKENS, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    async with trio.SocketStream(sock) as conn:
        await conn.send_all(post_bytes("/v1/completions", body))
        data = bytearray()
        while b"data: " not in data:
            chunk = await conn.receive_some(65536)
            assert chunk, "closed before the first event"
            data += chunk
        stalled.set()
        await trio.sleep(STALL_S)  # reads nothing: the daemon's writes back up
        resumed.set()
        while not data.endswith(b"\r\n0\r\n\r\n"):
            chunk = await conn.receive_some(65536)
            assert chunk, "the daemon closed the connection before the body ended"
            data += chunk
    head, _, raw = bytes(data).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return dechunk(raw)


async def test_a_client_that_stops_reading_gets_every_token_later_and_holds_up_nobody(
    tmp_path: Path,
) -> None:
    engine = mock_engine_toml("e0", "m", step_ms=STEP_MS) + (
        f"max_batch = {4 * OTHERS}\nmax_model_len = {2 * TOKENS}\n"  # [engines.mock]
    )
    async with serve(tmp_path, daemon_toml(engine)) as daemon, daemon.client() as client:
        stalled, resumed = trio.Event(), trio.Event()
        reference: list[str] = []  # the same completion, not streamed (never written directly)
        others = [StreamOutcome(status=0) for _ in range(OTHERS)]
        bodies: list[bytes] = []
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:

                async def stalled_one() -> None:
                    bodies.append(await _stalled_client(daemon.url, stalled, resumed))

                async def other(k: int) -> None:
                    await stream(client, "m", PROMPT, TOKENS, into=others[k])

                async def whole() -> None:
                    body = {"model": "m", "prompt": PROMPT, "max_tokens": TOKENS}
                    response = await client.post("/v1/completions", json=body)
                    reference.append(response.json()["choices"][0]["text"])

                nursery.start_soon(whole)
                nursery.start_soon(stalled_one)
                await stalled.wait()
                for k in range(OTHERS):
                    nursery.start_soon(other, k)
                await resumed.wait()
                stall_ended = trio.current_time()
        # The stalled client got every token, in order, once it read again.
        stalled_outcome = sse_outcome(bodies[0])
        assert stalled_outcome.error is None
        assert stalled_outcome.text == reference[0]
        assert stalled_outcome.usage is not None
        assert stalled_outcome.usage["completion_tokens"] == TOKENS
        assert bodies[0].endswith(b"data: [DONE]\n\n")
        # The others ran beside it throughout and never waited for it.
        for outcome in others:
            assert outcome.status == 200 and outcome.body_complete and outcome.error is None
            assert outcome.text == reference[0]
            assert outcome.usage is not None and outcome.usage["completion_tokens"] == TOKENS
            assert outcome.done
            during = [t for t in outcome.chunk_times if t <= stall_ended]
            assert len(during) > 10  # they were streaming while it stalled ...
            gaps = [b - a for a, b in itertools.pairwise(during)]
            assert max(gaps) < OTHERS_GAP_S  # ... without waiting for it
        after = await stream(client, "m", "hello again", 8)
        assert after.error is None and after.done and len(after.chunks) == 8
