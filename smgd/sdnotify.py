"""systemd integration: notifications, the watchdog ping, socket activation.

Notifications (READY=1, STOPPING=1, RELOADING=1, WATCHDOG=1) are non-blocking: a full socket
drops the message, so calling :func:`notify` from the trio loop can never stall it. Without
``NOTIFY_SOCKET`` it does nothing. A ``NOTIFY_SOCKET`` that cannot be used (a path over the
108-byte unix socket address limit, nobody listening, no permission) never raises: it is
logged as an error once, and notifications are dropped. :func:`watchdog` is the task that
pings ``WATCHDOG=1`` when the unit asked for a watchdog (the daemon and the workers'
supervisor each run it; a worker never does, it does not see the variables).

Socket activation (``sd_listen_fds``): systemd passes listening sockets as fds 3, 4, ... and
says so with ``LISTEN_PID`` (the pid they are meant for) and ``LISTEN_FDS`` (how many).
:func:`listen_fds` is the pure check; :func:`take_listen_fds` also removes the variables, so
the engines smgd launches never believe the sockets are theirs.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from collections.abc import Mapping

log = logging.getLogger("smgd.sdnotify")

# sd_listen_fds(3): the first passed fd is always 3 (after stdin, stdout, stderr).
SD_LISTEN_FDS_START = 3
_LISTEN_VARS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
# Linux's struct sockaddr_un.sun_path: the longest address a unix socket can have.
SUN_PATH_SIZE = 108
# NOTIFY_SOCKET values already reported unusable: once each, not at every watchdog ping.
_reported: set[str] = set()


def notify(state: str) -> bool:
    """Send one notification; True if it was sent."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if state.startswith("RELOADING=1"):
        # Type=notify-reload wants the monotonic timestamp with RELOADING=1.
        state += f"\nMONOTONIC_USEC={time.monotonic_ns() // 1000}"
    target = "\0" + address[1:] if address.startswith("@") else address  # @: abstract
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        try:
            sock.sendto(state.encode(), target)
        except BlockingIOError:
            return False  # the queue is full: drop it, as sd_notify would
        except OSError as exc:
            _report(address, exc)
            return False
    return True


def _report(address: str, exc: OSError) -> None:
    if address in _reported:
        return
    _reported.add(address)
    size = len(os.fsencode(address))
    if size > SUN_PATH_SIZE:
        reason = f"it is {size} bytes, over the {SUN_PATH_SIZE}-byte unix socket address limit"
    else:
        reason = exc.strerror or str(exc)
    log.error(
        "cannot notify systemd at NOTIFY_SOCKET=%r: %s; READY=1, WATCHDOG=1 and the other "
        "notifications are dropped (a Type=notify unit will time out waiting for READY=1)",
        address,
        reason,
    )


def watchdog_interval() -> float | None:
    """Half of WATCHDOG_USEC in seconds (systemd's advice), if a watchdog is asked for us."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and int(pid) != os.getpid()):
        return None
    return int(usec) / 2_000_000


async def watchdog(interval: float | None = None) -> None:
    """Send WATCHDOG=1 now and every ``interval`` seconds (by default
    :func:`watchdog_interval`); return at once if no watchdog is asked for (or WATCHDOG_USEC
    is 0, which would make this a busy loop)."""
    if interval is None:
        interval = watchdog_interval()
    if not interval:
        return
    while True:
        notify("WATCHDOG=1")
        await trio.sleep(interval)


def listen_fds(environ: Mapping[str, str], pid: int) -> list[int]:
    """The fds systemd passed to process ``pid``: ``[3, 4, ...]``, or ``[]`` if none are ours."""
    try:
        if int(environ.get("LISTEN_PID", "")) != pid:
            return []  # meant for another process (inherited through a fork/exec)
        count = int(environ.get("LISTEN_FDS", ""))
    except ValueError:
        return []
    return list(range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + max(count, 0)))


def take_listen_fds() -> list[int]:
    """:func:`listen_fds` for this process, then unset the variables (as sd_listen_fds(1) does)."""
    fds = listen_fds(os.environ, os.getpid())
    for name in _LISTEN_VARS:
        os.environ.pop(name, None)
    return fds
