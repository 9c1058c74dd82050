"""systemd socket activation: the public listener serves the fds systemd passed (fd://3...)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from smgd.api.http.server import public_binds
from smgd.config import ServerConfig
from smgd.sdnotify import listen_fds, take_listen_fds

from .daemon_harness import config_text, engine_toml


def test_fds_are_ours_only_when_listen_pid_is_this_process() -> None:
    env = {"LISTEN_PID": "1234", "LISTEN_FDS": "2"}
    assert listen_fds(env, 1234) == [3, 4]
    assert listen_fds(env, 4321) == []  # inherited from a parent: not ours


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"LISTEN_PID": "77"},
        {"LISTEN_PID": "77", "LISTEN_FDS": "0"},
        {"LISTEN_PID": "77", "LISTEN_FDS": "x"},
        {"LISTEN_PID": "", "LISTEN_FDS": "1"},
    ],
)
def test_no_usable_activation_means_no_fds(env: dict[str, str]) -> None:
    assert listen_fds(env, 77) == []


def test_binds_prefer_activated_fds_over_host_and_port() -> None:
    server = ServerConfig(host="0.0.0.0", port=9000)
    assert public_binds(server, [3]) == ["fd://3"]
    assert public_binds(server, [3, 4]) == ["fd://3", "fd://4"]
    assert public_binds(server) == ["0.0.0.0:9000"]
    assert public_binds(ServerConfig(host="::1", port=9)) == ["[::1]:9"]


def test_take_unsets_the_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LISTEN_PID", str(os.getpid()))
    monkeypatch.setenv("LISTEN_FDS", "1")
    monkeypatch.setenv("LISTEN_FDNAMES", "http")
    assert take_listen_fds() == [3]
    assert not {"LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"} & set(os.environ)
    assert take_listen_fds() == []


# What systemd does between fork and exec: move the socket to fd 3, set LISTEN_PID to the
# process's own pid (exec keeps it), and exec the service.
_EXEC_ACTIVATED = """
import os, sys
fd = int(sys.argv[1])
os.dup2(fd, 3)
os.close(fd)
os.environ["LISTEN_PID"] = str(os.getpid())
os.environ["LISTEN_FDS"] = "1"
os.execv(sys.executable, [sys.executable, "-m", "smgd", "serve", "-c", sys.argv[2]])
"""


async def test_smgd_serves_the_socket_systemd_passed(tmp_path: Path) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    path = tmp_path / "smgd.toml"
    # server.port = 0 in the file: if smgd bound host:port instead, nothing would answer `port`.
    path.write_text(config_text(engine_toml("e", "m", step_ms=1)))
    log = tmp_path / "stderr.log"
    with log.open("wb") as stderr:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-c", _EXEC_ACTIVATED, str(listener.fileno()), str(path)],
            pass_fds=(listener.fileno(),),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    listener.close()  # the child owns it now; a refused connect would mean it was not served
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            with trio.fail_after(30):
                while (await client.get("/readiness")).status_code != 200:  # noqa: ASYNC110
                    await trio.sleep(0.1)
            models = (await client.get("/v1/models")).json()
            assert [card["id"] for card in models["data"]] == ["m"]
        proc.send_signal(15)
        with trio.fail_after(30):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    # "smgd listening on ..." names the passed socket's address.
    assert f"smgd listening on http://127.0.0.1:{port}" in log.read_text()
