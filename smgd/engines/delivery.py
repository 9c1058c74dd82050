"""Socket writes held to the end of a delivery: an engine message's events in one tight loop.

An engine's reader task delivers a message's rows one after another, and a direct-mode
stream's sink (:mod:`smgd.api.http.direct`) writes each row's event to its client's socket on
the way. A write runs the kernel's TCP path (the loopback's receive and the client's wakeup
included); between two writes the interpreter runs the next row's Python, and each evicts the
other's code and data from the CPU's caches. On this project's 2-core host 256 writes, each
after ~4 µs of Python on a stream's own objects, cost 0.6-2.0 µs per write more (three runs)
than the same Python for all 256 first and then the 256 writes; held as below, smgd's CPU per
token at C = 256 fell by 4-7 % (docs/performance.md, "Issue 21, twentieth pass").

So while a reader delivers, a writer that could write at once keeps its bytes and lists itself
on the open :class:`Delivery` instead, and the reader makes every held write when it ends the
delivery, in the order the writers were listed. The load pacer's tick
(:mod:`smgd.api.core.pacer`), which releases the output direct streams held back under load,
does the same (``with DELIVERY:``). Each ends its
delivery before it yields (a scheduler checkpoint) and in a ``finally``: no other task ever
runs while a write is held, so none can see a connection whose bytes are still in this list,
and nothing held is dropped.

One delivery per process (:data:`DELIVERY`): the reader tasks, the pacer and the writers share
one thread, and each starts and ends its delivery without yielding in between, so two never
overlap.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["DELIVERY", "HELD_MAX", "Delivery", "HeldWriter"]

# The most writes held at once: the one that reaches it makes them all. The gain is a batch
# whose streams' objects are still in the caches when their writes are made; a pacer tick at
# 10,000 streams releases thousands at once, whose objects are not by then. 256: the reader's
# slice (DELIVER_CHUNK), the batch the gain was measured on. (At 10,000 streams held writes
# may still cost CPU, bound or not: docs/performance.md, "twentieth pass".)
HELD_MAX = 256


class HeldWriter(Protocol):
    def write_held(self) -> None:
        """Write the bytes it held during the delivery now, after everything it was given
        before them; must not raise (a broken socket is the writer's state to report)."""


class Delivery:
    """The writers holding writes while a reader delivers one engine message (or a slice)."""

    __slots__ = ("held", "open")

    def __init__(self) -> None:
        self.open = False  # a reader is delivering: writers hold their bytes
        # Each writer once, in the order of its first held write. A writer keeps its bytes
        # itself: no (writer, bytes) pair per token, an object the cyclic GC would track (at
        # 10,000 streams every tracked allocation brings the next full collection nearer).
        self.held: list[HeldWriter] = []

    def start(self) -> None:
        self.open = True

    def __enter__(self) -> Delivery:
        """``with DELIVERY:`` is :meth:`start`, then :meth:`end` however the block leaves."""
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.end()

    def end(self) -> None:
        """Make every held write, in order; writers write at once from here on."""
        self.open = False
        self.write_out()

    def write_out(self) -> None:
        """Make every held write, in order, and stay open (``HELD_MAX`` reached)."""
        held = self.held
        if held:
            self.held = []
            for writer in held:
                writer.write_held()


# The process's one delivery (module docstring).
DELIVERY = Delivery()
