"""How much of a launched engine's stdout/stderr reaches smgd's log: sans-IO, no event loop.

An engine's output lines are logged one record each (:mod:`smgd.launch`), on smgd's event
loop. A child that prints in a tight loop (a debug print left in a scheduler's step, a warning
per token) writes hundreds of thousands of lines a second: logged whole, they took most of
a core of smgd and put a quarter of a second between two events of a client's stream
(docs/performance.md, "Engine output floods"), and they fill the journal, whose own rate
limit then drops smgd's lines with the engine's.

So each stream of each engine has a :class:`LineBudget`, a token bucket: a burst of
:data:`BURST_LINES` lines, then :data:`RATE_LINES_S` a second. Lines past it are counted, not
logged, and every :data:`REPORT_S` seconds (and when the stream ends) one line says how many
were left out, so the log never loses lines silently. :class:`LineSplitter` cuts the pipe's
bytes into lines and asks the budget; for the lines left out it only counts newlines (one
C-level ``count`` per chunk: no per-line split or decode), and it still finds every line
that starts with its ``watch`` prefix (the engine's ready line), whatever the flood.
"""

from __future__ import annotations

from typing import NamedTuple

# A burst covers an engine's whole start-up log (vLLM's is ~150 lines, SGLang's ~100) and a
# crash's traceback with its chained causes (rarely 200 lines): what an operator reads after
# an engine failed must not be cut. Past it the budget refills at RATE_LINES_S.
BURST_LINES = 500
# Sustained lines a second per stream: a healthy engine logs a stats line every few seconds
# (vLLM every 5 s; SGLang a decode line per 40 steps and a line per prefill batch, a few a
# second under load). A logged line costs ~15-30 us of the loop, so 50/s is < 0.2 % of a
# core per stream; and journald's default limit (10,000 lines per 30 s, ~330/s for the whole
# unit) leaves room for three flooding streams at once beside smgd's own lines.
RATE_LINES_S = 50.0
# How often a stream that is being cut says how many lines were left out: often enough that
# the log shows when a flood started and stopped, rarely enough to be one line among many.
REPORT_S = 10.0


class LineBudget:
    """A token bucket of log lines: ``burst`` at once, then ``rate`` a second."""

    def __init__(self, *, burst: int = BURST_LINES, rate: float = RATE_LINES_S) -> None:
        self.burst = burst
        self.rate = rate
        self._tokens = float(burst)
        self._at: float | None = None  # when the tokens were counted last

    def take(self, lines: int, now: float) -> int:
        """How many of ``lines`` may be logged at ``now`` (the first ones); takes them."""
        if self._at is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        allowed = min(lines, int(self._tokens))
        self._tokens -= allowed
        return allowed


class Lines(NamedTuple):
    """What one chunk gave: lines to log (in order), lines past the budget that start with
    the watched prefix (not left out), and how many lines were left out."""

    logged: list[bytes]
    watched: list[bytes]
    suppressed: int


class LineSplitter:
    """One output stream's bytes → whole lines, cut by a :class:`LineBudget`.

    A line longer than ``max_line`` bytes (a progress bar drawn with ``\\r`` alone, a dumped
    blob) is taken in pieces of that size. The suppressed count is kept until
    :meth:`report` says it is due (every ``report_s`` seconds while lines are left out).
    """

    def __init__(
        self,
        *,
        max_line: int,
        watch: bytes | None = None,
        budget: LineBudget | None = None,
        report_s: float = REPORT_S,
    ) -> None:
        self.max_line = max_line
        self.watch = watch
        self.budget = budget if budget is not None else LineBudget()
        self.report_s = report_s
        self._partial = b""
        self._suppressed = 0  # left out since the last report
        self._since: float | None = None  # when the first of them was left out

    def feed(self, chunk: bytes, now: float) -> Lines:
        data = self._partial + chunk if self._partial else chunk
        end = data.rfind(b"\n")
        if end < 0:
            self._partial = data
            return self._overlong(now)
        self._partial = data[end + 1 :]
        lines = self._take(data, end, now)
        if len(self._partial) > self.max_line:
            more = self._overlong(now)
            return Lines(
                lines.logged + more.logged,
                lines.watched + more.watched,
                lines.suppressed + more.suppressed,
            )
        return lines

    def end(self, now: float) -> Lines:
        """The stream ended: what is left of a last line without its newline."""
        rest, self._partial = self._partial, b""
        if not rest:
            return Lines([], [], 0)
        return self._take(rest, len(rest), now)

    def report(self, now: float, *, final: bool = False) -> int:
        """Lines left out to report now (0: nothing due); the count starts over after it."""
        if not self._suppressed or self._since is None:
            return 0
        if not final and now - self._since < self.report_s:
            return 0
        count, self._suppressed, self._since = self._suppressed, 0, None
        return count

    @property
    def report_due(self) -> float | None:
        """When :meth:`report` will give the count kept now (None: nothing is kept)."""
        return None if self._since is None else self._since + self.report_s

    def _overlong(self, now: float) -> Lines:
        """Pieces of ``max_line`` bytes off a partial line that grew past it."""
        if len(self._partial) <= self.max_line:
            return Lines([], [], 0)
        size = self.max_line
        cut = len(self._partial) - len(self._partial) % size
        pieces = [self._partial[i : i + size] for i in range(0, cut, size)]
        self._partial = self._partial[cut:]
        allowed = self.budget.take(len(pieces), now)
        watch = self.watch
        watched = [p for p in pieces[allowed:] if watch and p.startswith(watch)]
        left_out = len(pieces) - allowed - len(watched)
        self._count(left_out, now)
        return Lines(pieces[:allowed], watched, left_out)

    def _take(self, data: bytes, end: int, now: float) -> Lines:
        """The lines of ``data[:end]`` (newline-separated) through the budget."""
        total = data.count(b"\n", 0, end) + 1
        allowed = self.budget.take(total, now)
        if allowed == total:
            return Lines(data[:end].split(b"\n"), [], 0)
        # Split off the allowed lines only (at most a burst); the rest is not copied, only
        # searched in C for the watched prefix.
        start = 0
        for _ in range(allowed):
            start = data.index(b"\n", start, end) + 1
        head = data[: start - 1].split(b"\n") if allowed else []
        watched = self._watched(data, start, end)
        left_out = total - allowed - len(watched)
        self._count(left_out, now)
        return Lines(head, watched, left_out)

    def _watched(self, data: bytes, start: int, end: int) -> list[bytes]:
        """Lines of ``data[start:end]`` (left out) that start with the watched prefix."""
        watch = self.watch
        if not watch:
            return []
        found = []
        at = start if data.startswith(watch, start, end) else -1
        if at < 0:
            at = data.find(b"\n" + watch, start, end)
            at = at if at < 0 else at + 1
        while at >= 0:
            stop = data.find(b"\n", at, end)
            stop = end if stop < 0 else stop
            found.append(data[at:stop])
            at = data.find(b"\n" + watch, stop, end)
            at = at if at < 0 else at + 1
        return found

    def _count(self, suppressed: int, now: float) -> None:
        if suppressed:
            if not self._suppressed:
                self._since = now
            self._suppressed += suppressed
