"""The collector's thresholds (smgd.gc_tuning) in the mock engine's process.

Checked in a process of its own: the thresholds are global to an interpreter, and this one's
must stay as pytest found them.
"""

from __future__ import annotations

import subprocess
import sys

from smgd.gc_tuning import GC_THRESHOLDS

# The mock engine's entry point, run up to its trio.run, which only prints the thresholds the
# process has then (the engine itself is not started).
_MOCK_UP_TO_ITS_LOOP = """
import gc, types
import smgd.mock.main as entry
from smgd.cli import build_parser
entry.trio = types.SimpleNamespace(run=lambda *a, **k: print(*gc.get_threshold()))
args = build_parser().parse_args(
    ["mock-engine", "--input", "ipc:///nonexistent/in", "--output", "ipc:///nonexistent/out"]
)
entry.mock_engine_main(args)
"""


def _thresholds(code: str) -> tuple[int, ...]:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    return tuple(int(x) for x in out.stdout.split())


def test_the_defaults_differ_so_the_check_below_can_fail() -> None:
    assert _thresholds("import gc; print(*gc.get_threshold())") != GC_THRESHOLDS


def test_the_mock_engine_runs_its_steps_with_the_tuned_thresholds() -> None:
    assert _thresholds(_MOCK_UP_TO_ITS_LOOP) == GC_THRESHOLDS
