"""A log sink that stops taking lines (a pipe nobody drains, a stuck journald or log shipper)
costs log lines, never requests: smgd's writer thread alone blocks on stderr."""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest
import trio

from smgd.logs import QUEUE_LINES

from .harness import (
    START_TIMEOUT_S,
    Daemon,
    StreamOutcome,
    daemon_toml,
    kill_tree,
    mock_engine_toml,
    stream_h11,
)

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow

# A per-request line is ~160 bytes, so the 64 KiB pipe holds ~400 of them: these requests
# fill the pipe and then the writer's queue (QUEUE_LINES), and leave ~1,500 more to drop.
# That is ~10 pipes' worth of lines.
REQUESTS = QUEUE_LINES + 2000
CONCURRENCY = 64
MAX_TOKENS = 4
# A stream here takes ~0.1 s (4 steps of 5 ms, and a loaded 2-core machine). One that waits
# on a blocked stderr never ends; 10 s tells the two apart on the slowest CI machine.
STREAM_BOUND_S = 10.0
# The whole batch at ~300 requests a second on a loaded 2-core machine, with room.
RUN_BOUND_S = 120.0


async def read_until(
    stderr: trio.abc.ReceiveStream, pending: bytes, wanted: bytes
) -> tuple[list[bytes], bytes]:
    """Lines of ``stderr`` up to and with the first that holds ``wanted``; and what followed."""
    lines: list[bytes] = []
    while True:
        *whole, pending = pending.split(b"\n")
        lines += whole
        for i, line in enumerate(lines):
            if wanted in line:
                rest = b"\n".join([*lines[i + 1 :], pending])
                return lines[: i + 1], rest
        data = await stderr.receive_some(1 << 16)
        if not data:
            raise AssertionError(f"stderr ended without {wanted!r}:\n" + _tail(lines))
        pending += data


def _tail(lines: list[bytes]) -> str:
    return b"\n".join(lines[-20:]).decode(errors="replace")


async def test_a_stderr_nobody_reads_costs_log_lines_not_requests(tmp_path: Path) -> None:
    config_path = tmp_path / "smgd.toml"
    # level = "info": one line per request (daemon_toml's [logging]).
    config_path.write_text(daemon_toml(mock_engine_toml("m0", "tiny-mock", step_ms=5.0)))
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "smgd", "serve", "--config", str(config_path)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert proc.stderr is not None
    try:
        # Read up to the banner, then stop reading: from here on the pipe fills and stays full.
        with trio.fail_after(START_TIMEOUT_S):
            lines, pending = await read_until(proc.stderr, b"", b"smgd listening on ")
        daemon = Daemon(proc=proc, config_path=config_path, url=lines[-1].decode().split()[-1])
        await daemon.wait_ready()

        outcomes = [StreamOutcome(status=0) for _ in range(REQUESTS)]
        slots = trio.CapacityLimiter(CONCURRENCY)
        ended = 0

        async def one(outcome: StreamOutcome) -> None:
            nonlocal ended
            async with slots:
                with trio.move_on_after(STREAM_BOUND_S) as bound:
                    await stream_h11(daemon.url, "tiny-mock", "hi", MAX_TOKENS, into=outcome)
                if bound.cancelled_caught:  # the daemon stalled: fail now, not after the rest
                    raise AssertionError(
                        f"a stream did not end within {STREAM_BOUND_S} s ({ended} of "
                        f"{REQUESTS} had ended): the daemon stalled on its stderr"
                    )
                ended += 1

        with trio.fail_after(RUN_BOUND_S):
            async with trio.open_nursery() as nursery:
                for outcome in outcomes:
                    nursery.start_soon(one, outcome)

        assert ended == REQUESTS

        for outcome in outcomes:
            assert outcome.status == 200 and outcome.body_complete and outcome.done, outcome
            assert outcome.error is None, outcome
            assert outcome.usage is not None
            assert outcome.usage["completion_tokens"] == MAX_TOKENS, outcome

        # Now read: the writer gets through, and says how many lines it dropped meanwhile.
        with trio.fail_after(30):
            lines, pending = await read_until(proc.stderr, pending, b"log line(s) dropped")
        report = lines[-1].decode()
        assert "WARNING" in report and "smgd.logs" in report, report
        dropped = int(report.split("smgd.logs: ")[1].split()[0])
        # Roughly REQUESTS - QUEUE_LINES - what the pipe held: at least a few hundred.
        assert dropped >= 100, report
        # Every request's line was written or counted: none went missing unreported.
        written = sum(b" done: " in line for line in lines)
        assert written + dropped == REQUESTS, (written, dropped)

        # A SIGTERM drains and exits 0 with its last lines written (the exit's flush).
        proc.send_signal(signal.SIGTERM)
        rest = pending
        with trio.fail_after(30):
            while data := await proc.stderr.receive_some(1 << 16):
                rest += data
            assert await proc.wait() == 0, rest.decode(errors="replace")[-2000:]
        assert b"SIGTERM: draining" in rest and b"Traceback" not in rest
    finally:
        await kill_tree(proc)
