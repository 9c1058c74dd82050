"""smgd.launch and launchers/lifeline.py: no engine process outlives smgd, and an engine an
earlier smgd left running is found and killed (or refused) before the sockets are bound.

The death-signal cases run real processes: a parent (standing in for smgd) is SIGKILLed and
the test watches its children disappear."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from smgd import launch
from smgd.errors import TransportError
from smgd.launch import PID_FILE, PidRecord, proc_stat, reap_orphans, write_pid_file
from smgd.linelog import BURST_LINES, RATE_LINES_S, REPORT_S

from .engine_harness import short_ipc_dir

LAUNCHERS = Path(launch.__file__).parent / "launchers"
# A child of a SIGKILLed parent is gone within milliseconds (the kernel's signal) or within
# one pidfd wakeup (a lifeline thread); 5 s is only a bound for a loaded machine.
GONE_WITHIN_S = 5.0


def gone(pid: int) -> bool:
    return proc_stat(pid) is None  # exited (a zombie waiting for init counts as gone)


def wait_gone(pids: list[int], within: float = GONE_WITHIN_S) -> list[int]:
    """The pids still alive after ``within`` seconds (killed then, so nothing leaks)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and not all(gone(p) for p in pids):
        time.sleep(0.01)
    left = [p for p in pids if not gone(p)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


def run_parent(
    code: str, lines: int, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], list[str]]:
    """Start a Python parent process; read the first ``lines`` lines it prints."""
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert parent.stdout is not None
    got = [parent.stdout.readline().strip() for _ in range(lines)]
    return parent, got


def sigkill(parent: subprocess.Popen[str]) -> None:
    parent.kill()
    parent.wait()
    assert parent.stdout is not None
    parent.stdout.close()


# --------------------------------------------------------------------------- death signal


def test_a_launched_engine_dies_at_once_with_smgd_not_with_a_worker_thread() -> None:
    # `sleep` does nothing to notice its parent: only the kernel's death signal can end it.
    # trio's worker threads retire after IDLE_TIMEOUT idle seconds (10 s); made 50 ms here,
    # so if the child had been forked from one, the signal would already have killed it.
    parent, (pid,) = run_parent(
        """
        import trio, trio._core._thread_cache as cache
        from smgd import launch
        cache.IDLE_TIMEOUT = 0.05
        async def main():
            async with trio.open_nursery() as nursery:
                child = await launch.spawn(nursery, "e", ["sleep", "60"])
                await trio.to_thread.run_sync(lambda: None)
                await trio.sleep(0.5)  # every worker thread has retired by now
                print(child.pid, flush=True)
                await trio.sleep_forever()
        trio.run(main)
        """,
        lines=1,
    )
    child = int(pid)
    try:
        assert not gone(child), "the engine died while smgd lived on"
        stat = proc_stat(child)
        assert stat is not None
        assert stat.sid == child, "the engine leads its own session"
    finally:
        sigkill(parent)
    assert wait_gone([child]) == [], "the engine outlived smgd"


