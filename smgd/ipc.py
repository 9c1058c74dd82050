"""ipc:// path hygiene: private socket directories and safe removal of stale socket files.

Why this matters: libzmq's ipc bind *unlinks whatever is at the path* before binding. Binding
over a socket file that a live engine (or another smgd) still serves silently steals the
endpoint from it, and binding over a regular file deletes that file. So before binding, smgd
calls :func:`clear_stale_socket`, which removes a socket file only when a connect probe proves
nobody is listening (a crashed predecessor left it behind), and refuses everything else.

Synchronous on purpose: each call is a few local syscalls that never block (the probe connect
is non-blocking), so callers may use them straight from trio code.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import struct
from pathlib import Path

from smgd.errors import TransportError, errno_name

__all__ = [
    "SUN_PATH_MAX",
    "check_ipc_path",
    "clear_stale_socket",
    "command_line",
    "ipc_endpoint",
    "peer_pid",
    "prepare_ipc_dir",
    "prepare_ipc_endpoint",
]

# Linux ``struct sockaddr_un.sun_path`` is 108 bytes including the terminating NUL, so a path
# may use 107; libzmq rejects longer ones (ENAMETOOLONG) and Python's connect raises
# "AF_UNIX path too long". We check up front to give an error that names the path and the fix.
SUN_PATH_MAX = 107


def check_ipc_path(path: str | os.PathLike[str]) -> str:
    """Return ``path`` as a str, or raise :class:`TransportError` if it cannot be an ipc path."""
    text = os.fspath(path)
    size = len(os.fsencode(text))
    if size == 0:
        raise TransportError("ipc path is empty")
    if size > SUN_PATH_MAX:
        raise TransportError(
            f"ipc path is {size} bytes, over the {SUN_PATH_MAX}-byte unix socket limit: "
            f"{text!r} (use a shorter ipc directory, e.g. under /run or /tmp)"
        )
    return text


def ipc_endpoint(path: str | os.PathLike[str]) -> str:
    """``ipc://<path>`` after checking the path length."""
    return "ipc://" + check_ipc_path(path)


