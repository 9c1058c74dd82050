"""Logging setup: human or JSON lines on stderr, one structured line per request at the end.

In ``json`` format every line smgd writes to stderr is one JSON object, the start-up banner
(:func:`announce`), a fatal error and the dropped-lines report included.

**Logging never blocks the event loop.** A record is handed to a bounded queue
(:class:`LineQueue`) and one writer thread formats it and writes it to stderr. A sink that
stops taking lines (journald stalled, a pipe nobody drains) blocks the writer alone; once the
queue is full, records are dropped and counted, and the writer's next write ends with one line
saying how many (:func:`dropped_report`). A blocked log sink costs log lines, never requests.

What is formatted where: a record whose message arguments (and, in JSON, ``extra=`` values)
are immutable scalars is queued as it is and formatted by the writer: nothing the loop does
later can change it (every per-request line). Anything else (an exception's traceback, a
mutable argument) is formatted on the loop when it is logged, as
:meth:`logging.handlers.QueueHandler.prepare` does, so the line says what was true then.

:func:`flush_logs` waits, within a bound, until everything logged so far is written: the
daemon's exit calls it in a ``finally`` (a clean stop, a fatal error, a SIGTERM drain).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from smgd.config import LoggingConfig

__all__ = [
    "FLUSH_TIMEOUT_S",
    "QUEUE_LINES",
    "JsonFormatter",
    "LineQueue",
    "announce",
    "dropped_report",
    "flush_logs",
    "setup_logging",
]

# Records waiting for the writer before new ones are dropped. A per-request record with its
# fields is ~2.1 KB (its attribute dict and values; tracemalloc over 2,048 of them), so the
# queue holds at most ~4.3 MB per process. One process writes at most ~1,000-4,000 lines a second
# (one per request at info; docs/performance.md), so 2,048 lines ride out a sink that stalls
# for 0.5-2 s at full load (a journald flush or rotation) and minutes at a quiet daemon's few
# lines a second; a sink stalled longer than that is the stuck one whose lines are dropped.
QUEUE_LINES = 2048
# How long the exit waits for the writer to write what is queued. A healthy sink takes a full
# queue (~0.5 MB of lines) in well under 0.1 s; one that took nothing for 2 s is blocked, and
# waiting on it would only hold up the exit (or a systemd restart) for lines that are lost.
FLUSH_TIMEOUT_S = 2.0
# The writer, once woken, waits this long before it takes the queue, so that under load one
# wakeup and one write carry a batch of lines rather than a thread switch per line. A line
# reaches stderr at most this much later; the loop pays one wakeup per batch, not per line.
BATCH_WAIT_S = 0.002

# Attributes every LogRecord has; anything else was passed in `extra=` and goes into the JSON.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None)))
# Values the loop cannot change after the call: a record of these alone is formatted later.
_IMMUTABLE = frozenset({str, int, float, bool, type(None), bytes})
# extra= key that marks announce()'s record in JSON: queued past the bound, never dropped.
_ANNOUNCE = "_smgd_announce"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                payload[key] = value
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


HUMAN_FORMAT = logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")

# --------------------------------------------------------------------------- the sans-IO core

# What the writer takes: a record to format, a line already formatted (announce's human
# banner, a record formatted on the loop), or a flush marker to set once the lines before it
# are written.
Item = logging.LogRecord | str | threading.Event


class LineQueue:
    """The bounded queue between the loop and the writer, and the count of what it dropped.

    No thread or I/O: :meth:`put` and :meth:`take` are safe from any thread (``deque``'s append
    and popleft are atomic; the count has a lock, taken only on the drop path and by
    :meth:`take`). ``bound`` is soft by one per thread putting at the same moment.
    """

    def __init__(self, bound: int = QUEUE_LINES) -> None:
        self.bound = bound
        self._items: deque[Item] = deque()
        self._dropped = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: Item) -> bool:
        """Queue ``item`` unless the queue is full; False: dropped and counted."""
        if len(self._items) >= self.bound:
            with self._lock:
                self._dropped += 1
            return False
        self._items.append(item)
        return True

    def put_always(self, item: Item) -> None:
        """Queue ``item`` past the bound: the banner, a fatal error, a flush marker (a few per
        process lifetime, and the ones a script or the exit waits for)."""
        self._items.append(item)

    def take(self) -> tuple[list[Item], int]:
        """Everything queued, oldest first, and how many were dropped since the last take."""
        items = [self._items.popleft() for _ in range(len(self._items))]
        with self._lock:
            dropped, self._dropped = self._dropped, 0
        return items, dropped

    def count_lost(self, lines: int) -> None:
        """Lines taken but not written (stderr refused them): reported with the next drops."""
        with self._lock:
            self._dropped += lines


def dropped_report(dropped: int) -> logging.LogRecord:
    """The record saying ``dropped`` lines were dropped (formatted like any other line, so
    JSON mode stays one JSON object per line; ``dropped_lines`` holds the count)."""
    record = logging.LogRecord(
        "smgd.logs",
        logging.WARNING,
        __file__,
        0,
        "%d log line(s) dropped: stderr did not take them as fast as they came",
        (dropped,),
        None,
    )
    record.dropped_lines = dropped
    return record


def freeze(record: logging.LogRecord, formatter: logging.Formatter, *, extras: bool) -> Item:
    """What to queue for ``record``: itself if nothing in it can change after the call, else
    its line formatted now (see the module docstring). ``extras``: the formatter writes the
    ``extra=`` values (JSON), so they must not change either."""
    args = record.args
    if (
        record.exc_info is None
        and type(record.msg) is str
        and (not args or (type(args) is tuple and all(type(a) in _IMMUTABLE for a in args)))
        and (not extras or _freeze_extras(record))
    ):
        return record
    return formatter.format(record)


def _freeze_extras(record: logging.LogRecord) -> bool:
    """Whether every ``extra=`` value is immutable; a list or tuple of immutable scalars (the
    request line's ``engine_rids``) is copied into a tuple (the same JSON)."""
    fields = vars(record)
    for key in fields.keys() - _STANDARD:
        value = fields[key]
        if type(value) in _IMMUTABLE:
            continue
        if type(value) in (list, tuple) and all(type(v) in _IMMUTABLE for v in value):
            fields[key] = tuple(value)
            continue
        return False
    return True


# --------------------------------------------------------------------------- the writer


class _Writer:
    """One daemon thread that writes what :class:`LineQueue` holds to ``stream``.

    Wakeups: a producer sets ``_wake`` only when it is clear; the writer clears it before it
    takes the queue, so a record put after the take finds it clear and wakes the writer again,
    and one put before the take is in it. The thread is a daemon thread: an exit never waits
    on a blocked stderr beyond :func:`flush_logs`'s bound.
    """

    def __init__(self, stream: TextIO, formatter: logging.Formatter) -> None:
        self.stream = stream
        self.formatter = formatter
        self.queue = LineQueue()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="smgd-log-writer", daemon=True)
        self._thread.start()

    def put(self, item: Item, *, always: bool = False) -> None:
        if always:
            self.queue.put_always(item)
        elif not self.queue.put(item):
            return
        if not self._wake.is_set():
            self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            time.sleep(BATCH_WAIT_S)
            self._wake.clear()
            items, dropped = self.queue.take()
            self._write_all(items, dropped)

    def _write_all(self, items: list[Item], dropped: int) -> None:
        lines: list[str] = []
        flushes: list[threading.Event] = []
        for item in items:
            if isinstance(item, threading.Event):
                flushes.append(item)
            elif isinstance(item, str):
                lines.append(item)
            else:
                lines.append(self._format(item))
        if dropped:
            lines.append(self._format(dropped_report(dropped)))
        self._write(lines)
        for flush in flushes:  # set after the whole batch: the exit's flush has the report too
            flush.set()

    def _format(self, record: logging.LogRecord) -> str:
        try:
            return self.formatter.format(record)
        except Exception as exc:  # a record that cannot be formatted must not end the writer
            failed = logging.LogRecord(
                "smgd.logs", logging.ERROR, __file__, 0, "a log line could not be formatted "
                "(%s: %s); its message was %r", (type(exc).__name__, exc, record.msg), None,
            )  # fmt: skip
            try:
                return self.formatter.format(failed)
            except Exception:  # its message's repr failed too
                return self.formatter.format(dropped_report(1))

    def _write(self, lines: list[str]) -> None:
        if not lines:
            return
        try:
            self.stream.write("\n".join(lines) + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # stderr closed or broken: these lines are lost
            self.queue.count_lost(len(lines))

    def flush(self, timeout: float) -> bool:
        """Wait until what was queued before the call is written; False if ``timeout`` ran
        out first (stderr blocked)."""
        done = threading.Event()
        self.put(done, always=True)
        return done.wait(timeout)


class QueueingHandler(logging.Handler):
    """The root handler: queues each record for the writer, never writes on the caller."""

    def __init__(self, writer: _Writer, *, json_lines: bool) -> None:
        super().__init__()
        self.writer = writer
        self.json_lines = json_lines

    def emit(self, record: logging.LogRecord) -> None:
        try:
            item = freeze(record, self.writer.formatter, extras=self.json_lines)
        except Exception:  # it cannot be formatted: the writer writes what it can say of it
            item = record  # (logging's handleError would print a traceback here, on the loop)
        self.writer.put(item, always=record.__dict__.get(_ANNOUNCE, False))


_writer: _Writer | None = None
_json_lines = False  # set by setup_logging: announce() writes JSON too


def announce(text: str, *, level: int = logging.INFO, **fields: Any) -> None:
    """A line for the operator: plain text on stderr in the human format (the banner, e.g.
    ``smgd listening on URL``, which scripts read), a log record in the JSON format; written
    whatever the log level.

    It goes through the writer in order with the log lines around it and is never dropped
    (it is written once the lines queued before it are); before :func:`setup_logging` it is
    written at once."""
    if _json_lines:
        # Past the level, as the human format's plain line is: a script waits for the banner
        # whatever `logging.level` says (at "warning" it never came).
        logger = logging.getLogger("smgd")
        extra = {**fields, _ANNOUNCE: True}
        logger.handle(logger.makeRecord(logger.name, level, "", 0, text, (), None, extra=extra))
    elif _writer is not None:
        _writer.put(text, always=True)
    else:
        print(text, file=sys.stderr, flush=True)


def flush_logs(timeout: float = FLUSH_TIMEOUT_S) -> bool:
    """Wait (at most ``timeout``) until every line logged so far is written to stderr; False
    if stderr did not take them in time. Nothing to do before :func:`setup_logging`."""
    return True if _writer is None else _writer.flush(timeout)


def setup_logging(config: LoggingConfig, *, stream: TextIO | None = None) -> None:
    """Log to ``stream`` (default: stderr as it is now) through the writer thread, in
    ``config``'s format and level. Called again (the daemon after the command line), it keeps
    the one writer."""
    global _json_lines, _writer
    _json_lines = config.format == "json"
    formatter = JsonFormatter() if _json_lines else HUMAN_FORMAT
    stream = sys.stderr if stream is None else stream
    if _writer is None:
        _writer = _Writer(stream, formatter)
    else:
        _writer.flush(FLUSH_TIMEOUT_S)  # lines of the old format go out in it
        _writer.stream, _writer.formatter = stream, formatter
    root = logging.getLogger()
    root.handlers[:] = [QueueingHandler(_writer, json_lines=_json_lines)]
    root.setLevel(config.level.upper())
    # hypercorn's access log is separate and off unless asked for.
    logging.getLogger("hypercorn.access").disabled = not config.access_log
    # Python's warnings (a library's deprecation, a resource never closed) become records of
    # the `py.warnings` logger: through the writer, in the configured format (one JSON object
    # per line), not printed to stderr on the loop by warnings.showwarning.
    logging.captureWarnings(True)
