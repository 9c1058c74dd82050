"""The collector's thresholds (smgd.gc_tuning): set in the daemon and in the mock engine.

Each check runs in a process of its own: the thresholds are global to an interpreter, and
this one's must stay as pytest found them.
"""

from __future__ import annotations

import subprocess
import sys

from smgd.gc_tuning import GC_THRESHOLDS


def _thresholds_when_the_loop_starts(module: str, call: str) -> tuple[int, ...]:
    """The thresholds a process has once ``call`` reaches ``trio.run`` in ``module`` (the
    loop itself is not started: ``trio.run`` only prints them)."""
    code = f"""
import gc, types
import {module} as entry
entry.trio = types.SimpleNamespace(run=lambda *a, **k: print(*gc.get_threshold()))
{call}
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    return tuple(int(x) for x in out)


def test_the_defaults_differ_so_the_checks_below_can_fail() -> None:
    code = "import gc; print(*gc.get_threshold())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert tuple(int(x) for x in out.stdout.split()) != GC_THRESHOLDS


def test_the_mock_engine_runs_its_steps_with_the_tuned_thresholds() -> None:
    call = (
        "from smgd.cli import build_parser\n"
        "args = build_parser().parse_args(['mock-engine', '--input', 'ipc:///nonexistent/in', "
        "'--output', 'ipc:///nonexistent/out'])\n"
        "entry.mock_engine_main(args)"
    )
    assert _thresholds_when_the_loop_starts("smgd.mock.main", call) == GC_THRESHOLDS