def prepare_ipc_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` (and parents) and make it 0700, refusing one another uid owns.

    0700 because anyone who can connect to an engine's ipc sockets can submit work to it or
    read its outputs.
    """
    directory = Path(path)
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise TransportError(f"ipc directory {str(directory)!r} is not a directory") from None
    except OSError as exc:
        raise TransportError(
            f"cannot create ipc directory {str(directory)!r}: {exc.strerror} "
            "(set run_dir, or the engine's ipc_dir, to a writable place)"
        ) from None
    st = directory.lstat()  # lstat: a symlink planted in place of our directory is refused
    if not stat.S_ISDIR(st.st_mode):
        raise TransportError(f"ipc directory {str(directory)!r} is not a directory")
    if st.st_uid != os.geteuid():
        raise TransportError(
            f"ipc directory {str(directory)!r} is owned by uid {st.st_uid}, not us "
            f"(uid {os.geteuid()}); refusing to use it"
        )
    if st.st_mode & stat.S_ISVTX:
        # A sticky directory is shared by design (/tmp, /dev/shm): chmod-ing it 0700 would
        # break every other user of it, and leaving it open exposes our sockets.
        raise TransportError(
            f"ipc directory {str(directory)!r} is a shared sticky directory; "
            "use a private subdirectory of it"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        # mkdir's mode is filtered by the umask, and an existing directory keeps its mode.
        directory.chmod(0o700)
    return directory


def clear_stale_socket(path: str | os.PathLike[str]) -> None:
    """Make ``path`` free for a bind: remove it only if it is a socket nobody listens on.

    * nothing there (or removed concurrently by someone else) → done;
    * a socket with a live listener → :class:`TransportError` "in use by a live process";
    * a socket whose connect is refused → stale, unlinked;
    * anything else (file, directory, fifo...) → :class:`TransportError`, untouched.
    """
    text = check_ipc_path(path)
    try:
        st = os.lstat(text)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise TransportError(f"{text!r} exists and is not a socket, refusing to remove it")
    if _has_listener(text):
        holders = ", ".join(
            f"pid {pid} ({command_line(pid) or 'gone'})" for pid in socket_holders(text)
        )
        raise TransportError(
            f"ipc socket {text!r} is in use by a live process" + (f": {holders}" if holders else "")
        )
    # FileNotFoundError: a concurrent cleaner won the race; the path is free either way.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(text)


def _has_listener(path: str) -> bool:
    """Connect-probe a unix stream socket path. zmq ipc endpoints are plain unix stream
    listeners, so this works on them (the zmq owner sees a connection that closes at once)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # Non-blocking: a blocking connect to a listener with a full backlog would wait.
        probe.setblocking(False)
        code = probe.connect_ex(path)
    finally:
        probe.close()
    if code == 0 or code in (errno.EAGAIN, errno.EINPROGRESS):
        return True  # accepted, or a listener whose backlog is full: alive either way
    if code in (errno.ECONNREFUSED, errno.ENOENT):
        # Refused: no process holds the listening socket. ENOENT: removed under us; the
        # unlink that follows then treats the missing file as success.
        return False
    raise TransportError(
        f"cannot probe ipc socket {path!r}: {os.strerror(code)}",
        code=errno_name(code),
    )


def socket_holders(path: str) -> list[int]:
    """Pids of the processes holding a unix socket bound at ``path`` (for an error message).

    From ``/proc/net/unix`` (the socket's inode) and ``/proc/*/fd`` (who has it open); a
    process whose fds we may not read is missing from the answer.
    """
    try:
        table = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return []
    # Num RefCount Protocol Flags Type St Inode [Path]; the path (8th) may hold spaces.
    rows = (line.split(None, 7) for line in table)
    inodes = {f"socket:[{row[6]}]" for row in rows if len(row) == 8 and row[7] == path}
    if not inodes:
        return []
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and inodes.intersection(_fd_links(proc)):
            found.append(int(proc.name))
    return sorted(found)


def _fd_links(proc: Path) -> set[str]:
    links: set[str] = set()
    try:
        fds = list((proc / "fd").iterdir())
    except OSError:
        return links  # gone, or not ours to look at
    for fd in fds:
        with contextlib.suppress(OSError):  # closed while we looked
            links.add(os.readlink(fd))
    return links


def command_line(pid: int) -> str:
    """``pid``'s command line, for an error message (empty if it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


# struct ucred {pid_t pid; uid_t uid; gid_t gid;}: what SO_PEERCRED returns.
_UCRED = struct.Struct("3i")


def peer_pid(fd: int) -> int | None:
    """The process at the other end of the unix socket connection ``fd`` (a zmq socket
    monitor's ``accepted`` value), or None: not a unix socket, already closed, or unknown.

    The kernel records the peer when it connects (``SO_PEERCRED``). Best effort: by the time
    a monitor event is read, the fd may have been closed, or even reused.
    """
    try:
        # A duplicate: closing our socket object must leave zmq's fd alone.
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    with sock:
        if sock.family != socket.AF_UNIX:
            return None
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        except OSError:
            return None
    pid = _UCRED.unpack(raw)[0]
    return pid if pid > 0 else None


def prepare_ipc_endpoint(path: str | os.PathLike[str]) -> str:
    """All of the above for one socket path: private parent dir, stale file cleared; returns
    the ``ipc://`` endpoint to bind."""
    text = check_ipc_path(path)
    if not os.path.isabs(text):
        # The parent directory gets chmod 0700; never do that to whatever the cwd is.
        raise TransportError(f"ipc socket path must be absolute: {text!r}")
    prepare_ipc_dir(Path(text).parent)
    clear_stale_socket(text)
    return "ipc://" + text
