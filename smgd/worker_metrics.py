"""``/metrics`` over every worker: one scrape of the public port describes the whole daemon.

With ``server.workers = N`` the kernel hands each connection to one worker, so a worker's own
registry is only its share (its engines, its requests). The supervisor therefore binds one
private unix socket per worker in a directory of its own (mode 0700) before it starts them;
worker *k* inherits its socket's fd (:data:`METRICS_FD_ENV`) and answers every connection on it
with its registry's text exposition, then closes. The worker that gets ``GET /metrics`` reads
its own registry and every other worker's socket (:func:`gather`), and :func:`merge` joins the
expositions, each sample labelled ``worker="k"``, one ``HELP``/``TYPE`` per family.

The sockets are the supervisor's, so they outlive a worker's restart: a scrape during one
waits at most :data:`FETCH_TIMEOUT_S` for that worker and goes without its samples
(``smgd_workers_scraped`` says how many answered).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

__all__ = [
    "METRICS_DIR_ENV",
    "METRICS_FD_ENV",
    "PEERS_KEY",
    "WorkerPeers",
    "bind_sockets",
    "gather",
    "merge",
    "serve_own",
    "socket_path",
    "worker_peers",
]

log = logging.getLogger("smgd.workers")

METRICS_DIR_ENV = "SMGD_WORKER_METRICS_DIR"  # the supervisor's directory of worker sockets
METRICS_FD_ENV = "SMGD_WORKER_METRICS_FD"  # this worker's own listening socket
# A worker that is restarting (or stuck) must not hold up a scrape: Prometheus' default scrape
# timeout is 10 s, and the rest of the daemon's metrics are worth more than waiting for it.
FETCH_TIMEOUT_S = 2.0
# Exposition text larger than this from one worker is refused: its registry holds a few hundred
# series (docs/reference/metrics.md), far below it; a bound keeps a broken peer harmless.
MAX_EXPOSITION_BYTES = 16 * 1024 * 1024
WORKER_LABEL = "worker"
PEERS_KEY = "smgd.worker_peers"  # app.extensions: this worker's WorkerPeers


def socket_path(directory: str, index: int) -> str:
    return os.path.join(directory, f"worker-{index}.metrics")


def bind_sockets(directory: str, count: int) -> list[socket.socket]:
    """In the supervisor: one listening unix socket per worker in ``directory``."""
    sockets = []
    for index in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(socket_path(directory, index))
        sock.listen(16)  # scrapes, not clients: a handful at once at most
        sockets.append(sock)
    return sockets


async def serve_own(
    fd: int,
    registry: CollectorRegistry,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """In a worker: answer each connection on the inherited socket ``fd`` with ``registry``."""
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(socket.socket(fileno=os.dup(fd))))

    async def answer(stream: trio.SocketStream) -> None:
        # A BrokenResourceError: the asking worker gave up (its timeout); nothing to do.
        async with stream:
            with contextlib.suppress(trio.BrokenResourceError):
                await stream.send_all(generate_latest(registry))

    async with listener:
        task_status.started()
        await trio.serve_listeners(answer, [listener])


async def _fetch(path: str) -> bytes | None:
    """One worker's exposition, or None if it does not answer in time."""
    with trio.move_on_after(FETCH_TIMEOUT_S):
        try:
            stream = await trio.open_unix_socket(path)
        except OSError as exc:
            log.debug("metrics of %s: %s", path, exc)
            return None
        async with stream:
            data = bytearray()
            while chunk := await stream.receive_some(1 << 16):
                data += chunk
                if len(data) > MAX_EXPOSITION_BYTES:
                    log.warning("metrics of %s: more than %d bytes", path, MAX_EXPOSITION_BYTES)
                    return None
            return bytes(data)
    log.debug("metrics of %s: no answer in %.0f s", path, FETCH_TIMEOUT_S)
    return None


async def gather(registry: CollectorRegistry, peers: WorkerPeers) -> bytes:
    """The merged exposition of every worker (this one's ``registry`` read directly)."""
    index, count, directory = peers.index, peers.count, peers.directory
    texts: dict[int, bytes] = {index: generate_latest(registry)}

    async def fetch(other: int) -> None:
        text = await _fetch(socket_path(directory, other))
        if text is not None:
            texts[other] = text

    async with trio.open_nursery() as nursery:
        for other in range(count):
            if other != index:
                nursery.start_soon(fetch, other)
    return merge(sorted(texts.items()), count)


def merge(texts: list[tuple[int, bytes]], count: int) -> bytes:
    """Join ``(worker index, exposition)`` pairs into one exposition (pure).

    Every sample gains a ``worker`` label; a family keeps the first worker's help text and
    type. A worker whose text does not parse is left out (and logged), not the whole scrape.
    """
    families: dict[str, Metric] = {}
    answered = 0
    for index, text in texts:
        try:
            parsed = list(text_string_to_metric_families(text.decode()))
        except (ValueError, UnicodeDecodeError) as exc:
            log.warning("metrics of worker %d do not parse: %s", index, exc)
            continue
        answered += 1
        label = str(index)
        for family in parsed:
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type
                )
            merged.samples.extend(
                Sample(s.name, {**s.labels, WORKER_LABEL: label}, s.value, s.timestamp, s.exemplar)
                for s in family.samples
            )
    scraped = GaugeMetricFamily(
        "smgd_workers_scraped",
        f"Workers whose metrics this scrape holds (of {count}).",
        value=answered,
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed([*families.values(), scraped]))
    return generate_latest(registry)


class _Fixed:
    """A collector that yields a fixed list of families (one scrape's merged result)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


@dataclass(frozen=True, slots=True)
class WorkerPeers:
    """Where this worker serves its metrics, and where the others do."""

    index: int
    count: int
    directory: str
    own_fd: int


def worker_peers(environ: Mapping[str, str]) -> WorkerPeers | None:
    """This worker's place among metrics peers; None outside worker mode."""
    from smgd.workers import current_worker

    worker = current_worker(environ)
    directory = environ.get(METRICS_DIR_ENV)
    fd = environ.get(METRICS_FD_ENV)
    if worker is None or not directory or not fd:
        return None
    return WorkerPeers(worker.index, worker.count, directory, int(fd))
