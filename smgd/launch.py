"""Child processes smgd starts and supervises: engines (SGLang, vLLM, TokenSpeed) and the mock.

A :class:`Child` runs in its own session (process group) so stopping it stops the engine's
whole tree (SGLang's launcher forks the scheduler). Its stdout/stderr lines are logged with an
``[engine]`` prefix; a line ``SMGD_READY {json}`` on stdout is the launcher's report of what the
engine said at start-up (context length, KV size) and is kept as :attr:`Child.ready_info`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from smgd.errors import TransportError

if TYPE_CHECKING:
    from collections.abc import Sequence

log = logging.getLogger("smgd.launch")

READY_PREFIX = "SMGD_READY "
# After SIGTERM, how long a child gets to exit before SIGKILL. SGLang's scheduler shuts its
# process tree down in well under a second; 5 s leaves room for a busy engine.
TERMINATE_GRACE_S = 5.0
LAUNCHERS_DIR = Path(__file__).parent / "launchers"
_DAEMON_ONLY_ENV = frozenset(
    {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"}
)


class Child:
    def __init__(self, name: str, proc: trio.Process) -> None:
        self.name = name
        self.proc = proc
        self.ready_info: dict[str, Any] | None = None
        self.ready_event = trio.Event()
        self.exited = trio.Event()
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def _pump(self, stream: trio.abc.ReceiveStream, label: str) -> None:
        buffer = b""
        async for chunk in stream:
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for raw in lines:
                self._line(raw.decode(errors="replace").rstrip(), label)
        if buffer:
            self._line(buffer.decode(errors="replace").rstrip(), label)

    def _line(self, line: str, label: str) -> None:
        if label == "stdout" and line.startswith(READY_PREFIX):
            try:
                self.ready_info = json.loads(line[len(READY_PREFIX) :])
            except json.JSONDecodeError:
                log.warning("[%s] unreadable ready line: %s", self.name, line)
            self.ready_event.set()
            return
        log.info("[%s] %s", self.name, line)

    async def wait(self) -> int:
        code = await self.proc.wait()
        self.returncode = code
        self.exited.set()
        return code

    async def stop(self, grace: float = TERMINATE_GRACE_S) -> None:
        """SIGTERM the child itself, SIGKILL its whole process group after ``grace`` seconds.

        Only the leader gets SIGTERM: engines shut their own workers down in order (a vLLM
        engine core whose worker was killed first exits 1 with a traceback). The group kill
        afterwards makes sure nothing of the tree survives.
        """
        if self.proc.returncode is not None:
            _signal_group(self.proc.pid, signal.SIGKILL)  # stragglers of an exited leader
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)
        with trio.move_on_after(grace):
            await self.proc.wait()
        _signal_group(self.proc.pid, signal.SIGKILL)  # anything of the tree still alive
        await self.proc.wait()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


async def spawn(
    nursery: trio.Nursery,
    name: str,
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
) -> Child:
    """Start ``argv`` in its own session; pump its output into the log from ``nursery``."""
    # systemd's notify/watchdog/socket-activation variables are smgd's own: an engine that
    # inherited them could send READY=1 for smgd or grab the passed listening sockets.
    full_env = {k: v for k, v in os.environ.items() if k not in _DAEMON_ONLY_ENV}
    if env:
        full_env.update(env)
    log.info("[%s] launching: %s", name, " ".join(argv))
    try:
        proc = await trio.lowlevel.open_process(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=full_env,
            start_new_session=True,
        )
    except OSError as exc:
        raise TransportError(f"engine {name}: cannot launch {argv[0]!r}: {exc.strerror}") from None
    child = Child(name, proc)
    assert proc.stdout is not None
    assert proc.stderr is not None
    nursery.start_soon(child._pump, proc.stdout, "stdout")
    nursery.start_soon(child._pump, proc.stderr, "stderr")
    return child


def mock_argv(wire: str, input_addr: str, output_addr: str, extra: Sequence[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "smgd",
        "mock-engine",
        "--wire",
        wire,
        "--input",
        input_addr,
        "--output",
        output_addr,
        *extra,
    ]


def launcher_script(name: str) -> str:
    return str(LAUNCHERS_DIR / name)
