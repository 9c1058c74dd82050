"""Fault suite: more requests than an engine's admission takes (``max_inflight``, ``max_queue``).

What a client sees: a request refused because the engine's queue is full gets a real 429 with
``Retry-After`` and the OpenAI envelope (``code: "queue_full"``), streamed or not, with one
choice or several, however smgd reads the request (its fast path, or h11 for a chunked body,
``Expect: 100-continue`` or HTTP/1.0), so a client or a balancer retries it; the requests that
were admitted or queued are served whole.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import h11
import httpx
import pytest
import trio

from ..http_helpers import post_bytes
from .harness import StreamOutcome, daemon_toml, mock_engine_toml, serve, stream, until

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow

LIMITS = "max_inflight = 2\nmax_queue = 1\nqueue_timeout_s = 60.0\n"
TOKENS = 60  # 60 steps of 20 ms: the admitted streams hold their slots ~1.2 s


async def test_a_full_queue_answers_429_streamed_or_not_and_serves_the_admitted(
    tmp_path: Path,
) -> None:
    engine = mock_engine_toml("e", "m", step_ms=20.0, extra=LIMITS)
    async with serve(tmp_path, daemon_toml(engine)) as daemon, daemon.client() as client:
        held = [StreamOutcome(status=0) for _ in range(3)]  # 2 in flight, 1 queued
        async with trio.open_nursery() as nursery:
            for outcome in held:
                nursery.start_soon(_run, client, outcome)
                await trio.sleep(0.05)  # in this order: the third one queues

            async def full() -> bool:
                metrics = (await client.get("/metrics")).text
                return (
                    re.search(r'smgd_engine_queue_depth\{engine="e",[^}]*\} 1\.0', metrics)
                    is not None
                )

            await until(full, 10)
            # n = 2 is a stream of two engine requests, merged: refused alike.
            for streamed, n in ((True, 1), (False, 1), (True, 2), (False, 2), (True, 1)):
                body = {"model": "m", "prompt": "x", "max_tokens": 4, "stream": streamed, "n": n}
                refused = await client.post("/v1/completions", json=body)
                assert refused.status_code == 429, refused.text
                assert refused.headers["retry-after"] == "1"
                assert refused.headers["content-type"].startswith("application/json")
                error = refused.json()["error"]
                assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
            # HTTP/1.0, as nginx proxies by default: h11 reads it and writes a head as soon
            # as it is given one, and no event is written directly. Refused alike.
            answer = await _http10(daemon.url, {**body, "stream": True, "n": 1})
            head, _, whole = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 429 "), answer
            assert b"\r\nretry-after: 1\r\n" in head.lower() + b"\r\n"
            assert json.loads(whole)["error"]["code"] == "queue_full"
        for outcome in held:
            assert outcome.status == 200 and outcome.error is None and outcome.done
            assert outcome.usage is not None and outcome.usage["completion_tokens"] == TOKENS
        assert "Traceback" not in daemon.log()


async def _http10(url: str, body: dict[str, Any]) -> bytes:
    """POST ``body`` as HTTP/1.0 and read the answer to its end (the server closes)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    request = post_bytes("/v1/completions", body).replace(b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", 1)
    answer = bytearray()
    with trio.fail_after(10):
        async with await trio.open_tcp_stream(host, int(port)) as conn:
            await conn.send_all(request)
            while chunk := await conn.receive_some():
                answer += chunk
    return bytes(answer)


async def _run(client: httpx.AsyncClient, into: StreamOutcome) -> None:
    await stream(client, "m", "the quick brown fox", TOKENS, into=into)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "the quick brown fox"}]}


