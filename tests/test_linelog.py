"""smgd.linelog: an engine's output lines through a token bucket, without an event loop.

Times are passed in: nothing here sleeps or reads a clock.
"""

from __future__ import annotations

from smgd.linelog import BURST_LINES, RATE_LINES_S, REPORT_S, LineBudget, LineSplitter

READY = b"SMGD_READY "


def flood(n: int, start: int = 0) -> bytes:
    return b"".join(b"flood line %d\n" % k for k in range(start, start + n))


def splitter(**kwargs: object) -> LineSplitter:
    return LineSplitter(max_line=1024, watch=READY, **kwargs)  # type: ignore[arg-type]


def test_a_budget_gives_a_burst_then_its_rate() -> None:
    budget = LineBudget(burst=500, rate=50.0)
    assert budget.take(10_000, now=0.0) == 500
    assert budget.take(10, now=0.0) == 0
    assert budget.take(10_000, now=1.0) == 50  # a second's refill
    assert budget.take(10, now=1.5) == 10  # 25 came back, 10 taken
    assert budget.take(10_000, now=1000.0) == 500  # never more than a burst saved up


def test_a_quiet_engines_lines_are_all_logged() -> None:
    lines = splitter()
    taken = lines.feed(b"loading weights\nready to serve\n", now=0.0)
    assert taken.logged == [b"loading weights", b"ready to serve"]
    assert taken.suppressed == 0 and lines.report(now=100.0) == 0


def test_a_flood_is_logged_up_to_the_burst_and_the_rest_counted() -> None:
    """A million lines in a second: the burst and the second's refill are logged, every other
    line is counted (it was logged, all of it, on smgd's event loop)."""
    lines = splitter()
    logged = suppressed = 0
    for k in range(100):  # 100 chunks of 10,000 lines over a second
        taken = lines.feed(flood(10_000, k * 10_000), now=k / 100)
        logged += len(taken.logged)
        suppressed += taken.suppressed
    assert logged + suppressed == 1_000_000
    assert BURST_LINES <= logged <= BURST_LINES + RATE_LINES_S


def test_the_lines_logged_from_a_chunk_are_its_first_ones_and_whole() -> None:
    lines = splitter(budget=LineBudget(burst=3, rate=0.0))
    taken = lines.feed(b"one\ntwo\nthr", now=0.0)
    assert taken.logged == [b"one", b"two"] and taken.suppressed == 0
    taken = lines.feed(b"ee\nfour\nfive\n", now=0.0)  # "three" ends here: one line
    assert taken.logged == [b"three"] and taken.suppressed == 2


def test_the_ready_line_is_found_among_the_lines_left_out() -> None:
    """Wherever it falls in a flood: in a chunk's middle, first, last, or cut across two
    chunks; a line that only has the prefix inside it is not one."""
    lines = splitter(budget=LineBudget(burst=0, rate=0.0))
    middle = flood(500) + b'SMGD_READY {"context_length": 4096}\n' + flood(500)
    assert lines.feed(middle, now=0.0).watched == [b'SMGD_READY {"context_length": 4096}']
    assert lines.feed(b"SMGD_READY {}\n" + flood(10), now=0.0).watched == [b"SMGD_READY {}"]
    assert lines.feed(flood(10) + b"SMGD_READY {}\n", now=0.0).watched == [b"SMGD_READY {}"]
    assert lines.feed(flood(10) + b"x SMGD_READY {}\n", now=0.0).watched == []
    assert lines.feed(flood(10) + b"SMGD_REA", now=0.0).watched == []
    taken = lines.feed(b'DY {"a": 1}\n' + flood(10), now=0.0)
    assert taken.watched == [b'SMGD_READY {"a": 1}']
    assert taken.suppressed == 10  # the ready line is read, not left out


def test_the_lines_left_out_are_reported_at_an_interval_and_at_the_end() -> None:
    lines = splitter(budget=LineBudget(burst=0, rate=0.0))
    assert lines.report_due is None
    lines.feed(flood(100), now=5.0)
    assert lines.report_due == 5.0 + REPORT_S
    assert lines.report(now=5.0 + REPORT_S / 2) == 0  # not due yet
    lines.feed(flood(20), now=6.0)
    assert lines.report(now=5.0 + REPORT_S) == 120
    assert lines.report_due is None and lines.report(now=100.0) == 0  # nothing new
    lines.feed(flood(7) + b"no end", now=200.0)
    assert lines.end(now=200.0).suppressed == 1  # the last line, without its newline
    assert lines.report(now=200.0, final=True) == 8  # the stream ended: not kept for later


def test_a_line_without_an_end_is_taken_in_pieces_within_the_budget() -> None:
    lines = splitter(budget=LineBudget(burst=2, rate=0.0))
    taken = lines.feed(b"x" * 5000, now=0.0)  # four pieces of 1,024 bytes, 904 kept
    assert taken.logged == [b"x" * 1024] * 2 and taken.suppressed == 2
    taken = lines.feed(b"\n", now=0.0)
    assert taken.logged == [] and taken.suppressed == 1
    assert lines.report(now=0.0, final=True) == 3
