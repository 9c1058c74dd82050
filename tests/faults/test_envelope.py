"""Fault suite: the real daemon answers every route, public and admin, through one envelope."""

from __future__ import annotations

import json
import tomllib
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from .harness import daemon_toml, mock_engine_toml, serve, stream

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow


def _error(response: httpx.Response) -> dict[str, Any]:
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-request-id"]
    error: dict[str, Any] = json.loads(response.content)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


async def test_the_real_daemon_answers_every_route_through_one_envelope(tmp_path: Path) -> None:
    config = daemon_toml(mock_engine_toml("e0", "m"), extra_server="max_body_bytes = 1000\n")
    async with serve(tmp_path, config) as daemon:
        async with daemon.client() as client:
            missing = await client.get("/nope", headers={"X-Request-Id": "f-1"})
            assert missing.status_code == 404 and missing.headers["x-request-id"] == "f-1"
            assert _error(missing)["type"] == "not_found_error"
            wrong = await client.get("/v1/completions")
            assert wrong.status_code == 405 and wrong.headers["allow"] == "OPTIONS, POST"
            assert _error(wrong)["type"] == "invalid_request_error"
            head = await client.head("/health")
            assert head.status_code == 200 and head.content == b""
            options = await client.options("/v1/models")
            assert options.status_code == 200 and options.headers["allow"] == "GET, HEAD, OPTIONS"
            for method, path in (("POST", "/v1/completions"), ("GET", "/health")):
                large = await client.request(method, path, content=b"x" * 1001)
                assert large.status_code == 413, (method, path)
                assert "larger than 1000 bytes" in _error(large)["message"]
            tokens = await client.post("/v1/tokenize", json={"model": "m", "prompt": "hi"})
            assert tokens.status_code == 200 and tokens.json()["count"] > 0
            done = await stream(client, "m", "hello", 3)
            assert done.error is None and done.done and len(done.chunks) == 3
            scrape = (await client.get("/metrics")).text
            assert 'route="unmatched",status="404"' in scrape
            # A 405 is counted as unmatched (the one above), not under its route.
            assert 'route="/v1/completions",status="405"' not in scrape
            unmatched = 'smgd_http_requests_total{method="GET",route="unmatched",status="405"}'
            assert f"{unmatched} 1.0\n" in scrape
            assert 'route="/health",status="413"' in scrape
            assert 'smgd_aborts_total{reason="validation"} 2.0' in scrape  # the two 413s

        # The admin listener (a unix socket in run_dir): the same envelope.
        run_dir = tomllib.loads(daemon.config_path.read_text())["run_dir"]
        transport = httpx.AsyncHTTPTransport(uds=f"{run_dir}/admin.sock")
        async with httpx.AsyncClient(transport=transport, base_url="http://smgd") as admin:
            nope = await admin.get("/admin/nope")
            assert nope.status_code == 404 and _error(nope)["type"] == "not_found_error"
            engines = await admin.get("/admin/engines")
            assert engines.status_code == 200 and engines.headers["x-request-id"]
            assert [e["name"] for e in engines.json()["engines"]] == ["e0"]
            drained = await admin.post("/admin/drain")
            assert drained.status_code == 200 and drained.json() == {"draining": True}
        assert await daemon.wait_exit(30) == 0
        assert "Traceback" not in daemon.log()
