"""Fault suite: more requests than an engine's admission takes (``max_inflight``, ``max_queue``).

What a client sees: a request refused because the engine's queue is full gets a real 429 with
``Retry-After`` and the OpenAI envelope (``code: "queue_full"``), streamed or not, with one
choice or several, so a client
or a balancer retries it; the requests that were admitted or queued are served whole.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

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