def test_the_lifeline_refuses_to_start_when_its_parent_is_already_gone() -> None:
    # The parent pid given is not the real parent: as if smgd died before the engine
    # could take its death signal.
    done = subprocess.run(
        [*launch.tethered(["true"])[:4], "1", "--", "true"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 70
    assert "is gone; not starting" in done.stderr


def _launcher_child(launcher: str, how: str) -> str:
    """A parent that is one of the real engine launchers (for multiprocessing's purposes)
    and starts one idle child the way engines do; prints the child's pid."""
    return f"""
        import multiprocessing as mp, os, sys, time
        sys.path.insert(0, {str(LAUNCHERS)!r})  # as for a launcher run by path
        import lifeline
        lifeline.tie_children()  # what the launcher's own module code did in the parent
        # A spawned child re-runs the main module as __mp_main__: make that the launcher.
        sys.modules["__main__"].__file__ = {str(LAUNCHERS / launcher)!r}
        if {how!r} == "spawn":
            child = mp.get_context("spawn").Process(target=time.sleep, args=(60,))
            child.start()
            pid = child.pid
        else:
            pid = os.fork()
            if pid == 0:
                time.sleep(60)
                os._exit(0)
        print(pid, flush=True)
        time.sleep(60)
    """


@pytest.mark.parametrize("how", ["spawn", "fork"])
@pytest.mark.parametrize("launcher", ["vllm_engine.py", "sglang_scheduler.py"])
def test_children_of_an_engine_launcher_die_with_it(launcher: str, how: str) -> None:
    # vLLM's CPU worker and the resource tracker beside SGLang's scheduler (which now runs in
    # the launched process itself) are multiprocessing children of the launched process; the
    # kernel's death signal is cleared in them, so the launcher file ties them.
    parent, (pid,) = run_parent(_launcher_child(launcher, how), lines=1)
    child = int(pid)
    try:
        time.sleep(0.3)  # the child is up and idle
        assert not gone(child)
    finally:
        sigkill(parent)
    assert wait_gone([child]) == [], "the launcher's child outlived it"


def test_a_child_whose_parent_died_before_it_tied_itself_dies_at_once() -> None:
    # hold_parent finds a parent other than the one recorded: the real one is gone already.
    done = subprocess.run(
        [sys.executable, "-c", "import lifeline, time; lifeline.hold_parent(); time.sleep(30)"],
        env={**os.environ, "PYTHONPATH": str(LAUNCHERS), "SMGD_LIFELINE_PARENT": "1"},
        check=False,
        timeout=20,
    )
    assert done.returncode == -signal.SIGKILL


# --------------------------------------------------------------------------- pid files


def _sleeper(*, tree: bool = False) -> subprocess.Popen[bytes]:
    """A stand-in engine in its own session; with ``tree``, it has a child of its own."""
    argv = ["sh", "-c", "sleep 60 & exec sleep 60"] if tree else ["sleep", "60"]
    return subprocess.Popen(argv, start_new_session=True)


def _record(pid: int, owner: int, **changes: int) -> PidRecord:
    stat, owner_stat = proc_stat(pid), proc_stat(owner)
    fields = {
        "pid": pid,
        "start": stat.start if stat else 0,
        "smgd_pid": owner,
        "smgd_start": owner_stat.start if owner_stat else 0,
    } | changes
    return PidRecord(engine="e0", command="sleep 60", **fields)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


async def test_an_engine_left_by_a_dead_smgd_is_killed_with_its_whole_tree(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ipc_dir = short_ipc_dir()
    engine = _sleeper(tree=True)
    await trio.sleep(0.1)  # sh has forked its child
    members = launch.session_members(engine.pid)
    assert len(members) == 2
    owner = _dead_pid()
    write_pid_file(ipc_dir / PID_FILE, _record(engine.pid, owner, smgd_start=1))
    with caplog.at_level(logging.WARNING, logger="smgd.launch"):
        await reap_orphans(ipc_dir, "e0")
    engine.wait()
    assert wait_gone(members, within=0.5) == []
    assert not (ipc_dir / PID_FILE).exists()
    (record,) = caplog.records
    assert record.getMessage().startswith(
        f"engine e0: killing 2 process(es) of an engine left running by smgd pid {owner}, "
        f"which is gone: pid {engine.pid} (sleep 60)"
    )


async def test_stragglers_of_a_leftover_engine_whose_leader_died_are_killed() -> None:
    ipc_dir = short_ipc_dir()
    engine = _sleeper(tree=True)
    await trio.sleep(0.1)
    (straggler,) = [p for p in launch.session_members(engine.pid) if p != engine.pid]
    record = _record(engine.pid, _dead_pid(), smgd_start=1)
    engine.kill()
    engine.wait()
    write_pid_file(ipc_dir / PID_FILE, record)
    await reap_orphans(ipc_dir, "e0")
    assert wait_gone([straggler], within=0.5) == []


async def test_a_pid_file_whose_pid_is_another_process_now_kills_nothing() -> None:
    ipc_dir = short_ipc_dir()
    bystander = _sleeper()
    try:
        # Same pid, another start time: the engine is long gone and the pid was reused.
        write_pid_file(ipc_dir / PID_FILE, _record(bystander.pid, _dead_pid(), start=1))
        await reap_orphans(ipc_dir, "e0")
        assert bystander.poll() is None
        assert not (ipc_dir / PID_FILE).exists()
    finally:
        bystander.kill()
        bystander.wait()


async def test_an_engine_of_another_live_smgd_is_refused_naming_both() -> None:
    ipc_dir = short_ipc_dir()
    engine, other_smgd = _sleeper(), _sleeper()
    try:
        write_pid_file(ipc_dir / PID_FILE, _record(engine.pid, other_smgd.pid))
        with pytest.raises(TransportError) as caught:
            await reap_orphans(ipc_dir, "e0")
        assert str(caught.value) == (
            f"engine e0: {ipc_dir} is in use by another smgd (pid {other_smgd.pid}), which "
            f"runs engine pid {engine.pid} there; stop that smgd or give this one another run_dir"
        )
        assert engine.poll() is None, "another smgd's engine is not ours to kill"
        assert (ipc_dir / PID_FILE).exists()
    finally:
        for proc in (engine, other_smgd):
            proc.kill()
            proc.wait()


async def test_our_own_engine_is_left_alone() -> None:
    ipc_dir = short_ipc_dir()
    engine = _sleeper()
    try:
        write_pid_file(ipc_dir / PID_FILE, _record(engine.pid, os.getpid()))
        await reap_orphans(ipc_dir, "e0")
        assert engine.poll() is None
        assert (ipc_dir / PID_FILE).exists()
    finally:
        engine.kill()
        engine.wait()


async def test_an_unreadable_pid_file_is_removed_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ipc_dir = short_ipc_dir()
    (ipc_dir / PID_FILE).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="smgd.launch"):
        await reap_orphans(ipc_dir, "e0")
    assert not (ipc_dir / PID_FILE).exists()
    assert "ignoring unreadable engine pid file" in caplog.text


async def test_spawn_records_the_engine_and_stop_removes_the_record() -> None:
    ipc_dir = short_ipc_dir()
    pid_file = ipc_dir / PID_FILE
    async with trio.open_nursery() as nursery:
        child = await launch.spawn(nursery, "e0", ["sleep", "60"], pid_file=pid_file)
        record = launch.read_pid_file(pid_file)
        stat, own = proc_stat(child.pid), proc_stat(os.getpid())
        assert stat is not None and own is not None
        assert record == PidRecord(
            engine="e0",
            pid=child.pid,
            start=stat.start,
            smgd_pid=os.getpid(),
            smgd_start=own.start,
            command="sleep 60",
        )
        await child.stop(grace=5)
    assert child.proc.returncode == -signal.SIGTERM
    assert not pid_file.exists()


async def test_stop_keeps_a_pid_file_that_names_a_newer_engine() -> None:
    ipc_dir = short_ipc_dir()
    pid_file = ipc_dir / PID_FILE
    async with trio.open_nursery() as nursery:
        old = await launch.spawn(nursery, "e0", ["sleep", "60"], pid_file=pid_file)
        new = await launch.spawn(nursery, "e0", ["sleep", "60"], pid_file=pid_file)
        await old.stop(grace=5)
        record = launch.read_pid_file(pid_file)
        assert record is not None and record.pid == new.pid
        await new.stop(grace=5)
    assert not pid_file.exists()


async def test_a_missing_program_is_a_launch_error_not_an_exit_code() -> None:
    async with trio.open_nursery() as nursery:
        with pytest.raises(TransportError, match="cannot launch '/nonexistent/engine'"):
            await launch.spawn(nursery, "e0", ["/nonexistent/engine"])


async def test_a_spawn_cancelled_after_the_fork_stops_and_reaps_what_it_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A shutdown that lands while an engine is being relaunched must not leave it running."""
    started: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def recording_popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        popen = real_popen(*args, **kwargs)
        started.append(popen)
        return popen

    monkeypatch.setattr(subprocess, "Popen", recording_popen)
    pid_file = short_ipc_dir() / PID_FILE
    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as scope:
            scope.cancel()  # spawn's first checkpoint comes after the fork
            await launch.spawn(nursery, "e0", ["sleep", "60"], pid_file=pid_file)
    assert scope.cancelled_caught
    [popen] = started
    assert popen.returncode == -signal.SIGTERM  # stopped and reaped, not left to __del__
    assert not pid_file.exists()


@pytest.mark.parametrize(
    ("line", "report"),
    [
        ('SMGD_READY {"context_length": 4096}', {"context_length": 4096}),
        ("SMGD_READY [4096]", None),
        ('SMGD_READY "ready"', None),
        ("SMGD_READY 4096", None),
        ("SMGD_READY {not json", None),
    ],
)
def test_only_a_json_object_on_the_ready_line_is_the_engines_report(
    line: str, report: dict[str, Any] | None
) -> None:
    """Anything else is logged as unreadable: the engine clients read the report's keys."""
    child = launch.Child("e0", proc=None, pid_file=None)  # type: ignore[arg-type]
    child._line(line, "stdout")
    assert child.ready_event.is_set()
    assert child.ready_info == report


class _Chunks(trio.abc.ReceiveStream):
    """An engine's stdout pipe that yields the given chunks, then ends."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        return self.chunks.pop(0) if self.chunks else b""

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


async def test_an_engine_line_without_an_end_is_logged_in_bounded_pieces(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """4 MiB without a newline (a progress bar drawn with ``\\r``, a dumped blob): smgd held it
    all and re-split it on every read (quadratic), then logged it as one line. It is logged
    in pieces of at most ``MAX_LINE_BYTES``, and the lines after it are read as lines."""
    flood = [b"x" * 65536] * 64
    child = launch.Child("e0", proc=None, pid_file=None)  # type: ignore[arg-type]
    caplog.set_level(logging.INFO, logger="smgd.launch")
    await child._pump(_Chunks([*flood, b"\nafter\nSMGD_READY {}\n"]), "stdout")
    lines = [r.getMessage() for r in caplog.records]
    assert max(map(len, lines)) <= launch.MAX_LINE_BYTES + 100
    assert sum(line.count("x") for line in lines) == 64 * 65536  # nothing dropped
    assert lines[-1] == "[e0] after"
    assert child.ready_event.is_set() and child.ready_info == {}


class _Flood(trio.abc.ReceiveStream):
    """An engine's pipe that floods: ``chunks`` chunks of 1,000 lines each (with ``ready``, the
    ready line in the middle of one), then nothing more, ever, or the end if ``ends``."""

    def __init__(self, chunks: int, *, ends: bool, ready: bool = False) -> None:
        self.left = chunks
        self.ready_at = chunks // 2 if ready else -1
        self.ends = ends
        self.sent = 0  # lines, the ready line not counted

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        if not self.left:
            if not self.ends:
                await trio.sleep_forever()
            return b""
        self.left -= 1
        lines = b"flood line\n" * 1000
        self.sent += 1000
        if self.left == self.ready_at:
            lines = lines[:5500] + b'SMGD_READY {"context_length": 512}\n' + lines[5500:]
        return lines

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


def _not_logged(records: list[logging.LogRecord]) -> int:
    """The lines the pump's reports say were left out."""
    return sum(int(r.getMessage().split()[1]) for r in records if "not logged" in r.getMessage())


async def test_a_flooding_engine_is_logged_within_a_budget_and_the_rest_counted(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    """200,000 lines: a burst and the rate's lines are logged, a report says how many were
    not (every line was logged, on the event loop), and the ready line in the middle of the
    flood is read."""
    child = launch.Child("e0", proc=None, pid_file=None)  # type: ignore[arg-type]
    caplog.set_level(logging.INFO, logger="smgd.launch")
    pipe = _Flood(200, ends=True, ready=True)
    start = trio.current_time()
    await child._pump(pipe, "stdout")
    elapsed = trio.current_time() - start
    floods = [r for r in caplog.records if r.getMessage() == "[e0] flood line"]
    assert len(floods) <= BURST_LINES + RATE_LINES_S * elapsed + 1, (len(floods), elapsed)
    assert len(floods) + _not_logged(caplog.records) == pipe.sent  # every line accounted for
    assert child.ready_event.is_set() and child.ready_info == {"context_length": 512}


async def test_lines_left_out_are_reported_when_the_engine_falls_silent(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    """A flood, then nothing (the pipe stays open): the report still comes, REPORT_S after the
    first line left out, not only when a next line or the end comes."""
    child = launch.Child("e0", proc=None, pid_file=None)  # type: ignore[arg-type]
    caplog.set_level(logging.INFO, logger="smgd.launch")
    pipe = _Flood(10, ends=False)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(child._pump, pipe, "stderr")
        await trio.sleep(REPORT_S + 1.0)
        floods = [r for r in caplog.records if r.getMessage() == "[e0] flood line"]
        assert _not_logged(caplog.records) == pipe.sent - len(floods) > 0
        report = next(r for r in caplog.records if "not logged" in r.getMessage())
        assert report.levelno == logging.WARNING and "of its stderr" in report.getMessage()
        nursery.cancel_scope.cancel()


def test_an_engine_killed_by_a_signal_is_reported_by_the_signals_name() -> None:
    assert launch.exit_reason(3) == "engine process exited with code 3"
    assert launch.exit_reason(-9) == "engine process exited with code -9 (killed by SIGKILL)"
    assert launch.exit_reason(-11) == "engine process exited with code -11 (killed by SIGSEGV)"
    assert launch.exit_reason(-99) == "engine process exited with code -99 (killed by signal 99)"