async def test_a_stream_h11_reads_is_refused_with_429_or_streams_once_the_slot_is_free(
    tmp_path: Path,
) -> None:
    # A chunked request body or Expect: 100-continue is read by hypercorn's h11, which writes
    # a response head as soon as it is given one, while the engine's reader writes the events
    # past it: the head is held for the first event there too, so a stream refused before it
    # is a real 429 with the envelope, and one that runs streams as on the fast path.
    engine = mock_engine_toml("e", "m", step_ms=20.0, extra="max_inflight = 1\nmax_queue = 0\n")
    async with serve(tmp_path, daemon_toml(engine)) as daemon, daemon.client() as client:
        holder = StreamOutcome(status=0)  # holds the engine's one slot
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_hold, client, holder)

            async def under_way() -> bool:
                assert holder.status in (0, 200), holder.body
                return bool(holder.chunks)

            await until(under_way, 10)
            for expect in (False, True):
                body = {**CHAT, "max_tokens": 4, "stream": True}
                status, headers, whole = await _chat_over_h11(daemon.url, body, expect=expect)
                assert status == 429, (expect, whole)
                assert headers[b"retry-after"] == b"1"
                assert headers[b"content-type"] == b"application/json"
                assert headers[b"x-request-id"]
                assert b"transfer-encoding" not in headers
                error = json.loads(whole)["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
            nursery.cancel_scope.cancel()  # the holder hangs up: its engine request is aborted

        async def free() -> bool:
            metrics = (await client.get("/metrics")).text
            pattern = r'smgd_engine_requests_inflight\{engine="e",[^}]*\} 0\.0'
            return re.search(pattern, metrics) is not None

        await until(free, 10)
        body = {**CHAT, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
        status, headers, whole = await _chat_over_h11(daemon.url, body, expect=False)
        assert status == 200, whole
        assert headers[b"content-type"].startswith(b"text/event-stream")
        events = [json.loads(line[6:]) for line in whole.split(b"\n") if line[:7] == b"data: {"]
        assert whole.endswith(b"data: [DONE]\n\n")
        assert not any("error" in event for event in events), events
        assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == "length"
        assert events[-1]["usage"]["completion_tokens"] == 6
        assert "Traceback" not in daemon.log()


async def _hold(client: httpx.AsyncClient, into: StreamOutcome) -> None:
    await stream(client, "m", "the quick brown fox", 1000, into=into)  # 20 s of steps


async def _chat_over_h11(
    url: str, body: dict[str, Any], *, expect: bool
) -> tuple[int, dict[bytes, bytes], bytes]:
    """POST ``body`` to ``/v1/chat/completions`` with a chunked body, or with a
    Content-Length and ``Expect: 100-continue`` (the body sent once the interim 100 came);
    (status, headers, whole dechunked body), read by h11's client (a strict reader)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    headers = [("host", host), ("content-type", "application/json")]
    if expect:
        headers += [("expect", "100-continue"), ("content-length", str(len(payload)))]
    else:
        headers.append(("transfer-encoding", "chunked"))
    client = h11.Connection(h11.CLIENT)
    status, answer, whole = 0, {}, bytearray()
    with trio.fail_after(10):
        async with await trio.open_tcp_stream(host, int(port)) as conn:
            request = h11.Request(method="POST", target="/v1/chat/completions", headers=headers)
            await conn.send_all(client.send(request) or b"")
            if not expect:  # in two chunks, as a client that streams its upload
                half = len(payload) // 2
                await conn.send_all(client.send(h11.Data(data=payload[:half])) or b"")
                await conn.send_all(client.send(h11.Data(data=payload[half:])) or b"")
                await conn.send_all(client.send(h11.EndOfMessage()) or b"")
            while True:
                event = client.next_event()
                if event is h11.NEED_DATA:
                    client.receive_data(await conn.receive_some(65536))
                elif isinstance(event, h11.InformationalResponse):
                    assert expect and event.status_code == 100, event
                    await conn.send_all(client.send(h11.Data(data=payload)) or b"")
                    await conn.send_all(client.send(h11.EndOfMessage()) or b"")
                elif isinstance(event, h11.Response):
                    status, answer = event.status_code, dict(event.headers)
                elif isinstance(event, h11.Data):
                    whole += event.data
                elif isinstance(event, h11.EndOfMessage):
                    return status, answer, bytes(whole)
                else:
                    raise AssertionError(f"unexpected {event!r}")
