"""smgd.logs: records go through a bounded queue to one writer thread; a blocked stderr costs
lines (counted and reported), never the caller's time."""

from __future__ import annotations

import io
import json
import logging
import threading
import time
import warnings
from collections.abc import Iterator

import pytest

from smgd import logs
from smgd.config import LoggingConfig
from smgd.logs import (
    HUMAN_FORMAT,
    JsonFormatter,
    LineQueue,
    announce,
    dropped_report,
    flush_logs,
    freeze,
    setup_logging,
)


def record(msg: str, *args: object, exc: bool = False, **extra: object) -> logging.LogRecord:
    made = logging.LogRecord("smgd.test", logging.INFO, __file__, 1, msg, args or None, None)
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            import sys

            made.exc_info = sys.exc_info()
    made.__dict__.update(extra)
    return made


# --------------------------------------------------------------------------- the sans-IO core


def test_a_full_queue_drops_and_counts_until_taken() -> None:
    queue = LineQueue(bound=3)
    assert all(queue.put(f"line {i}") for i in range(3))
    assert not queue.put("line 3") and not queue.put("line 4")
    queue.put_always("the banner")  # past the bound: never dropped
    items, dropped = queue.take()
    assert items == ["line 0", "line 1", "line 2", "the banner"]
    assert dropped == 2
    assert queue.take() == ([], 0)  # the count was reported once
    assert queue.put("line 5")


def test_lines_stderr_refused_are_counted_with_the_drops() -> None:
    queue = LineQueue(bound=1)
    queue.put("a")
    queue.put("b")
    queue.count_lost(4)
    assert queue.take() == (["a"], 5)


def test_the_dropped_report_is_a_line_in_either_format() -> None:
    report = dropped_report(17)
    human = HUMAN_FORMAT.format(report)
    assert "WARNING" in human and "17 log line(s) dropped" in human and "\n" not in human
    line = JsonFormatter().format(dropped_report(17))
    assert "\n" not in line
    payload = json.loads(line)
    assert payload["level"] == "warning" and payload["dropped_lines"] == 17
    assert "17 log line(s) dropped" in payload["msg"]


def test_a_record_of_scalars_is_queued_unformatted() -> None:
    plain = record("%s done in %s ms", "cmpl-1", 12.5, request_id="cmpl-1", ttft_ms=None)
    assert freeze(plain, JsonFormatter(), extras=True) is plain


def test_a_mutable_argument_is_formatted_when_logged() -> None:
    seen = ["a"]
    item = freeze(record("saw %s", seen), HUMAN_FORMAT, extras=False)
    seen.append("b")  # the loop changes it later: the line says what was true when logged
    assert isinstance(item, str) and item.endswith("saw ['a']")


def test_an_exception_is_formatted_when_logged() -> None:
    item = freeze(record("failed", exc=True), JsonFormatter(), extras=True)
    assert isinstance(item, str)
    assert "ValueError: boom" in json.loads(item)["exc"]


def test_json_extras_list_is_copied_and_other_mutables_format_now() -> None:
    rids = ["r1", "r2"]
    kept = record("done", engine_rids=rids)
    assert freeze(kept, JsonFormatter(), extras=True) is kept
    rids.append("r3")
    assert json.loads(JsonFormatter().format(kept))["engine_rids"] == ["r1", "r2"]
    nested = {"a": 1}
    item = freeze(record("done", detail=nested), JsonFormatter(), extras=True)
    nested["a"] = 2
    assert isinstance(item, str) and json.loads(item)["detail"] == {"a": 1}
    # The human format never writes extras: they do not need freezing there.
    assert isinstance(freeze(record("done", detail=nested), HUMAN_FORMAT, extras=False), type(kept))


# --------------------------------------------------------------------------- the writer thread


class BlockingStream(io.StringIO):
    """A stderr that blocks every write until released (a pipe nobody drains)."""

    def __init__(self) -> None:
        super().__init__()
        self.open = threading.Event()
        self.entered = threading.Event()

    def write(self, text: str) -> int:
        self.entered.set()
        self.open.wait()
        return super().write(text)


