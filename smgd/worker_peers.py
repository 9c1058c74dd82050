"""``/metrics``, ``/readiness`` and ``/get_load`` over every worker: one answer for the daemon.

With ``server.workers = N`` the kernel hands each connection to one worker, so a worker's own
registry and readiness are only its share (its engines, its requests). The supervisor therefore
binds one private unix socket per worker in a directory of its own (mode 0700) before it starts
them; worker *k* inherits its socket's fd (:data:`METRICS_FD_ENV`) and answers each connection
on it (:func:`serve_own`): the asker sends one line naming what it wants (``metrics``,
``readiness`` or ``load``), the worker writes the answer and closes. The worker that gets
the HTTP request reads its own state and asks every other worker (:func:`ask_all`):

- :func:`merge_metrics` joins the metrics expositions, each sample labelled ``worker="k"``, one
  ``HELP``/``TYPE`` per family (``smgd_workers_scraped`` says how many answered);
- :func:`merge_readiness` is ready only if every worker is (a worker that does not answer is
  not), with every worker's engines in one report;
- :func:`merge_load` lists every worker's engines, ``dp_rank`` renumbered over all of them.

The sockets are the supervisor's, so they outlive a worker's restart: a request during one
waits at most :data:`FETCH_TIMEOUT_S` for that worker.
"""

from __future__ import annotations

import contextlib
import json
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

from smgd.worker_id import current_worker

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping, Sequence

__all__ = [
    "METRICS_DIR_ENV",
    "METRICS_FD_ENV",
    "WorkerPeers",
    "ask_all",
    "bind_sockets",
    "merge_load",
    "merge_metrics",
    "merge_readiness",
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
# The daemon-wide load gauges (smgd.metrics; the inference extension's model-server protocol):
# an endpoint picker reads one series per server, so the workers' figures are combined into
# one unlabelled sample (queued and running summed, the KV usage averaged), not labelled.
DAEMON_GAUGES: Mapping[str, Callable[[list[float]], float]] = {
    "smgd_queued_requests": sum,
    "smgd_running_requests": sum,
    "smgd_kv_cache_usage_ratio": lambda values: sum(values) / len(values),
}
# A request line is one short word; anything longer is not a peer of ours.
MAX_REQUEST_LINE = 64


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
    answers: Mapping[str, Callable[[], bytes]],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """In a worker: on the inherited socket ``fd``, answer each request line from ``answers``."""
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(socket.socket(fileno=os.dup(fd))))

    async def answer(stream: trio.SocketStream) -> None:
        # A BrokenResourceError: the asking worker gave up (its timeout); nothing to do.
        async with stream:
            with contextlib.suppress(trio.BrokenResourceError), trio.move_on_after(FETCH_TIMEOUT_S):
                line = bytearray()
                while b"\n" not in line and len(line) <= MAX_REQUEST_LINE:
                    chunk = await stream.receive_some(MAX_REQUEST_LINE)
                    if not chunk:
                        return
                    line += chunk
                produce = answers.get(line.partition(b"\n")[0].decode("ascii", "replace"))
                if produce is not None:
                    await stream.send_all(produce())

    async with listener:
        task_status.started()
        await trio.serve_listeners(answer, [listener])


async def _ask(path: str, what: str) -> bytes | None:
    """One worker's answer to ``what``, or None if it does not answer in time."""
    with trio.move_on_after(FETCH_TIMEOUT_S):
        try:
            stream = await trio.open_unix_socket(path)
        except OSError as exc:
            log.debug("%s of %s: %s", what, path, exc)
            return None
        async with stream:
            try:
                await stream.send_all(what.encode() + b"\n")
                data = bytearray()
                while chunk := await stream.receive_some(1 << 16):
                    data += chunk
                    if len(data) > MAX_EXPOSITION_BYTES:
                        log.warning("%s of %s: over %d bytes", what, path, MAX_EXPOSITION_BYTES)
                        return None
            except trio.BrokenResourceError as exc:
                log.debug("%s of %s: %s", what, path, exc)
                return None
            return bytes(data) or None
    log.debug("%s of %s: no answer in %.0f s", what, path, FETCH_TIMEOUT_S)
    return None


