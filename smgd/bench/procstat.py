"""CPU time and memory of a process tree, read from ``/proc`` (Linux only).

CPU per token is the benchmark's robust number on a noisy shared machine: wall-clock
latencies move with whatever else runs, but the CPU time a process spends per token does
not. :func:`cpu_sample` reads it for a set of processes; :func:`cpu_between` subtracts two
samples. Time of children that already exited is counted through ``cutime``/``cstime`` of the
parent only after they are reaped, which is why the benchmark keeps every measured process
alive across a point.

Two clocks: ``utime + stime`` in ``/proc/<pid>/stat`` covers the whole process, exited threads
included, but in clock ticks (10 ms); ``/proc/<pid>/task/<tid>/schedstat`` gives each live
thread's time on a CPU in nanoseconds. A front end behind a slow engine spends a few clock
ticks in a whole point (smgd behind SGLang's CPU scheduler: 6 ticks in 30 s), so a tick is
a sixth of the figure; the nanosecond sum is used wherever it is complete (every thread of
the first sample still alive at the second), the ticks elsewhere.

The parsers (:func:`parse_stat`, :func:`parse_status_kib`, :func:`parse_schedstat`) are pure so
they can be tested on literal ``/proc`` text.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class Stat:
    """The fields of ``/proc/<pid>/stat`` the benchmark uses (CPU in clock ticks)."""

    pid: int
    ppid: int
    utime: int
    stime: int


def parse_stat(text: str) -> Stat:
    """Parse one ``/proc/<pid>/stat`` line; the command name may contain spaces and parens."""
    head, _, rest = text.rpartition(")")
    pid = int(head.split("(", 1)[0])
    fields = rest.split()
    # After ")": state(0) ppid(1) ... utime is field 14 of the full line, i.e. rest[11].
    return Stat(pid=pid, ppid=int(fields[1]), utime=int(fields[11]), stime=int(fields[12]))


def parse_status_kib(text: str, key: str) -> int:
    """A ``kB`` value from ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``); 0 when absent."""
    prefix = key + ":"
    for line in text.splitlines():
        if line.startswith(prefix):
            return int(line[len(prefix) :].split()[0])
    return 0


def read_stat(pid: int) -> Stat | None:
    try:
        return parse_stat((PROC / str(pid) / "stat").read_text())
    except (OSError, ValueError, IndexError):
        return None  # exited between listing and reading


def descendants(root: int, stats: Iterable[Stat] | None = None) -> list[int]:
    """``root`` and every live descendant (by walking ppid links of all processes)."""
    if stats is None:
        stats = all_stats()
    children: dict[int, list[int]] = {}
    for st in stats:
        children.setdefault(st.ppid, []).append(st.pid)
    found = [root]
    i = 0
    while i < len(found):
        found.extend(children.get(found[i], ()))
        i += 1
    return found


def all_stats() -> list[Stat]:
    out: list[Stat] = []
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            st = read_stat(int(entry.name))
            if st is not None:
                out.append(st)
    return out


def parse_schedstat(text: str) -> int:
    """Nanoseconds on a CPU from a ``schedstat`` line (run time, wait time, timeslices)."""
    return int(text.split()[0])


@dataclass(frozen=True, slots=True)
class CpuSample:
    """The CPU time of some processes at one moment (:func:`cpu_sample`)."""

    ticks: dict[int, int]  # pid -> utime + stime, in clock ticks: the whole process
    threads: dict[int, dict[int, int]]  # pid -> tid -> ns on a CPU; {} where unreadable


def _thread_ns(pid: int) -> dict[int, int]:
    out: dict[int, int] = {}
    try:
        tids = [entry.name for entry in (PROC / str(pid) / "task").iterdir()]
    except OSError:
        return out
    for tid in tids:
        try:
            out[int(tid)] = parse_schedstat(
                (PROC / str(pid) / "task" / tid / "schedstat").read_text()
            )
        except (OSError, ValueError, IndexError):
            continue  # exited since the listing, or no schedstat in this kernel
    return out


def cpu_sample(pids: Iterable[int]) -> CpuSample:
    ticks: dict[int, int] = {}
    threads: dict[int, dict[int, int]] = {}
    for pid in pids:
        st = read_stat(pid)
        if st is None:
            continue  # gone: it counts in neither sample
        threads[pid] = _thread_ns(pid)
        ticks[pid] = st.utime + st.stime
    return CpuSample(ticks, threads)


@dataclass(frozen=True, slots=True)
class CpuDelta:
    seconds: float
    grain_s: float  # the resolution: a clock tick if any process was read in ticks, else 1 ns


def cpu_between(before: CpuSample, after: CpuSample) -> CpuDelta:
    """CPU the processes of ``after`` spent since ``before``.

    Per process: the nanosecond sum of its threads when every thread of ``before`` is still
    alive (an exited thread's time is only in the ticks); otherwise the ticks. A process
    that is new in ``after`` counts whole; one gone by then counts nothing.
    """
    total = 0.0
    grain = 1e-9
    for pid, ticks in after.ticks.items():
        old_threads = before.threads.get(pid)
        new_threads = after.threads[pid]
        if old_threads and new_threads and old_threads.keys() <= new_threads.keys():
            total += (sum(new_threads.values()) - sum(old_threads.values())) / 1e9
        else:
            total += (ticks - before.ticks.get(pid, 0)) / CLOCK_TICKS
            grain = 1 / CLOCK_TICKS
    return CpuDelta(total, grain)


def rss_kib(pids: Iterable[int], key: str = "VmRSS") -> int:
    total = 0
    for pid in pids:
        try:
            total += parse_status_kib((PROC / str(pid) / "status").read_text(), key)
        except OSError:
            continue
    return total
