"""The real daemon's /metrics after real traffic passes ``promtool check metrics`` (Prometheus'
own linter: counter suffixes, units in names, help text, histogram shape)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import trio

from tests.system_tools import require_program

from .faults.harness import daemon_toml, mock_engine_toml, serve, stream

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow


async def test_promtool_finds_nothing_to_report(tmp_path: Path) -> None:
    promtool = require_program("promtool", "prometheus")
    config = daemon_toml(mock_engine_toml("e0", "m"))
    async with serve(tmp_path, config) as daemon, daemon.client() as client:
        # Traffic that fills every request family: streamed and not, chat, a 404, a choice
        # cut by length and one by a stop string.
        await stream(client, "m", "hello there", 8)
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        await client.post("/v1/chat/completions", json={**chat, "max_tokens": 3})
        await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stop": "x"})
        await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        reply = await client.get("/metrics")
    assert reply.status_code == 200
    text = reply.text
    for family in ("smgd_time_per_output_token_seconds", "smgd_requests_finished_total"):
        assert family in text  # the scrape holds what the linter must see
    checked = await trio.run_process(
        [promtool, "check", "metrics"], stdin=text.encode(), capture_stdout=True,
        capture_stderr=True, check=False,
    )  # fmt: skip
    report = (checked.stdout + checked.stderr).decode()
    assert checked.returncode == 0 and report.strip() == "", report
