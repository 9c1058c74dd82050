"""Process plumbing for the benchmark: start servers, wait for readiness, run one load point.

A point runs the load generator as a child process (its CPU is not the server's), samples the
server's RSS while it runs, and snapshots the server's and the mock's CPU (``/proc``) before
and after. Everything is loopback and bounded in time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

import msgspec
import trio

from smgd.bench import procstat
from smgd.bench.workload import MESSAGES, TOOLS, Prompt

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path

    from smgd.bench.workload import ToolPrompt, Workload

log = logging.getLogger("smgd.bench")

# RSS is sampled this often during a point: fine enough to catch the plateau at full
# concurrency (which lasts seconds), cheap enough (one /proc read per process) not to matter.
RSS_SAMPLE_S = 0.2
# Polling interval while waiting for a server's health endpoint.
READY_POLL_S = 0.2
# After SIGTERM, how long a process gets before SIGKILL.
STOP_GRACE_S = 5.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def cmdline(pid: int) -> str:
    try:
        return (procstat.PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@dataclass
class Proc:
    """A child process started in its own session, with its output in a log file."""

    name: str
    process: trio.Process
    log_path: Path
    _log_file: IO[bytes] | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def tree(self) -> list[int]:
        return procstat.descendants(self.pid)

    def alive(self) -> bool:
        return self.process.returncode is None and self.process.poll() is None

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def stop(self) -> None:
        if self.process.poll() is None:
            _killpg(self.pid, signal.SIGTERM)
            with trio.move_on_after(STOP_GRACE_S):
                await self.process.wait()
            if self.process.poll() is None:
                _killpg(self.pid, signal.SIGKILL)
                await self.process.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def _killpg(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


async def start(
    name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str] | None = None, **kw: Any
) -> Proc:
    log_path = log_dir / f"{name}.log"
    log_file = log_path.open("ab")
    full_env = {**os.environ, **(env or {})}
    log.info("starting %s: %s", name, " ".join(argv))
    proc = await trio.lowlevel.open_process(
        list(argv),
        stdin=kw.pop("stdin", subprocess.DEVNULL),
        stdout=kw.pop("stdout", log_file),
        stderr=log_file,
        env=full_env,
        start_new_session=True,
        **kw,
    )
    return Proc(name, proc, log_path, log_file)


async def http_get_status(port: int, path: str) -> int:
    """Status code of ``GET path`` on loopback; 0 when the connection fails."""
    try:
        with trio.fail_after(2.0):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                req = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
                await stream.send_all(req.encode())
                data = await stream.receive_some(4096)
    except (OSError, trio.TooSlowError, trio.BrokenResourceError):
        return 0
    parts = data.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


async def wait_ready(proc: Proc, port: int, path: str, timeout_s: float) -> None:
    with trio.fail_after(timeout_s):
        while await http_get_status(port, path) != 200:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited during start-up:\n{proc.tail()}")
            await trio.sleep(READY_POLL_S)


@dataclass
class Measured:
    """Which processes a point charges: the server (minus the mock) and the mock."""

    server: Callable[[], list[int]]
    mock: Callable[[], list[int]]
    extra: dict[str, Any] = field(default_factory=dict)


def loadgen_spec(
    *,
    port: int,
    model: str,
    prompt: Prompt | ToolPrompt,
    workload: Workload,
    concurrency: int,
    duration_s: float | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The loadgen's spec for one point (``prompt``: the plain echo or the tools workload)."""
    duration = workload.duration_s if duration_s is None else duration_s
    if not isinstance(prompt, Prompt):
        return {
            "port": port,
            "model": model,
            "prompt_ids": [],
            "max_tokens": prompt.reply_tokens,  # the whole reply, ended by its EOS
            "concurrency": concurrency,
            "duration_s": duration,
            "max_requests": workload.max_requests(concurrency),
            "time_limit_s": workload.time_limit_s(concurrency),
            "expected_text": prompt.expected_text,
            "prefix_lens": prompt.prefix_lens,
            "extra": extra or {},
            "path": "/v1/chat/completions",
            "mode": "tools",
            "messages": MESSAGES,
            "tools": TOOLS,
            "expected_tokens": prompt.reply_tokens,
            "expected_finish": prompt.finish_reason,
            "new_connections": workload.new_connections,
        }
    return {
        "port": port,
        "model": model,
        "prompt_ids": prompt.ids,
        "max_tokens": workload.max_tokens,
        "concurrency": concurrency,
        "duration_s": duration,
        "max_requests": workload.max_requests(concurrency),
        "time_limit_s": workload.time_limit_s(concurrency),
        "expected_text": prompt.expected_text,
        "prefix_lens": prompt.prefix_lens,
        "extra": extra or {},
        "new_connections": workload.new_connections,
    }


async def run_loadgen(spec: dict[str, Any]) -> dict[str, Any]:
    argv = [sys.executable, "-m", "smgd.bench.loadgen"]
    limit = float(spec["time_limit_s"]) + 30.0  # the loadgen's own limit fires first
    with trio.fail_after(limit):
        done = await trio.run_process(
            argv,
            stdin=msgspec.json.encode(spec),
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"loadgen failed ({done.returncode}): {done.stderr.decode()[-2000:]}")
    result: dict[str, Any] = msgspec.json.decode(done.stdout)
    return result


async def _sample_rss(pids: Callable[[], list[int]], peak: list[int]) -> None:
    while True:
        peak[0] = max(peak[0], procstat.rss_kib(pids()))
        await trio.sleep(RSS_SAMPLE_S)


async def measure_http_point(spec: dict[str, Any], measured: Measured) -> dict[str, Any]:
    """Run one load point; add the server's CPU, the mock's CPU and the server's peak RSS."""
    server_pids, mock_pids = measured.server(), measured.mock()
    cpu0, mock0 = procstat.cpu_sample(server_pids), procstat.cpu_sample(mock_pids)
    peak = [procstat.rss_kib(server_pids)]
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_sample_rss, measured.server, peak)
        result = await run_loadgen(spec)
        nursery.cancel_scope.cancel()
    elapsed = trio.current_time() - t0
    server_cpu = procstat.cpu_between(cpu0, procstat.cpu_sample(measured.server()))
    result["server_cpu_s"] = round(server_cpu.seconds, 6)
    result["server_cpu_grain_s"] = server_cpu.grain_s
    mock_cpu = procstat.cpu_between(mock0, procstat.cpu_sample(measured.mock()))
    result["mock_cpu_s"] = round(mock_cpu.seconds, 6)
    result["elapsed_s"] = round(elapsed, 3)
    result["peak_rss_kib"] = peak[0]
    # The 1-minute load average after the point: other work on a shared machine skews latency.
    result["loadavg_1m"] = round(os.getloadavg()[0], 2)
    return result