async def ask_all(peers: WorkerPeers, what: str, own: bytes) -> list[tuple[int, bytes | None]]:
    """``(worker index, answer)`` for every worker, in order; ``own`` is this worker's."""
    answers: dict[int, bytes | None] = {peers.index: own}

    async def ask(other: int) -> None:
        answers[other] = await _ask(socket_path(peers.directory, other), what)

    async with trio.open_nursery() as nursery:
        for other in range(peers.count):
            if other != peers.index:
                nursery.start_soon(ask, other)
    return sorted(answers.items())


def merge_metrics(texts: Sequence[tuple[int, bytes | None]], count: int) -> bytes:
    """Join ``(worker index, exposition)`` pairs into one exposition (pure).

    Every sample gains a ``worker`` label (but the :data:`DAEMON_GAUGES`, combined over the
    workers); a family keeps the first worker's help text and type. A worker that did not
    answer (None), or whose text does not parse (logged), is left out, not the whole scrape.
    """
    families: dict[str, Metric] = {}
    combined: dict[str, list[float]] = {}
    answered = 0
    for index, text in texts:
        if text is None:
            continue
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
            if family.name in DAEMON_GAUGES:
                combined.setdefault(family.name, []).extend(s.value for s in family.samples)
                continue
            merged.samples.extend(
                Sample(s.name, {**s.labels, WORKER_LABEL: label}, s.value, s.timestamp, s.exemplar)
                for s in family.samples
            )
    for name, values in combined.items():
        families[name].samples = [Sample(name, {}, DAEMON_GAUGES[name](values))]
    scraped = GaugeMetricFamily(
        "smgd_workers_scraped",
        f"Workers whose metrics this scrape holds (of {count}).",
        value=answered,
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed([*families.values(), scraped]))
    return generate_latest(registry)


def merge_readiness(reports: Sequence[tuple[int, bytes | None]]) -> tuple[bool, dict[str, object]]:
    """(ready, report) over every worker's ``{"ready": bool, "report": {...}}`` (pure).

    Ready only if every worker answered and is ready; the report holds every worker's engines
    and, under ``workers``, each worker's status (``no_answer`` for one that did not answer).
    """
    ready = True
    draining = False
    engines: dict[str, object] = {}
    workers: dict[str, str] = {}
    for index, raw in reports:
        worker_ready, status = False, "no_answer"
        if raw is not None:
            try:
                answer = json.loads(raw)
                report = answer["report"]
                worker_ready = bool(answer["ready"])
                status = str(report["status"])
                engines.update(report["engines"])
                draining = draining or bool(report["draining"])
            except (ValueError, TypeError, KeyError) as exc:
                log.warning("readiness of worker %d does not parse: %s", index, exc)
                worker_ready, status = False, "no_answer"
        ready = ready and worker_ready
        workers[str(index)] = status
    status = "ready" if ready else ("draining" if draining else "not_ready")
    return ready, {"status": status, "draining": draining, "engines": engines, "workers": workers}


def merge_load(reports: Sequence[tuple[int, bytes | None]]) -> list[dict[str, object]]:
    """Every worker's ``/get_load`` entries in worker order, each with its ``worker``, and
    ``dp_rank`` renumbered as the position in the whole list (pure). A worker that did not
    answer, or whose answer does not parse, contributes nothing."""
    merged: list[dict[str, object]] = []
    for index, raw in reports:
        if raw is None:
            continue
        try:
            entries = json.loads(raw)
            if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
                raise ValueError("not a list of objects")
        except ValueError as exc:
            log.warning("load of worker %d does not parse: %s", index, exc)
            continue
        for entry in entries:
            merged.append({**entry, "dp_rank": len(merged), WORKER_LABEL: index})
    return merged


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
    worker = current_worker(environ)
    directory = environ.get(METRICS_DIR_ENV)
    fd = environ.get(METRICS_FD_ENV)
    if worker is None or not directory or not fd:
        return None
    return WorkerPeers(worker.index, worker.count, directory, int(fd))
