"""Two smgd instances behind one upstream: drain one, traffic moves to the other, nothing fails.

Stands in for docs/how-to/two-hosts.md on loopback: two ``smgd serve`` processes (own ports,
own run_dirs, own mock engines) and, in front, a tiny round-robin HTTP proxy written here. The
proxy polls each backend's ``/readiness`` and, like nginx's ``proxy_next_upstream error http_503``,
retries a request on the next backend when the connection fails or smgd answers 503 (both
happen before any byte reached the client, and before anything reached an engine).
"""

from __future__ import annotations

import collections
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from .daemon_harness import config_text, engine_toml, stream_completion

pytestmark = pytest.mark.slow

MODEL = "m"
PROMPT = "The quick brown fox jumps over the lazy dog"
MAX_TOKENS = 20  # x 5 ms mock steps: ~0.1 s per stream, so many are in flight at the drain
WORKERS = 8
# How often the proxy re-reads /readiness: fast enough that few requests meet a draining
# backend (those are retried anyway), slow enough to be noise next to the streams.
HEALTH_PERIOD_S = 0.05

Scope = dict[str, Any]


class Body(httpx.AsyncByteStream):
    """A request body as a plain async iterator: a backend that closes the connection while it
    is being sent leaves nothing behind (httpx's own bytes stream is an async generator that
    then gets garbage-collected unfinished, a ResourceWarning)."""

    def __init__(self, data: bytes) -> None:
        self._data: bytes | None = data

    def __aiter__(self) -> Body:
        return self

    async def __anext__(self) -> bytes:
        if self._data is None:
            raise StopAsyncIteration
        data, self._data = self._data, None
        return data


class RoundRobinProxy:
    """ASGI app: forward each request to the next ready backend; stream the answer back."""

    def __init__(self, backends: list[str]) -> None:
        self.backends = backends
        self.ready = dict.fromkeys(backends, False)
        self.served: collections.Counter[str] = collections.Counter()
        self.retried = 0
        self._next = 0
        # One connection per forwarded request (nginx's default towards upstreams): a pooled
        # connection the draining backend has just closed would fail after the body was sent.
        self._client = httpx.AsyncClient(
            timeout=30, limits=httpx.Limits(max_keepalive_connections=0)
        )

    async def poll_readiness(self) -> None:
        while True:
            for backend in self.backends:
                try:
                    response = await self._client.get(f"{backend}/readiness", timeout=1)
                    self.ready[backend] = response.status_code == 200
                except httpx.TransportError:
                    self.ready[backend] = False
            await trio.sleep(HEALTH_PERIOD_S)

    def _order(self) -> list[str]:
        start = self._next
        self._next += 1
        count = len(self.backends)
        rotated = [self.backends[(start + i) % count] for i in range(count)]
        return [b for b in rotated if self.ready[b]]

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in (b"host", b"connection")]
        for backend in self._order():
            url = httpx.URL(backend + scope["path"])
            request = httpx.Request(
                scope["method"], url, headers=[(b"host", url.netloc), *headers], stream=Body(body)
            )
            try:
                response = await self._client.send(request, stream=True)
            except httpx.TransportError:  # refused, or closed before answering
                self.ready[backend] = False
                self.retried += 1
                continue
            if response.status_code == 503:  # draining or no engine: nothing reached an engine
                await response.aclose()
                self.ready[backend] = False
                self.retried += 1
                continue
            try:
                await send(
                    {
                        "type": "http.response.start",
                        "status": response.status_code,
                        "headers": [
                            (k, v)
                            for k, v in response.headers.raw
                            if k.lower() not in (b"content-length", b"transfer-encoding")
                        ],
                    }
                )
                async for chunk in response.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
            finally:
                await response.aclose()
            self.served[backend] += 1
            return
        await send({"type": "http.response.start", "status": 502, "headers": []})
        await send({"type": "http.response.body", "body": b"no ready backend"})

    async def aclose(self) -> None:
        await self._client.aclose()


async def start_smgd(tmp_path: Path, name: str) -> tuple[trio.Process, str, Path]:
    """``smgd serve`` on 127.0.0.1:0 with its own run_dir and mock engine; (proc, url, log)."""
    config = tmp_path / f"{name}.toml"
    config.write_text(config_text(engine_toml("e", MODEL, step_ms=5), drain_s=20))
    log = tmp_path / f"{name}.log"
    with log.open("wb") as stderr:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "smgd", "serve", "-c", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    prefix = "smgd listening on "
    with trio.fail_after(30):
        while not (lines := [x for x in log.read_text().splitlines() if x.startswith(prefix)]):
            assert proc.returncode is None, log.read_text()
            await trio.sleep(0.05)
    return proc, lines[0][len(prefix) :], log


# Guards the drain order: the daemon must wait for the HTTP server's graceful shutdown (the
# tail of every stream: last chunk, usage, [DONE]) before it cancels the engines. Cancelling on
# engine idleness instead failed this in about one run of four.
async def test_draining_one_host_shifts_traffic_with_no_failed_request(tmp_path: Path) -> None:
    procs: list[trio.Process] = []
    try:
        (proc_a, url_a, log_a), (proc_b, url_b, _) = [
            await start_smgd(tmp_path, name) for name in ("a", "b")
        ]
        procs = [proc_a, proc_b]
        proxy = RoundRobinProxy([url_a, url_b])
        cfg = HypercornConfig()
        cfg.bind = ["127.0.0.1:0"]
        cfg.accesslog = None
        results: list[tuple[str, int]] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(proxy.poll_readiness)
            (front,) = await nursery.start(
                partial(serve, proxy, cfg, shutdown_trigger=trio.sleep_forever)  # type: ignore[arg-type]
            )
            with trio.fail_after(30):
                while not all(proxy.ready.values()):  # noqa: ASYNC110
                    await trio.sleep(0.05)
            stop = trio.Event()

            async def worker(client: httpx.AsyncClient) -> None:
                while not stop.is_set():
                    # stream_completion fails on any non-200 status or mid-stream error event.
                    _, usage, finish = await stream_completion(client, MODEL, PROMPT, MAX_TOKENS)
                    assert usage is not None
                    results.append((str(finish), int(usage["completion_tokens"])))  # type: ignore[call-overload]

            with trio.fail_after(60):
                async with (
                    httpx.AsyncClient(base_url=front, timeout=30) as client,
                    trio.open_nursery() as workers,
                ):
                    for _ in range(WORKERS):
                        workers.start_soon(worker, client)
                    while min(proxy.served[url_a], proxy.served[url_b]) < 10:  # noqa: ASYNC110
                        await trio.sleep(0.02)
                    proc_a.send_signal(signal.SIGTERM)
                    assert await proc_a.wait() == 0, log_a.read_text()
                    a_total, b_at_exit = proxy.served[url_a], proxy.served[url_b]
                    while proxy.served[url_b] < b_at_exit + 4 * WORKERS:  # noqa: ASYNC110
                        await trio.sleep(0.02)
                    stop.set()
            nursery.cancel_scope.cancel()
        await proxy.aclose()
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert proxy.served[url_a] == a_total  # nothing reached A once it had exited
    assert proxy.served[url_b] >= b_at_exit + 4 * WORKERS
    assert len(results) == sum(proxy.served.values())
    assert results == [("length", MAX_TOKENS)] * len(results)
