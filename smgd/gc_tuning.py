"""The cyclic garbage collector's thresholds for smgd's long-running processes.

The daemon sets them at start (:mod:`smgd.daemon`), and so does the mock engine
(:mod:`smgd.mock.main`), whose step loop stands in for a GPU engine's: a real engine's step
cadence does not wait for Python's collector, and the benchmark's offered load assumes the
mock's does not either. With CPython's defaults the mock, holding 1,024 running requests, spent
~0.7 s of a 13 s `smgd bench` point at C = 1,024 collecting (full collections up to 46 ms), and
each long one pushed the steps after it back: 20.4-20.5 ms between steps on average instead of
20, so ~2 % of the "offered" tokens were never produced (docs/performance.md, "twenty-first
pass"). With these thresholds: 23 ms of collection in the same point, 20.007 ms per step.
"""

from __future__ import annotations

import gc

# The cyclic GC's generation thresholds (CPython's default: 700, 10, 10). Under
# load smgd allocates a few objects per token per stream, so the defaults run a young
# collection every few hundred microseconds and a full one every few seconds, each full one
# traversing every live stream's objects (~60 ms at 256 streams: a pause in every stream).
# Measured with `smgd bench` at C=256, alternating runs: GC took 0.34-0.44 s of a 10 s point
# with the defaults and 0.14-0.21 s with 10,000 / 20 / 20, with no full collection in the
# point, ITL p99 33-36 ms instead of 39-160, CPU per token 28.5-33.3 vs 30.1-35.8 µs and RSS per
# stream unchanged (63-64 KiB). Young collections still catch short-lived cycles (trio's
# cancelled tasks and their tracebacks) within 10,000 allocations.
# The middle generation collects after 1,000 young collections, not 20: a running request keeps
# ~94 tracked objects alive, which all outlive a young collection, so when 10,000 streams start
# at once every middle collection walked ~200,000 live objects (30-180 ms each) and the full
# collections they led to took up to 0.7 s; with 1,000, GC per run of that burst fell from
# 2.2-3.5 s to 1.2-1.3 s with no pause over 0.1 s (docs/performance.md, "Issue 21, fifth
# pass"). Nothing of a request or its connection is left in a cycle (tests/test_direct.py), so
# little garbage waits there for those rarer collections.
GC_THRESHOLDS = (10_000, 1_000, 20)


def tune_gc() -> None:
    """Set :data:`GC_THRESHOLDS` for this process (the daemon's and the mock engine's)."""
    gc.set_threshold(*GC_THRESHOLDS)
