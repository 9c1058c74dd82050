"""CORS in a real browser: headless Chromium loads a page from another origin whose script
calls the real daemon (with an API key and a JSON body, so every call is preflighted).

The page is served on ``PAGE_PORT``; ``http://localhost:PAGE_PORT`` is the allowed origin and
``http://127.0.0.1:PAGE_PORT`` (the same page, another origin) is not. smgd listens on
``127.0.0.1:<its port>``, a third origin. The script writes what its fetches saw into the DOM,
which Chromium dumps once the page is idle.
"""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from .faults.harness import daemon_toml, mock_engine_toml, serve
from .system_tools import require_program

pytestmark = pytest.mark.slow

KEY = "browser-key"
MODEL = "tiny"
# The page's script: each call's status, the request id it could read (Expose-Headers), and
# what it got; a call the browser blocked is its TypeError.
PAGE = """<!doctype html>
<html><head><title>cors</title></head><body><pre id="out">pending</pre><script>
const base = "@BASE@";
const headers = {"Authorization": "Bearer @KEY@", "Content-Type": "application/json"};
async function call(path, body) {
  const init = body === undefined
    ? {headers} : {method: "POST", headers, body: JSON.stringify(body)};
  try {
    const r = await fetch(base + path, init);
    const text = await r.text();
    return {status: r.status, rid: r.headers.get("X-Request-Id"), body: text};
  } catch (e) {
    return {error: e.name + ": " + e.message};
  }
}
async function run() {
  const out = {};
  out.completion = await call("/v1/completions",
    {model: "@MODEL@", prompt: "Hello", max_tokens: 4});
  out.completion_stream = await call("/v1/completions",
    {model: "@MODEL@", prompt: "Hello", max_tokens: 4, stream: true});
  out.model = await call("/v1/models/@MODEL@");
  out.chat = await call("/v1/chat/completions",
    {model: "@MODEL@", messages: [{role: "user", content: "hi"}], max_tokens: 4});
  out.chat_stream = await call("/v1/chat/completions",
    {model: "@MODEL@", messages: [{role: "user", content: "hi"}], max_tokens: 4, stream: true});
  out.unknown_model = await call("/v1/completions",
    {model: "nope", prompt: "Hello", max_tokens: 4});
  document.getElementById("out").textContent = JSON.stringify(out);
}
run();
</script></body></html>
"""


async def _serve_page(page: list[bytes], stream: trio.SocketStream) -> None:
    """Any GET: ``page[0]`` (one request per connection)."""
    async with stream:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            data += chunk
        head = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/html; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(page[0])
        )
        await stream.send_all(head + page[0])


async def _browse(chromium: str, url: str, profile: Path) -> dict[str, Any]:
    """Load ``url`` in headless Chromium; what the page's script wrote into ``#out``."""
    done = await trio.run_process(
        [
            chromium,
            "--headless=new",
            "--no-sandbox",  # the tests may run as root, where Chromium's sandbox refuses
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            f"--user-data-dir={profile}",
            # The page is dumped once this much virtual time passed with the page idle;
            # pending fetches hold virtual time, so it is not a wait on the daemon.
            "--virtual-time-budget=10000",
            "--dump-dom",
            url,
        ],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    dom = done.stdout.decode(errors="replace")
    found = re.search(r'<pre id="out">(.*?)</pre>', dom, re.S)
    assert found is not None and found.group(1) != "pending", (
        f"the page did not finish (chromium exit {done.returncode}):\n{dom[-2000:]}\n"
        f"{done.stderr.decode(errors='replace')[-2000:]}"
    )
    out: dict[str, Any] = json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    return out


def _metric(text: str, method: str, path: str, status: int) -> float:
    """One ``smgd_http_requests_total`` sample of a /metrics page (0 when absent)."""
    for line in text.splitlines():
        if (
            line.startswith("smgd_http_requests_total{")
            and f'method="{method}"' in line
            and f'route="{path}"' in line
            and f'status="{status}"' in line
        ):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_a_page_on_an_allowed_origin_calls_smgd_and_another_is_blocked(
    tmp_path: Path,
) -> None:
    chromium = require_program("chromium", "chromium")
    page: list[bytes] = [b""]
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(trio.serve_tcp, host="127.0.0.1"), partial(_serve_page, page), 0
        )
        page_port = listeners[0].socket.getsockname()[1]
        allowed = f"http://localhost:{page_port}"
        extra = f'api_keys_env = "SMGD_BROWSER_KEYS"\ncors_allowed_origins = ["{allowed}"]\n'
        config = daemon_toml(mock_engine_toml("e", MODEL, step_ms=2.0), extra_server=extra)
        async with serve(tmp_path, config, env={"SMGD_BROWSER_KEYS": KEY}) as daemon:
            html = PAGE.replace("@BASE@", daemon.url).replace("@KEY@", KEY)
            page[0] = html.replace("@MODEL@", MODEL).encode()
            seen = await _browse(chromium, f"{allowed}/", tmp_path / "profile-a")
            blocked = await _browse(
                chromium, f"http://127.0.0.1:{page_port}/", tmp_path / "profile-b"
            )
            async with daemon.client() as client:
                metrics = (await client.get("/metrics")).text
        nursery.cancel_scope.cancel()

    completion = seen["completion"]
    assert completion.get("status") == 200, seen
    assert completion["rid"], "X-Request-Id is exposed to the page"
    assert json.loads(completion["body"])["object"] == "text_completion"
    assert seen["chat"].get("status") == 200, seen
    assert json.loads(seen["chat"]["body"])["choices"][0]["message"]["role"] == "assistant"
    for name in ("chat_stream", "completion_stream"):
        streamed = seen[name]
        assert streamed.get("status") == 200, seen
        events = [e for e in streamed["body"].split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 3, streamed["body"]
    assert seen["model"].get("status") == 200, seen
    assert json.loads(seen["model"]["body"])["id"] == MODEL
    # An error is readable by the page too (the headers are on 4xx answers).
    assert seen["unknown_model"]["status"] == 404
    assert json.loads(seen["unknown_model"]["body"])["error"]["code"] == "model_not_found"
    # Every call was preflighted, without the key, and answered before the key check.
    assert _metric(metrics, "OPTIONS", "/v1/completions", 204) >= 1
    assert _metric(metrics, "OPTIONS", "/v1/chat/completions", 204) >= 1
    assert _metric(metrics, "OPTIONS", "/v1/models/{model}", 204) >= 1

    # Another origin: the browser refuses every answer to the page.
    for name, outcome in blocked.items():
        assert outcome.get("error", "").startswith("TypeError"), (name, outcome)
