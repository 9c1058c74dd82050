"""ipc path hygiene: stale vs live sockets, non-sockets, races, directory modes, path length."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from smgd.errors import TransportError
from smgd.ipc import (
    SUN_PATH_MAX,
    clear_stale_socket,
    ipc_endpoint,
    peer_pid,
    prepare_ipc_dir,
    prepare_ipc_endpoint,
    socket_holders,
)

Ctx = zmq.Context[zmq.Socket[bytes]]


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    context: Ctx = zmq.Context()
    yield context
    context.destroy(linger=0)


def make_stale_socket(path: Path) -> None:
    """A socket file with no listener, as a crashed process leaves behind."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))
    assert stat.S_ISSOCK(path.lstat().st_mode)


# -- clear_stale_socket ---------------------------------------------------------------------------


def test_stale_socket_file_is_removed_and_path_is_bindable(ctx: Ctx, tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    make_stale_socket(path)
    clear_stale_socket(path)
    assert not path.exists()
    sock = ctx.socket(zmq.PULL)
    sock.bind(ipc_endpoint(path))
    sock.close(linger=0)


_CRASHING_BINDER = """
import os, signal, sys, zmq
zmq.Context().socket(zmq.PULL).bind("ipc://" + sys.argv[1])
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_socket_left_by_a_killed_zmq_process_is_stale(tmp_path: Path) -> None:
    path = tmp_path / "killed.sock"
    proc = subprocess.run([sys.executable, "-c", _CRASHING_BINDER, str(path)], check=False)
    assert proc.returncode == -9
    assert stat.S_ISSOCK(path.lstat().st_mode)  # the crash left the file behind
    clear_stale_socket(path)
    assert not path.exists()


def test_live_zmq_socket_is_refused_and_keeps_working(ctx: Ctx, tmp_path: Path) -> None:
    path = tmp_path / "live.sock"
    pull = ctx.socket(zmq.PULL)
    pull.bind(ipc_endpoint(path))
    with pytest.raises(TransportError) as refused:
        clear_stale_socket(path)
    # The message names who holds it (here: this very process).
    assert str(refused.value).startswith(
        f"ipc socket '{path}' is in use by a live process: pid {os.getpid()} ("
    )
    assert stat.S_ISSOCK(path.lstat().st_mode)
    # The probe's short-lived connection did not disturb the owner.
    push = ctx.socket(zmq.PUSH)
    push.connect(ipc_endpoint(path))
    push.send(b"still here")
    pull.setsockopt(zmq.RCVTIMEO, 5000)  # a hang guard, not a sleep
    assert pull.recv() == b"still here"
    push.close(linger=0)
    pull.close(linger=0)


def test_live_unix_listener_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "plain.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(8)
        with pytest.raises(TransportError, match="live process"):
            clear_stale_socket(path)
    assert path.exists()


def test_listener_with_full_backlog_counts_as_live(tmp_path: Path) -> None:
    path = tmp_path / "busy.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(0)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as first:
            first.connect(str(path))  # fills the zero-length backlog; never accepted
            with pytest.raises(TransportError, match="live process"):
                clear_stale_socket(path)
    assert path.exists()


def test_regular_file_is_refused_and_untouched(tmp_path: Path) -> None:
    path = tmp_path / "data.sock"
    path.write_text("precious")
    with pytest.raises(TransportError, match="not a socket, refusing"):
        clear_stale_socket(path)
    assert path.read_text() == "precious"


def test_directory_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "dir.sock"
    path.mkdir()
    with pytest.raises(TransportError, match="not a socket"):
        clear_stale_socket(path)
    assert path.is_dir()


def test_missing_path_is_fine(tmp_path: Path) -> None:
    clear_stale_socket(tmp_path / "nothing.sock")
    assert not (tmp_path / "nothing.sock").exists()


def test_concurrent_unlink_counts_as_success(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "race.sock"
    make_stale_socket(path)
    real_unlink = os.unlink
    calls: list[str] = []

    def racing_unlink(target: str) -> None:
        calls.append(target)
        real_unlink(target)  # another cleaner gets there first...
        real_unlink(target)  # ...so ours finds nothing: FileNotFoundError

    monkeypatch.setattr(os, "unlink", racing_unlink)
    clear_stale_socket(path)
    assert calls == [str(path)]
    assert not path.exists()


# -- directories ----------------------------------------------------------------------------------


def test_prepare_ipc_dir_creates_private_dir_despite_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        made = prepare_ipc_dir(tmp_path / "a" / "b")
    finally:
        os.umask(old)
    assert made == tmp_path / "a" / "b"
    assert stat.S_IMODE(made.stat().st_mode) == 0o700


def test_prepare_ipc_dir_tightens_existing_dir(tmp_path: Path) -> None:
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o755)
    prepare_ipc_dir(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700


def test_prepare_ipc_dir_refuses_file_symlink_and_sticky_dir(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(TransportError, match="not a directory"):
        prepare_ipc_dir(tmp_path / "file")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(TransportError, match="not a directory"):
        prepare_ipc_dir(tmp_path / "link")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(TransportError, match="sticky"):
        prepare_ipc_dir(shared)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to another uid")
def test_prepare_ipc_dir_refuses_dir_of_another_uid(tmp_path: Path) -> None:
    d = tmp_path / "theirs"
    d.mkdir(mode=0o755)
    os.chown(d, 12345, 12345)
    with pytest.raises(TransportError, match="owned by uid 12345"):
        prepare_ipc_dir(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o755


# -- endpoints ------------------------------------------------------------------------------------


def _path_of_length(base: Path, n: int) -> Path:
    prefix = str(base) + "/"
    assert len(prefix) < n - 5
    return Path(prefix + "s" * (n - len(prefix)))


def test_sun_path_limit_matches_libzmq(ctx: Ctx, tmp_path: Path) -> None:
    longest = _path_of_length(tmp_path, SUN_PATH_MAX)
    sock = ctx.socket(zmq.PULL)
    sock.bind(ipc_endpoint(longest))  # 107 bytes: accepted by us and by libzmq
    sock.close(linger=0)
    too_long = _path_of_length(tmp_path, SUN_PATH_MAX + 1)
    with pytest.raises(TransportError, match="108 bytes, over the 107-byte"):
        ipc_endpoint(too_long)
    other = ctx.socket(zmq.PULL)
    with pytest.raises(zmq.ZMQError):
        other.bind("ipc://" + str(too_long))  # libzmq agrees it is too long
    other.close(linger=0)


def test_ipc_endpoint_format(tmp_path: Path) -> None:
    assert ipc_endpoint(tmp_path / "x.sock") == f"ipc://{tmp_path}/x.sock"
    with pytest.raises(TransportError, match="empty"):
        ipc_endpoint("")


def test_prepare_ipc_endpoint_full_flow(ctx: Ctx, tmp_path: Path) -> None:
    d = tmp_path / "run" / "engine0"
    d.mkdir(parents=True)
    path = d / "in.sock"
    make_stale_socket(path)
    endpoint = prepare_ipc_endpoint(path)
    assert endpoint == f"ipc://{path}"
    assert not path.exists()
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    sock = ctx.socket(zmq.PUSH)
    sock.bind(endpoint)
    with pytest.raises(TransportError, match="live process"):
        prepare_ipc_endpoint(path)  # the second binder is refused, the first keeps its socket
    sock.close(linger=0)


def test_prepare_ipc_endpoint_refuses_relative_path() -> None:
    with pytest.raises(TransportError, match="absolute"):
        prepare_ipc_endpoint("in.sock")


# -- who is on the other end ------------------------------------------------------------------


_LISTENER = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1]); s.listen(1)
print("up", flush=True)
sys.stdin.read()
"""


def test_socket_holders_names_the_process_listening_on_a_path(tmp_path: Path) -> None:
    path = tmp_path / "held.sock"
    with subprocess.Popen(
        [sys.executable, "-c", _LISTENER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "up\n"
            assert socket_holders(str(path)) == [holder.pid]
            with pytest.raises(TransportError, match=f"live process: pid {holder.pid} \\("):
                clear_stale_socket(path)
        finally:
            holder.kill()
    assert socket_holders(str(tmp_path / "nobody.sock")) == []


def test_peer_pid_names_the_connected_process(tmp_path: Path) -> None:
    path = tmp_path / "peer.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(1)
        with subprocess.Popen(
            [sys.executable, "-c", f"import socket, sys; s = socket.socket(socket.AF_UNIX); "
             f"s.connect({str(path)!r}); sys.stdin.read()"],
            stdin=subprocess.PIPE,
        ) as connector:  # fmt: skip
            try:
                conn, _ = listener.accept()
                with conn:
                    assert peer_pid(conn.fileno()) == connector.pid
                    os.fstat(conn.fileno())  # our fd is still open
            finally:
                connector.kill()


def test_peer_pid_of_what_is_not_a_unix_connection_is_none() -> None:
    read, write = os.pipe()
    os.close(write)
    try:
        assert peer_pid(read) is None  # not a socket
    finally:
        os.close(read)
    assert peer_pid(read) is None  # closed
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
        assert peer_pid(tcp.fileno()) is None