@pytest.fixture
def stream(monkeypatch: pytest.MonkeyPatch) -> Iterator[BlockingStream]:
    """A BlockingStream, and a writer of the test's own (setup_logging(..., stream=it))."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    blocking = BlockingStream()
    monkeypatch.setattr(logs, "_writer", None)
    monkeypatch.setattr(logs, "_json_lines", False)
    yield blocking
    blocking.open.set()  # the test's writer thread finishes its write and idles
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize("fmt", ["human", "json"])
def test_a_blocked_stderr_costs_lines_not_the_callers_time(
    stream: BlockingStream, fmt: str
) -> None:
    setup_logging(LoggingConfig(format=fmt), stream=stream)  # type: ignore[arg-type]
    log = logging.getLogger("smgd.test")
    log.info("first line")
    assert stream.entered.wait(5)  # the writer is stuck in its write
    extra = 500
    started = time.perf_counter()
    for i in range(logs.QUEUE_LINES + extra):
        log.info("request %d done", i)
    announce("smgd listening on http://127.0.0.1:1", url="http://127.0.0.1:1")
    elapsed = time.perf_counter() - started
    # ~2,500 records: a few ms of queueing; a write that blocked would never return.
    assert elapsed < 1.0
    assert not flush_logs(timeout=0.05)  # the exit's flush gives up on a blocked stderr
    stream.open.set()
    assert flush_logs(timeout=5)
    lines = stream.getvalue().splitlines()
    if fmt == "json":
        records = [json.loads(line) for line in lines]  # every line is one JSON object
        texts = [r["msg"] for r in records]
        assert [r["dropped_lines"] for r in records if "dropped_lines" in r] == [extra]
    else:
        texts = lines
    assert texts[0].endswith("first line")
    written = [t for t in texts if "request" in t and "done" in t]
    assert len(written) == logs.QUEUE_LINES  # the queue's worth, in order
    assert written[0].endswith("request 0 done")
    assert written[-1].endswith(f"request {logs.QUEUE_LINES - 1} done")
    assert any(t.endswith(f"{extra} log line(s) dropped: stderr did not take them as fast as "
                          "they came") for t in texts)  # fmt: skip
    assert any(t.endswith("smgd listening on http://127.0.0.1:1") for t in texts)  # never dropped


def test_the_banner_keeps_its_place_among_log_lines(stream: BlockingStream) -> None:
    stream.open.set()
    setup_logging(LoggingConfig(level="info"), stream=stream)
    log = logging.getLogger("smgd.test")
    log.info("before")
    announce("smgd listening on http://127.0.0.1:1")
    log.info("after")
    assert flush_logs(timeout=5)
    lines = stream.getvalue().splitlines()
    assert lines[1] == "smgd listening on http://127.0.0.1:1"  # bare, as scripts read it
    assert lines[0].endswith("before") and lines[2].endswith("after")


def test_a_reload_changes_the_level_of_the_queued_handler(stream: BlockingStream) -> None:
    stream.open.set()
    setup_logging(LoggingConfig(level="warning"), stream=stream)
    log = logging.getLogger("smgd.test")
    log.info("hidden")
    logging.getLogger().setLevel("INFO")  # what Gateway.apply_config does on a reload
    log.info("shown")
    assert flush_logs(timeout=5)
    text = stream.getvalue()
    assert "shown" in text and "hidden" not in text


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text")


@pytest.mark.parametrize("fmt", ["human", "json"])
def test_a_record_that_cannot_be_formatted_becomes_a_line_saying_so(
    stream: BlockingStream, fmt: str
) -> None:
    stream.open.set()
    setup_logging(LoggingConfig(format=fmt), stream=stream)  # type: ignore[arg-type]
    logging.getLogger("smgd.test").info("value %s", Unprintable())
    logging.getLogger("smgd.test").info("next")
    assert flush_logs(timeout=5)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert "could not be formatted (RuntimeError: no text)" in lines[0]
    assert lines[1].endswith("next") or json.loads(lines[1])["msg"] == "next"
    if fmt == "json":
        assert json.loads(lines[0])["level"] == "error"


def test_a_python_warning_is_a_log_line_in_the_configured_format(stream: BlockingStream) -> None:
    """warnings.showwarning printed to stderr on the caller (the loop), in plain text even
    where every line must be a JSON object."""
    stream.open.set()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        # pytest records warnings by putting the original showwarning back for each test: an
        # earlier setup_logging's capture would look in place (logging keeps its own flag).
        logging.captureWarnings(False)
        setup_logging(LoggingConfig(format="json"), stream=stream)
        try:
            warnings.warn("an old API", DeprecationWarning, stacklevel=1)
            assert flush_logs(timeout=5)
        finally:
            logging.captureWarnings(False)
    (line,) = stream.getvalue().splitlines()
    entry = json.loads(line)
    assert entry["logger"] == "py.warnings" and "an old API" in entry["msg"]
