"""systemd notifications (READY=1, STOPPING=1, RELOADING=1, WATCHDOG=1) in plain stdlib.

Non-blocking: a full or missing socket drops the message, so calling this from the trio loop
can never stall it. Without ``NOTIFY_SOCKET`` it does nothing.
"""

from __future__ import annotations

import os
import socket
import time


def notify(state: str) -> bool:
    """Send one notification; True if it was sent."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if state.startswith("RELOADING=1"):
        # Type=notify-reload wants the monotonic timestamp with RELOADING=1.
        state += f"\nMONOTONIC_USEC={time.monotonic_ns() // 1000}"
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        try:
            sock.sendto(state.encode(), address)
        except (BlockingIOError, ConnectionRefusedError, FileNotFoundError):
            return False
    return True


def watchdog_interval() -> float | None:
    """Half of WATCHDOG_USEC in seconds (systemd's advice), if a watchdog is asked for us."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and int(pid) != os.getpid()):
        return None
    return int(usec) / 2_000_000
