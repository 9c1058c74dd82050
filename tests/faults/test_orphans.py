"""Fault suite: smgd is SIGKILLed with a launched engine; started again on the same config.

No engine outlives smgd (the kernel kills it at once), and an engine left in the run
directory by an smgd that is gone is killed before the new sockets are bound; one another
live smgd runs there is refused with a message naming it. What a client then sees: ready
again, and serving.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import msgspec
import pytest
import trio

from smgd.launch import PID_FILE, PidRecord, proc_stat
from smgd.launchers.lifeline import PARENT_ENV

from .harness import alive, daemon_toml, mock_engine_toml, serve, stream, until

pytestmark = pytest.mark.slow

# The kernel's death signal ends the engine within milliseconds of smgd's death; 2 s is the
# bound the issue asks for, with room for a loaded machine.
ENGINE_GONE_WITHIN_S = 2.0


def _run_dir(config: str) -> str:
    first = config.splitlines()[0]
    assert first.startswith("run_dir = ")
    return first.split('"')[1]


async def _all_gone(pids: list[int]) -> bool:
    return not any(alive(pid) for pid in pids)


async def _serves(client: httpx.AsyncClient) -> None:
    outcome = await stream(client, "m", "after the restart", 8)
    assert outcome.status == 200 and outcome.error is None
    assert outcome.done and len(outcome.chunks) == 8


@pytest.mark.parametrize("wire", ["sglang", "vllm"])
async def test_smgd_kill9_takes_its_engine_along_and_a_restart_serves(
    tmp_path: Path, wire: str
) -> None:
    config = daemon_toml(mock_engine_toml("e0", "m") + f'wire = "{wire}"\n')
    async with serve(tmp_path, config) as daemon:
        engines = daemon.engine_pids()
        assert len(engines) == 1
        # Started through the lifeline, so the mock does not watch its parent itself (as no
        # real engine does): only the kernel's death signal can end it when smgd dies.
        assert f"{PARENT_ENV}={engines[0]}".encode() in _environ(engines[0])
        daemon.send_signal(signal.SIGKILL)
        await daemon.wait_exit(5)
        killed_at = trio.current_time()
        try:
            await until(lambda: _all_gone(engines), ENGINE_GONE_WITHIN_S)
        except BaseException:  # a failed case must not leave an orphan behind for the next
            for pid in filter(alive, engines):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            raise
        assert trio.current_time() - killed_at < ENGINE_GONE_WITHIN_S
    # Same config, same run_dir, same socket paths: nothing of the first run is in the way.
    async with serve(tmp_path, config) as again, again.client() as client:
        assert again.engine_pids() != engines
        await _serves(client)


def _planted(ipc_dir: Path, engine: int, smgd: int, smgd_start: int | None = None) -> None:
    """Write the pid file an smgd (``smgd``) would have written for ``engine``."""
    stat = proc_stat(engine)
    assert stat is not None
    if smgd_start is None:
        smgd_stat = proc_stat(smgd)
        assert smgd_stat is not None
        smgd_start = smgd_stat.start
    record = PidRecord(
        engine="e0",
        pid=engine,
        start=stat.start,
        smgd_pid=smgd,
        smgd_start=smgd_start,
        command=" ".join(_cmdline(engine)),
    )
    (ipc_dir / PID_FILE).write_bytes(msgspec.json.encode(record))


def _environ(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().rstrip("\0").split("\0")


def _leftover_mock(ipc_dir: Path) -> subprocess.Popen[bytes]:
    """A live mock engine connected (ZMQ keeps reconnecting) to the engine's socket paths."""
    ipc_dir.mkdir(mode=0o700, parents=True)
    return subprocess.Popen(
        [sys.executable, "-m", "smgd", "mock-engine", "--wire", "sglang",
         "--input", f"ipc://{ipc_dir}/in.sock", "--output", f"ipc://{ipc_dir}/out.sock"],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _gone_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _sleepers() -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]:
    """Stand-ins for another live smgd and the engine it runs (in its own session)."""
    return subprocess.Popen(["sleep", "60"]), subprocess.Popen(
        ["sleep", "60"], start_new_session=True
    )


async def test_a_leftover_engine_in_the_run_dir_is_killed_before_binding(tmp_path: Path) -> None:
    # What an smgd without the death signal left behind: a live engine connected to the
    # socket paths, and its pid file naming an smgd that is gone.
    config = daemon_toml(mock_engine_toml("e0", "m"))
    ipc_dir = Path(_run_dir(config)) / "e0"
    leftover = _leftover_mock(ipc_dir)
    gone_smgd = _gone_pid()
    try:
        _planted(ipc_dir, leftover.pid, gone_smgd, smgd_start=1)
        async with serve(tmp_path, config) as daemon, daemon.client() as client:
            assert leftover.poll() == -signal.SIGKILL
            assert (
                f"engine e0: killing 1 process(es) of an engine left running by smgd pid "
                f"{gone_smgd}, which is gone: pid {leftover.pid}"
            ) in daemon.log()
            await _serves(client)
    finally:
        if leftover.poll() is None:
            leftover.kill()
        leftover.wait()


async def test_an_engine_another_live_smgd_runs_in_the_run_dir_is_refused(
    tmp_path: Path,
) -> None:
    config = daemon_toml(mock_engine_toml("e0", "m"))
    ipc_dir = Path(_run_dir(config)) / "e0"
    ipc_dir.mkdir(mode=0o700, parents=True)
    other_smgd, its_engine = _sleepers()
    try:
        _planted(ipc_dir, its_engine.pid, other_smgd.pid)
        path = tmp_path / "smgd.toml"
        path.write_text(config)
        with trio.fail_after(30):
            done = await trio.run_process(
                [sys.executable, "-m", "smgd", "serve", "--config", str(path)],
                capture_stderr=True,
                check=False,
            )
        assert done.returncode == 1
        assert (
            f"engine e0: {ipc_dir} is in use by another smgd (pid {other_smgd.pid}), which "
            f"runs engine pid {its_engine.pid} there; stop that smgd or give this one another "
            "run_dir"
        ) in done.stderr.decode()
        assert its_engine.poll() is None, "another smgd's engine is not ours to kill"
    finally:
        for proc in (other_smgd, its_engine):
            proc.kill()
            proc.wait()


_HOLDER = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1]); s.listen(1)
print("up", flush=True)
sys.stdin.read()
"""


def _socket_holder(path: Path) -> subprocess.Popen[str]:
    """A live process bound to ``path`` (no pid file: not an engine smgd launched)."""
    path.parent.mkdir(mode=0o700, parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline() == "up\n"
    return holder


async def test_a_live_process_bound_to_an_engine_socket_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    config = daemon_toml(mock_engine_toml("e0", "m"))
    sock = Path(_run_dir(config)) / "e0" / "in.sock"
    with _socket_holder(sock) as holder:
        try:
            path = tmp_path / "smgd.toml"
            path.write_text(config)
            with trio.fail_after(30):
                done = await trio.run_process(
                    [sys.executable, "-m", "smgd", "serve", "--config", str(path)],
                    capture_stderr=True,
                    check=False,
                )
            assert done.returncode == 1
            assert (
                f"ipc socket '{sock}' is in use by a live process: pid {holder.pid} ("
            ) in done.stderr.decode()
            assert holder.poll() is None, "smgd never steals or kills a live socket's owner"
        finally:
            holder.kill()
