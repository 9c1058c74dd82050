"""Tie a launched engine's processes to the life of smgd: none of them outlives it.

smgd starts every engine through this file, run with smgd's own Python::

    python -I -S lifeline.py PARENT_PID -- PROGRAM [ARGS...]

It asks the kernel to SIGKILL this process when its parent dies (``PR_SET_PDEATHSIG``),
checks that the parent is still PARENT_PID (it may have died before the request, and then
no signal would ever come), and ``exec``s PROGRAM. The request survives the exec, so the
engine process itself holds it, whatever PROGRAM is (a launcher, the mock, any command).

The kernel fires it when the *thread* that started the process ends, not when the process
does, so smgd starts engines from its event loop's thread, which lives as long as smgd. It
is also cleared in the child of every fork, so an engine's own children need their own tie:
the engine launchers next to this file (run with the engine's Python, where smgd is not
installed) import it as ``lifeline`` and call :func:`tie_children` at import, which makes
every child they start, through ``multiprocessing`` or ``os.fork``, run :func:`hold_parent`.
That one watches the parent *process* (a pidfd from a daemon thread), because those children
may be started from any thread. Standard library only, on purpose.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
from typing import NoReturn

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Each process that ties its children names itself here, so a child can tell whether the
# parent it finds is still the one that started it (or whoever adopted it after its death).
PARENT_ENV = "SMGD_LIFELINE_PARENT"
# How often a child checks its parent where pidfds are unavailable (Linux < 5.3): an orphan
# lingers at most this long.
POLL_S = 0.5
EXIT_PARENT_GONE = 70  # EX_SOFTWARE: the parent died before the engine could start
EXIT_EXEC_FAILED = 127  # the shell's "command not found"


def set_death_signal(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when the thread that forked it ends."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")


def _die() -> NoReturn:
    # SIGKILL, not an exit: a child may be deep in native code with threads of its own, and
    # nothing it would do on the way out is worth doing without its parent.
    os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit(EXIT_PARENT_GONE)  # not reached


def hold_parent() -> None:
    """In a child process: die when the process that started it is gone.

    Dies at once if that happened already (the process found as parent is not the one
    recorded in :data:`PARENT_ENV`). Then marks this process as the parent of its own
    children, so a grandchild that ties itself checks against us.
    """
    parent = os.getppid()
    expected = os.environ.get(PARENT_ENV)
    if parent == 1 or (expected and expected.isdigit() and int(expected) != parent):
        _die()
    os.environ[PARENT_ENV] = str(os.getpid())
    threading.Thread(target=_watch, args=(parent,), name="smgd-lifeline", daemon=True).start()


def _watch(parent: int) -> None:
    try:
        pidfd = os.pidfd_open(parent)
    except ProcessLookupError:
        _die()
    except OSError:  # no pidfds here: poll
        while os.getppid() == parent:
            threading.Event().wait(POLL_S)
        _die()
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)  # readable once the whole process has exited
    while not poller.poll():
        pass
    _die()


def tie_children() -> None:
    """Make every child this process starts die with it (see the module docstring)."""
    os.environ[PARENT_ENV] = str(os.getpid())
    # A fork copies this registration, so grandchildren forked by a forked child are tied too.
    os.register_at_fork(after_in_child=hold_parent)


def exec_tied(parent: int, argv: list[str]) -> NoReturn:
    """The launch shim: take the death signal, check the parent, become ``argv``."""
    set_death_signal()
    if os.getppid() != parent:
        print(f"[lifeline] smgd (pid {parent}) is gone; not starting", file=sys.stderr)
        sys.exit(EXIT_PARENT_GONE)
    os.environ[PARENT_ENV] = str(os.getpid())  # the engine (same pid after exec) is the parent
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        print(f"[lifeline] cannot start {argv[0]!r}: {exc.strerror}", file=sys.stderr)
        sys.exit(EXIT_EXEC_FAILED)


def main(argv: list[str]) -> NoReturn:
    if len(argv) < 3 or not argv[0].isdigit() or argv[1] != "--":
        print("usage: lifeline.py PARENT_PID -- PROGRAM [ARGS...]", file=sys.stderr)
        sys.exit(2)
    exec_tied(int(argv[0]), argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
