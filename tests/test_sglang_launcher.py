"""launchers/sglang_scheduler.py's in-process scheduler, without SGLang: the ready line, the
exit on SIGTERM, and SGLang's "signal the parent on failure" kept away from smgd.

The launcher runs the scheduler in its own process (issue 21), so the scheduler's parent is
smgd: SGLang's scheduler and watchdog send SIGQUIT to their parent when they fail, which would
reach smgd. The launcher makes that failure end the scheduler's own process instead. Each case
runs the launcher module in a child of a small "smgd" process that reports any SIGQUIT it
gets. The real scheduler is covered by tests/real_engines/test_launcher_rss.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from smgd import launch

LAUNCHERS = Path(launch.__file__).parent / "launchers"

# A stand-in for psutil with its real semantics for the two calls SGLang makes.
FAKE_PSUTIL = """
import os, types
class Process:
    def __init__(self, pid=None):
        self.pid = os.getpid() if pid is None else pid
    def parent(self):
        with open(f"/proc/{self.pid}/stat") as f:
            return Process(int(f.read().rsplit(")", 1)[1].split()[1]))
    def send_signal(self, sig):
        os.kill(self.pid, sig)
psutil = types.SimpleNamespace(Process=Process)
"""


def _as_child_of_smgd(child_code: str) -> tuple[int, str, str]:
    """Run ``child_code`` (with the launcher imported as ``launcher``) under a parent that
    records SIGQUIT; (the child's exit code, its stdout, what the parent saw)."""
    child = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(LAUNCHERS)!r})
        import sglang_scheduler as launcher
        """
    )
    child += textwrap.dedent(FAKE_PSUTIL) + textwrap.dedent(child_code)
    parent = textwrap.dedent(
        f"""
        import signal, subprocess, sys
        got = []
        signal.signal(signal.SIGQUIT, lambda *_: got.append("SIGQUIT"))
        done = subprocess.run([sys.executable, "-c", {child!r}], capture_output=True, text=True)
        sys.stderr.write(done.stderr)
        print(done.returncode)
        print(",".join(got) or "nothing")
        sys.stdout.write(done.stdout)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", parent], capture_output=True, text=True, check=True, timeout=60
    )
    code, seen, rest = out.stdout.split("\n", 2)
    return int(code), rest, seen


def test_a_failing_scheduler_ends_its_own_process_not_smgd() -> None:
    code, _, seen = _as_child_of_smgd(
        """
        launcher._keep_signals_from_smgd(psutil)
        # What run_scheduler_process does when the scheduler raises:
        psutil.Process().parent().send_signal(signal.SIGQUIT)
        print("not reached")
        """
    )
    assert seen == "nothing", "smgd got the scheduler's SIGQUIT"
    assert code == 1  # EXIT_SCHEDULER_FAILED


def test_without_the_guard_smgd_would_get_sigquit() -> None:
    # The control: SGLang's own behaviour in a process whose parent is smgd.
    code, out, seen = _as_child_of_smgd(
        """
        psutil.Process().parent().send_signal(signal.SIGQUIT)
        print("went on")
        """
    )
    assert (code, out.strip(), seen) == (0, "went on", "SIGQUIT")


def test_other_processes_keep_their_real_parent() -> None:
    code, out, seen = _as_child_of_smgd(
        """
        real = psutil.Process(os.getppid()).parent().pid
        launcher._keep_signals_from_smgd(psutil)
        print(psutil.Process(os.getppid()).parent().pid == real)
        print(type(psutil.Process().parent()).__name__)
        """
    )
    assert (code, seen) == (0, "nothing")
    assert out.split() == ["True", "_NoParent"]


def test_the_ready_line_names_this_process_as_the_scheduler() -> None:
    code, out, _ = _as_child_of_smgd(
        """
        report = launcher._ReadyReport(512, 0.0)
        report.send({"max_total_num_tokens": 4096, "max_req_input_len": 500, "other": 1})
        print(os.getpid())
        """
    )
    assert code == 0
    line, pid = out.strip().splitlines()
    assert line.startswith(launch.READY_PREFIX)
    ready = json.loads(line[len(launch.READY_PREFIX) :])
    assert ready["scheduler_pid"] == int(pid)
    assert (ready["max_total_num_tokens"], ready["max_req_input_len"]) == (4096, 500)
    assert ready["context_length"] == 512


def test_sigterm_ends_the_scheduler_with_the_shells_code() -> None:
    code, _, seen = _as_child_of_smgd(
        """
        signal.signal(signal.SIGTERM, launcher._exit_on)
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pause()
        """
    )
    assert (code, seen) == (128 + 15, "nothing")
