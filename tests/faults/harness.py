"""The fault suite's harness: the real daemon as a subprocess, seen from a client.

Every case in ``tests/faults`` starts ``python -m smgd serve`` on a config written to a temp
directory, with mock engines launched by smgd itself, does something hostile to it (kills,
stops, reloads, signals, bad bodies) and checks what an HTTP client sees. Nothing here reaches
into the daemon's memory: a fault case only has the process, its stderr and its HTTP port.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import httpx
import trio

from smgd.assets import TINY_MODEL_DIR

from ..engine_harness import short_ipc_dir

# A daemon with mock engines is listening within ~1 s on an idle machine; the 2-core CI
# machine under a parallel load has taken several seconds, so the bound is generous.
START_TIMEOUT_S = 30.0
READY_POLL_S = 0.05  # how often wait_ready asks /readiness (a probe costs ~1 ms)


def mock_engine_toml(name: str, model: str, *, step_ms: float = 5.0, extra: str = "") -> str:
    """One ``[[engines]]`` entry served by a mock engine process smgd launches."""
    return (
        f'[[engines]]\nname = "{name}"\nwire = "mock"\nmodels = ["{model}"]\n'
        f'model_dir = "{TINY_MODEL_DIR}"\n{extra}'
        f"[engines.mock]\nstep_ms = {step_ms}\n"
    )


def daemon_toml(*engines: str, drain_s: float = 10.0, extra_server: str = "") -> str:
    """A whole smgd.toml: a fresh short run_dir, an OS-picked port, the given engines."""
    return (
        f'run_dir = "{short_ipc_dir()}"\n[server]\nport = 0\ndrain_timeout_s = {drain_s}\n'
        f'drain_settle_s = 0.0\n{extra_server}[logging]\nlevel = "info"\n' + "".join(engines)
    )


@dataclass
class Daemon:
    """A running ``smgd serve`` subprocess."""

    proc: trio.Process
    config_path: Path
    url: str = ""
    _stderr: list[str] = field(default_factory=list)

    def log(self) -> str:
        """Everything the daemon wrote to stderr so far."""
        return "".join(self._stderr)

    async def logged(self, text: str, within: float = 5.0) -> None:
        """Wait until the daemon's stderr holds ``text``. Its lines go out from a writer
        thread (smgd.logs), a moment after what they report: a client can see an error before
        the line saying why reaches the pipe."""

        async def found() -> bool:
            await trio.lowlevel.checkpoint()
            return text in self.log()

        await until(found, within, poll_s=0.01)

    def send_signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    async def wait_exit(self, within: float) -> int:
        with trio.fail_after(within):
            return await self.proc.wait()

    async def wait_ready(self, within: float = START_TIMEOUT_S) -> None:
        """Until ``/readiness`` answers 200."""
        async with httpx.AsyncClient(base_url=self.url, timeout=5) as client:

            async def ready() -> bool:
                try:
                    return (await client.get("/readiness")).status_code == 200
                except httpx.TransportError:
                    return False

            await until(ready, within)

    async def reload(self) -> tuple[int, str]:
        """``smgd reload -c <config>``: (exit code, its output)."""
        done = await trio.run_process(
            [sys.executable, "-m", "smgd", "reload", "-c", str(self.config_path)],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        return done.returncode, (done.stdout + done.stderr).decode(errors="replace")

    def client(self) -> httpx.AsyncClient:
        """An HTTP client on the daemon's API (use it as an async context manager)."""
        return httpx.AsyncClient(base_url=self.url, timeout=60)

    def engine_pids(self) -> list[int]:
        """Pids of the engine processes smgd launched (its mock-engine descendants)."""
        return [pid for pid in descendants(self.proc.pid) if b"mock-engine" in cmdline(pid)]


