"""Which worker this process is (``server.workers = N``), read from its environment.

A leaf: the supervisor (:mod:`smgd.workers`) writes :data:`WORKER_ENV` and
:data:`WORKER_FDS_ENV` into each worker's environment; the daemon, the reload, the public
listener and the metrics peers read them here, so none of them imports the supervisor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from collections.abc import Mapping

    from smgd.config import Config

__all__ = [
    "WORKER_ENV",
    "WORKER_FDS_ENV",
    "WORKER_STARTED_FD_ENV",
    "Worker",
    "current_worker",
    "for_worker",
    "report_started",
    "worker_listen_fds",
]

WORKER_ENV = "SMGD_WORKER"  # "k/N" in a worker's environment
WORKER_FDS_ENV = "SMGD_WORKER_FDS"  # its listening fds, comma-separated
# The write end of a pipe the supervisor reads: one byte once the worker serves, or the end of
# the pipe (the worker died) before that. How the supervisor tells a worker that could not start
# (it exits, as one process would) from one that crashed later (it is restarted).
WORKER_STARTED_FD_ENV = "SMGD_WORKER_STARTED_FD"


@dataclass(frozen=True, slots=True)
class Worker:
    index: int
    count: int


def current_worker(environ: Mapping[str, str] | None = None) -> Worker | None:
    """This process's place among the workers, or None outside worker mode."""
    raw = (os.environ if environ is None else environ).get(WORKER_ENV)
    if not raw:
        return None
    index, _, count = raw.partition("/")
    worker = Worker(int(index), int(count))
    if not 0 <= worker.index < worker.count:
        raise ValueError(f"{WORKER_ENV}={raw!r}: index out of range")
    return worker


def worker_listen_fds(environ: Mapping[str, str] | None = None) -> list[int]:
    """The public listening fds the supervisor passed this worker ([] outside worker mode)."""
    raw = (os.environ if environ is None else environ).get(WORKER_FDS_ENV, "")
    return [int(fd) for fd in raw.split(",") if fd]


def report_started() -> None:
    """In a worker that now serves: tell the supervisor (once; nothing outside worker mode)."""
    raw = os.environ.pop(WORKER_STARTED_FD_ENV, "")
    if not raw:
        return
    fd = int(raw)
    try:
        os.write(fd, b"1")
    except OSError:
        pass  # the supervisor is gone: the worker's own watch drains it (smgd.workers)
    finally:
        os.close(fd)


def for_worker(config: Config, worker: Worker | None = None) -> Config:
    """The config as worker ``k`` runs it: only its share of the engines (i % N == k)."""
    worker = current_worker() if worker is None else worker
    if worker is None:
        return config
    mine = [e for i, e in enumerate(config.engines) if i % worker.count == worker.index]
    return msgspec.structs.replace(config, engines=mine)
