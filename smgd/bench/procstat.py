"""CPU time and memory of a process tree, read from ``/proc`` (Linux only).

CPU per token is the benchmark's robust number on a noisy shared machine: wall-clock
latencies move with whatever else runs, but the user+system time a process spends per token
does not. :func:`tree_cpu` sums ``utime + stime`` over a process and its live descendants;
take it before and after a run and subtract. Time of children that already exited is counted
through ``cutime``/``cstime`` of the parent only after they are reaped, which is why the
benchmark keeps every measured process alive across a point.

The parsers (:func:`parse_stat`, :func:`parse_status_kib`) are pure so they can be tested on
literal ``/proc`` text.
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


def cpu_seconds(pids: Iterable[int]) -> float:
    """Summed user+system CPU seconds of ``pids`` (processes that are gone count 0)."""
    ticks = 0
    for pid in pids:
        st = read_stat(pid)
        if st is not None:
            ticks += st.utime + st.stime
    return ticks / CLOCK_TICKS


def rss_kib(pids: Iterable[int], key: str = "VmRSS") -> int:
    total = 0
    for pid in pids:
        try:
            total += parse_status_kib((PROC / str(pid) / "status").read_text(), key)
        except OSError:
            continue
    return total