@asynccontextmanager
async def serve(
    tmp_path: Path,
    config_text: str,
    *,
    env: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
    wait_ready: bool = True,
    prefix: tuple[str, ...] = (),
    while_starting: Callable[[trio.Process], Awaitable[None]] | None = None,
) -> AsyncIterator[Daemon]:
    """Start ``smgd serve`` on ``config_text``; on exit, kill whatever is left of it.

    ``prefix``: a command that execs the daemon (``prlimit --nofile=256:``), so its pid is
    the daemon's. ``while_starting``: done to the process as soon as it runs, before its
    banner is awaited (a signal while it still starts)."""
    config_path = tmp_path / "smgd.toml"
    config_path.write_text(config_text)
    proc = await trio.lowlevel.open_process(
        [*prefix, sys.executable, "-m", "smgd", "serve", "--config", str(config_path), *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    daemon = Daemon(proc=proc, config_path=config_path)
    listening = trio.Event()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_pump_stderr, daemon, listening)
            if while_starting is not None:
                await while_starting(proc)
            with trio.fail_after(START_TIMEOUT_S):
                await listening.wait()
            if not daemon.url:
                raise AssertionError(f"smgd exited before listening:\n{daemon.log()}")
            if wait_ready:
                await daemon.wait_ready()
            yield daemon
            nursery.cancel_scope.cancel()
    finally:
        await kill_tree(proc)


async def kill_tree(proc: trio.Process) -> None:
    """Kill a daemon the case started and every process under it (shielded: a case's cleanup,
    cancelled or not): engines of a daemon the case killed are not the next case's."""
    with trio.CancelScope(shield=True):
        survivors = descendants(proc.pid)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        for pid in survivors:
            _kill(pid)


async def _pump_stderr(daemon: Daemon, listening: trio.Event) -> None:
    assert daemon.proc.stderr is not None
    pending = b""
    try:
        async for data in daemon.proc.stderr:
            pending += data
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace") + "\n"
                daemon._stderr.append(line)
                if line.startswith("smgd listening on "):
                    daemon.url = line.split()[-1]
                    listening.set()
    finally:
        listening.set()  # exited (or cancelled) without a banner: the waiter sees no url


@dataclass
class StreamOutcome:
    """What one streamed completion looked like to its client."""

    status: int
    chunks: list[str] = field(default_factory=list)
    error: dict[str, Any] | None = None
    done: bool = False
    body_complete: bool = False
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    body: bytes = b""  # a non-200 answer's body
    ended_at: float | None = None  # trio.current_time() when the body ended (or was cut)
    chunk_times: list[float] = field(default_factory=list)  # trio time each text chunk came

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    @property
    def last_chunk_at(self) -> float | None:
        """trio.current_time() when the last text chunk came."""
        return self.chunk_times[-1] if self.chunk_times else None


async def stream(
    client: httpx.AsyncClient,
    model: str,
    prompt: str,
    max_tokens: int,
    *,
    into: StreamOutcome | None = None,
    **extra: Any,
) -> StreamOutcome:
    """A streamed ``/v1/completions``, read to its end whatever happens to it.

    ``into``: an outcome the caller made beforehand, filled in as events arrive (so a case can
    wait until a stream is under way before it strikes).
    """
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    outcome = into if into is not None else StreamOutcome(status=0)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                outcome.body = await response.aread()
            else:
                async for line in response.aiter_lines():
                    _take_line(outcome, line)
            outcome.body_complete = True
    except httpx.TransportError:
        pass  # the body was cut (or never came): body_complete stays False
    outcome.ended_at = trio.current_time()
    return outcome


async def stream_h11(
    url: str, model: str, prompt: str, max_tokens: int, *, into: StreamOutcome
) -> StreamOutcome:
    """:func:`stream` on a connection of its own, read with h11 alone: hundreds at once cost
    this process little. Ending 300 streams at once took httpx's connection pool up to 2.5 s
    of this process's CPU (the daemon had written every stream's end within 35 ms), which read
    as the daemon's delay."""
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    client = h11.Connection(h11.CLIENT)
    head = h11.Request(
        method="POST",
        target="/v1/completions",
        headers=[
            ("host", host),
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
        ],
    )
    request = b"".join(
        client.send(event) or b"" for event in (head, h11.Data(data=body), h11.EndOfMessage())
    )
    outcome, pending = into, b""
    try:
        async with await trio.open_tcp_stream(host, int(port)) as conn:
            await conn.send_all(request)
            while True:
                event = client.next_event()
                if event is h11.NEED_DATA:
                    client.receive_data(await conn.receive_some(1 << 16))
                elif isinstance(event, h11.Response):
                    outcome.status = event.status_code
                elif isinstance(event, h11.Data) and outcome.status != 200:
                    outcome.body += event.data
                elif isinstance(event, h11.Data):
                    pending += event.data
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        _take_line(outcome, line.decode())
                elif isinstance(event, h11.EndOfMessage):
                    outcome.body_complete = True
                    break
                else:  # the server closed without ending the body
                    break
    except (OSError, trio.BrokenResourceError, h11.RemoteProtocolError):
        pass  # the body was cut (or never came): body_complete stays False
    outcome.ended_at = trio.current_time()
    return outcome


def sse_outcome(body: bytes) -> StreamOutcome:
    """A 200 streamed completion's whole (dechunked) SSE body, read as :func:`stream` reads
    one (its chunks' times are when this ran)."""
    outcome = StreamOutcome(status=200, body_complete=True)
    for line in body.decode().split("\n"):
        _take_line(outcome, line)
    return outcome


def _take_line(outcome: StreamOutcome, line: str) -> None:
    if not line.startswith("data: "):
        return
    if line == "data: [DONE]":
        outcome.done = True
        return
    chunk = json.loads(line[6:])
    if "error" in chunk:
        outcome.error = chunk["error"]
        return
    if chunk.get("usage"):
        outcome.usage = chunk["usage"]
    for choice in chunk.get("choices", []):
        if choice.get("text"):
            outcome.chunks.append(choice["text"])
            outcome.chunk_times.append(trio.current_time())
        outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (children, grandchildren, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # The command name (field 2) is in parentheses and may hold spaces: split after it.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """A process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _kill(pid: int) -> None:
    with suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


async def until(
    condition: Callable[[], Awaitable[bool]], within: float, poll_s: float = READY_POLL_S
) -> None:
    """Poll ``condition`` until it holds; fail after ``within`` seconds.

    The daemon is another process: nothing in this one is told when its state changes, so a
    fault case can only ask again (ASYNC110's event would need a hook inside the daemon).
    """
    with trio.fail_after(within):
        while not await condition():  # noqa: ASYNC110 - polling another process, see above
            await trio.sleep(poll_s)
