"""HAProxy in front of two real smgd daemons: drain one under streaming load, nothing fails.

Runs ``docs/how-to/haproxy.cfg`` as it is (the doc includes the same file, checked below) with
its three addresses on loopback, in front of two ``smgd serve`` processes with mock engines.
Workers keep streaming completions through HAProxy; one smgd gets SIGTERM mid-load. Every
client request must succeed in full (HAProxy resends what the draining smgd refused with 503
or a closed listener), the streams in flight on the drained smgd must finish, that smgd must
exit 0, and everything after its exit must go to the other one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import trio

from .faults.harness import Daemon, daemon_toml, mock_engine_toml, serve, until
from .system_tools import require_program

DOCS = Path(__file__).resolve().parent.parent / "docs" / "how-to"
HAPROXY_CFG = DOCS / "haproxy.cfg"
MODEL = "m"
PROMPT = "The quick brown fox jumps over the lazy dog"
MAX_TOKENS = 32  # x 5 ms mock steps: ~0.16 s per stream, so every worker is mid-stream often
WORKERS = 32
# smgd's default settle time: HAProxy's checks (every 500 ms) see /readiness turn 503 while the
# listener still accepts, as in production; what races past them is retried on the 503.
SETTLE_S = 1.0
# Load before the SIGTERM (a few waves of 32 streams), and how many streams must finish on
# the survivor after the drained smgd exited (two waves).
LOAD_BEFORE_S = 1.0
AFTER_EXIT = 2 * WORKERS
# The drained smgd must have streams in flight when it is told to stop.
IN_FLIGHT_AT_SIGTERM = 4


@dataclass
class Outcome:
    """One streamed completion as the client saw it."""

    started: float
    ended: float = 0.0
    status: int = 0
    served_by: str = ""
    text: str = ""
    done: bool = False
    finish_reason: str | None = None
    completion_tokens: int = -1
    error: str = ""


async def stream_through(client: httpx.AsyncClient, outcome: Outcome) -> None:
    """A streamed ``/v1/completions`` read to its end; what went wrong goes into ``error``."""
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            outcome.status = response.status_code
            outcome.served_by = response.headers.get("x-served-by", "")
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    outcome.done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        outcome.error = str(chunk["error"])
                    if chunk.get("usage"):
                        outcome.completion_tokens = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices", []):
                        outcome.text += choice.get("text") or ""
                        outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
    except httpx.TransportError as exc:
        outcome.error = repr(exc)
    outcome.ended = trio.current_time()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def hostport(daemon: Daemon) -> str:
    return daemon.url.removeprefix("http://").rstrip("/")


def smgd_config() -> str:
    """One host's smgd.toml (a run_dir of its own), with the default drain settle time."""
    text = daemon_toml(mock_engine_toml("e", MODEL, step_ms=5), drain_s=20)
    return text.replace("drain_settle_s = 0.0", f"drain_settle_s = {SETTLE_S}")


def test_two_hosts_doc_includes_the_tested_haproxy_config() -> None:
    doc = (DOCS / "two-hosts.md").read_text()
    blocks = re.findall(r"```haproxy\n(.*?)```", doc, flags=re.DOTALL)
    assert blocks == [HAPROXY_CFG.read_text()]


@pytest.mark.slow
async def test_haproxy_drains_one_smgd_under_load_with_no_failed_request(tmp_path: Path) -> None:
    haproxy = require_program("haproxy", "haproxy")
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    async with (
        serve(tmp_path / "a", smgd_config()) as smgd_a,
        serve(tmp_path / "b", smgd_config()) as smgd_b,
    ):
        async with smgd_b.client() as direct:  # the echo every stream must reproduce
            reference = Outcome(started=trio.current_time())
            await stream_through(direct, reference)
        assert reference.done and reference.completion_tokens == MAX_TOKENS, reference
        lb = f"127.0.0.1:{free_port()}"
        env = {**os.environ, "LB_BIND": lb, "SMGD_A": hostport(smgd_a), "SMGD_B": hostport(smgd_b)}
        log_path = tmp_path / "haproxy.log"
        with log_path.open("wb") as log:
            lb_proc = await trio.lowlevel.open_process(
                [haproxy, "-db", "-f", str(HAPROXY_CFG)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
            )
        outcomes: list[Outcome] = []
        try:
            async with httpx.AsyncClient(base_url=f"http://{lb}", timeout=30) as client:
                seen: set[str] = set()

                async def both_hosts_answer() -> bool:
                    try:
                        response = await client.get("/v1/models")
                    except httpx.TransportError:
                        return False
                    seen.add(response.headers.get("x-served-by", ""))
                    return {"a", "b"} <= seen

                await until(both_hosts_answer, within=10)
                stop = trio.Event()

                async def worker() -> None:
                    while not stop.is_set():
                        outcome = Outcome(started=trio.current_time())
                        outcomes.append(outcome)
                        await stream_through(client, outcome)

                def in_flight_on_a() -> int:
                    return sum(1 for o in outcomes if o.served_by == "a" and not o.ended)

                with trio.fail_after(60):
                    async with trio.open_nursery() as nursery:
                        for _ in range(WORKERS):
                            nursery.start_soon(worker)
                        await trio.sleep(LOAD_BEFORE_S)

                        async def streams_on_a() -> bool:
                            return in_flight_on_a() >= IN_FLIGHT_AT_SIGTERM

                        await until(streams_on_a, within=10, poll_s=0.005)
                        smgd_a.send_signal(signal.SIGTERM)
                        sigterm_at = trio.current_time()
                        exit_code = await smgd_a.wait_exit(within=30)
                        exited_at = trio.current_time()

                        async def survivor_served_more() -> bool:
                            after = [o for o in outcomes if o.started > exited_at and o.ended]
                            return len(after) >= AFTER_EXIT

                        await until(survivor_served_more, within=30)
                        stop.set()
        finally:
            with trio.CancelScope(shield=True):
                lb_proc.terminate()
                with trio.move_on_after(5):
                    await lb_proc.wait()
                if lb_proc.returncode is None:
                    lb_proc.kill()
                    await lb_proc.wait()

    assert exit_code == 0, smgd_a.log()
    failed = [o for o in outcomes if o.status != 200 or o.error]
    assert not failed, (failed[:3], log_path.read_text()[-2000:])
    # Complete streams: the whole echo, its usage, its finish reason and [DONE]; none lost.
    for outcome in outcomes:
        assert (outcome.text, outcome.completion_tokens, outcome.finish_reason, outcome.done) == (
            reference.text,
            MAX_TOKENS,
            "length",
            True,
        ), outcome
    # The streams the drained smgd had in flight ran to their end after the SIGTERM.
    drained = [o for o in outcomes if o.served_by == "a" and o.ended > sigterm_at]
    assert len(drained) >= IN_FLIGHT_AT_SIGTERM
    # Once it had exited, everything went to the survivor (and there was load to go there).
    after = [o for o in outcomes if o.started > exited_at]
    assert len([o for o in after if o.ended]) >= AFTER_EXIT
    assert {o.served_by for o in after} == {"b"}
