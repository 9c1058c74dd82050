"""Child processes smgd starts and supervises: engines (SGLang, vLLM, TokenSpeed) and the mock.

A :class:`Child` runs in its own session (process group) so stopping it stops the engine's
whole tree (SGLang's launcher forks the scheduler). Its stdout/stderr lines are logged with an
``[engine]`` prefix, within a budget per stream (:mod:`smgd.linelog`: a flood is counted, not
logged); a line ``SMGD_READY {json}`` on stdout is the launcher's report of what the
engine said at start-up (context length, KV size) and is kept as :attr:`Child.ready_info`.

No engine outlives smgd, however smgd ends (kill -9 included):

- every child starts through ``launchers/lifeline.py``, which has the kernel SIGKILL it when
  smgd dies (``PR_SET_PDEATHSIG``) and ties the engine's own children to it in turn;
- the kernel sends that signal when the *thread* that forked the child ends, so children are
  forked from the calling thread, trio's (trio's own ``open_process`` forks from a worker
  thread, which exits after a few idle seconds and would take the engine with it);
- each launched engine leaves a pid file in its ipc directory; before binding, a client
  calls :func:`reap_orphans`, which kills whatever an smgd that is gone left running there
  (its whole session), so a leftover engine can never connect to the new sockets.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NamedTuple

import msgspec
import trio

from smgd import ipc
from smgd.config import resolve_path
from smgd.errors import TransportError
from smgd.linelog import BURST_LINES, RATE_LINES_S, REPORT_S, Lines, LineSplitter

if TYPE_CHECKING:
    from collections.abc import Sequence

    from smgd.config import Config, EngineConfig

log = logging.getLogger("smgd.launch")

READY_PREFIX = "SMGD_READY "
# After SIGTERM, how long a child gets to exit before SIGKILL. SGLang's scheduler shuts its
# process tree down in well under a second; 5 s leaves room for a busy engine.
TERMINATE_GRACE_S = 5.0
LAUNCHERS_DIR = Path(__file__).parent / "launchers"
LIFELINE = LAUNCHERS_DIR / "lifeline.py"
PID_FILE = "engine.pid"
# After SIGKILL, how long the processes of a leftover engine get to disappear. A SIGKILLed
# process is gone within milliseconds unless it is in an uninterruptible sleep (a hung device
# or network filesystem), and then waiting longer would not help either.
REAP_TIMEOUT_S = 5.0
REAP_POLL_S = 0.02  # how often the reaper looks again; a kill takes a few ms
# The longest engine output line smgd keeps whole; a longer one (a progress bar drawn with
# "\r" alone, a dumped blob) is logged in pieces of this size. Holding it all grew without
# bound, and every read re-split it (quadratic in its length, on the event loop).
MAX_LINE_BYTES = 64 * 1024
# The capacity smgd asks for each of a child's output pipes (F_SETPIPE_SZ; Linux's default is
# 64 KiB, and 1 MiB is the most an unprivileged process may set, /proc/sys/fs/pipe-max-size).
# A flooding child's output is read in chunks up to this size; see FLOOD_PACE_S.
PIPE_BYTES = 1 << 20
# While a stream is over its log budget, the pump waits this long after each read. A flood
# read as it comes was one wakeup per few KiB (20,000 a second, ~60 % of a core for 120 MB/s
# of short lines); a pause lets the pipe fill, so it is ~100 reads a second of up to 1 MiB,
# each only counted (docs/performance.md, "Engine output floods"). A child that writes more
# than PIPE_BYTES in one pause waits in its write for the rest of it: paced, never stopped.
# 10 ms adds at most that to the ready line of an engine that floods before it.
FLOOD_PACE_S = 0.01
# How long a launched engine whose peer left its socket gets to exit before the disconnect
# is the reason given: a crashing engine closes its sockets, then exits (its atexit handlers,
# its worker processes) and the exit code is the news. A kill -9 is seen at once; only a
# process that lives on after leaving its socket costs the wait.
EXIT_REPORT_S = 0.5
# How often Process.wait polls where pidfds are unavailable (Linux < 5.3).
WAIT_POLL_S = 0.05
_DAEMON_ONLY_ENV = frozenset(
    {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"}
)


# --------------------------------------------------------------------------- processes


class ProcStat(NamedTuple):
    """What ``/proc/<pid>/stat`` says about a live process."""

    ppid: int
    pgid: int
    sid: int
    start: int  # clock ticks after boot: with the pid, it names one process for the uptime
    uid: int


def proc_stat(pid: int) -> ProcStat | None:
    """The process ``pid`` if it is alive (a zombie is not: it only waits to be reaped)."""
    path = Path(f"/proc/{pid}")
    try:
        text = (path / "stat").read_text()
        uid = path.stat().st_uid
    except (OSError, ValueError):
        return None
    # The command name (field 2) is in parentheses and may hold anything: split after it.
    fields = text.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):  # fields[0] is field 3, the state
        return None
    return ProcStat(
        ppid=int(fields[1]), pgid=int(fields[2]), sid=int(fields[3]), start=int(fields[19]), uid=uid
    )


def session_members(sid: int) -> list[int]:
    """Live processes of session ``sid``: an engine's whole tree, even after its leader died.

    The kernel does not reuse a pid while a session still carries it as its id, so every
    process found here belongs to the session that pid once started.
    """
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = proc_stat(int(entry.name))
            if stat is not None and stat.sid == sid:
                found.append(int(entry.name))
    return found


class Process:
    """A child process as trio sees it: pid, exit status, output pipes.

    Made from a :class:`subprocess.Popen` started on the calling thread (see :func:`spawn`);
    waits on a pidfd, like ``trio.Process``.
    """

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.stdout = _stream(popen.stdout)
        self.stderr = _stream(popen.stderr)
        self._lock = trio.Lock()
        self._pidfd: int | None
        try:
            self._pidfd = os.pidfd_open(popen.pid)
        except OSError:
            self._pidfd = None

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    async def wait(self) -> int:
        async with self._lock:
            if self._popen.poll() is None:
                if self._pidfd is not None:
                    await trio.lowlevel.wait_readable(self._pidfd)
                else:
                    while self._popen.poll() is None:  # noqa: ASYNC110 - no event without pidfds
                        await trio.sleep(WAIT_POLL_S)
                self._popen.wait()  # readable means exited: this only reaps it
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
        assert self._popen.returncode is not None
        return self._popen.returncode


def _stream(pipe: IO[bytes] | None) -> trio.lowlevel.FdStream:
    assert pipe is not None
    fd = os.dup(pipe.fileno())
    pipe.close()
    # Room for a flood while the pump pauses (PIPE_BYTES); refused past the user's pipe
    # quota (fs.pipe-user-pages-soft), where the pipe keeps its 64 KiB and works as before.
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    return trio.lowlevel.FdStream(fd)


# --------------------------------------------------------------------------- pid files


class PidRecord(msgspec.Struct, frozen=True):
    """``<ipc_dir>/engine.pid``: which engine process runs there, and which smgd started it."""

    engine: str
    pid: int
    start: int
    smgd_pid: int
    smgd_start: int
    command: str


def _own_start() -> int:
    stat = proc_stat(os.getpid())
    assert stat is not None  # we are alive
    return stat.start


def _alive(pid: int, start: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat.start == start


def read_pid_file(path: Path) -> PidRecord | None:
    try:
        return msgspec.json.decode(path.read_bytes(), type=PidRecord)
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError) as exc:
        log.warning("ignoring unreadable engine pid file %s: %s", path, exc)
        with contextlib.suppress(OSError):
            path.unlink()
        return None


def write_pid_file(path: Path, record: PidRecord) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.encode(record))
    os.replace(tmp, path)  # atomic: a reader never sees half a file


async def reap_orphans(ipc_dir: Path, name: str) -> None:
    """Kill an engine left running in ``ipc_dir`` by an smgd that is gone; call before binding.

    Such an engine would connect to the sockets bound next (ZMQ reconnects on its own): a
    vLLM engine core would hold its rank identity on the input socket so the new engine
    could never register, an SGLang scheduler would take a share of the requests. Its whole
    session is SIGKILLed (a warning names it). An engine another *live* smgd started there
    is refused with a :class:`TransportError` naming both; our own is left alone.
    """
    path = ipc_dir / PID_FILE
    record = read_pid_file(path)
    if record is None:
        return
    leader = proc_stat(record.pid)
    if leader is not None and leader.start != record.start:
        # The pid is another process now, so the engine's session is empty: the kernel
        # does not reuse a pid still in use as a session id.
        members: list[int] = []
    else:
        members = session_members(record.pid)
    owner_alive = _alive(record.smgd_pid, record.smgd_start)
    if owner_alive and record.smgd_pid == os.getpid():
        return  # ours: stopped by its own client
    if owner_alive:
        if members:
            raise TransportError(
                f"engine {name}: {ipc_dir} is in use by another smgd (pid {record.smgd_pid}), "
                f"which runs engine pid {record.pid} there; stop that smgd or give this one "
                "another run_dir"
            )
        return  # that smgd's engine is gone; its own client clears the file
    if members:
        log.warning(
            "engine %s: killing %d process(es) of an engine left running by smgd pid %d, "
            "which is gone: pid %d (%s)",
            name,
            len(members),
            record.smgd_pid,
            record.pid,
            record.command,
        )
        await _kill_session(record.pid, members, name)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


async def _kill_session(sid: int, members: list[int], name: str) -> None:
    for pid in members:
        with contextlib.suppress(ProcessLookupError):
            try:
                os.kill(pid, signal.SIGKILL)
            except PermissionError:
                raise TransportError(
                    f"engine {name}: cannot kill process {pid} of a leftover engine "
                    f"({ipc.command_line(pid)}): it belongs to another user"
                ) from None
    with trio.move_on_after(REAP_TIMEOUT_S):
        while session_members(sid):  # noqa: ASYNC110 - no event tells when a process is gone
            await trio.sleep(REAP_POLL_S)
        return
    left = session_members(sid)
    raise TransportError(
        f"engine {name}: processes {left} of a leftover engine survived SIGKILL for "
        f"{REAP_TIMEOUT_S:g} s (uninterruptible sleep?)"
    )


# --------------------------------------------------------------------------- children


def exit_reason(code: int) -> str:
    """A launched engine's exit as the reason it died; a negative code names its signal (a
    shell would have said 137 for -9: neither says "SIGKILL" to an operator)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"engine process exited with code {code} (killed by {name})"
    return f"engine process exited with code {code}"


async def peer_left_reason(child: Child | None, reason: str) -> str:
    """Why a peer left an engine socket: the launched process's exit, if it comes within
    ``EXIT_REPORT_S``, else ``reason`` (the disconnect itself)."""
    code = None if child is None else await child.exit_code_within(EXIT_REPORT_S)
    return reason if code is None else exit_reason(code)


class Child:
    def __init__(self, name: str, proc: Process, pid_file: Path | None = None) -> None:
        self.name = name
        self.proc = proc
        self.pid_file = pid_file
        self.ready_info: dict[str, Any] | None = None
        self.ready_event = trio.Event()
        self.exited = trio.Event()
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def owns(self, pid: int) -> bool:
        """Whether process ``pid`` is part of this engine (its own session)."""
        stat = proc_stat(pid)
        return stat is not None and stat.sid == self.proc.pid

    async def _pump(self, stream: trio.abc.ReceiveStream, label: str) -> None:
        """Log the lines of one of the child's pipes, within a :class:`LineSplitter`'s budget.

        The pipe is read to its end whatever is logged: a child whose pipe fills blocks in
        its write. A report of the lines left out is due at an interval even when the child
        writes nothing more, so a receive waits no longer than until then.
        """
        watch = READY_PREFIX.encode() if label == "stdout" else None
        lines = LineSplitter(max_line=MAX_LINE_BYTES, watch=watch)
        while True:
            due = lines.report_due
            with trio.move_on_at(math.inf if due is None else due):
                chunk = await stream.receive_some(PIPE_BYTES)
                if not chunk:
                    break
                # bytes(chunk) is chunk itself for the bytes FdStream reads (no copy).
                taken = lines.feed(bytes(chunk), trio.current_time())
                self._lines(taken, label)
                if self.ready_event.is_set():
                    lines.watch = None  # only the first ready line is read: stop searching
                if taken.suppressed:
                    # Over budget: let the pipe fill before the next read (see FLOOD_PACE_S).
                    await trio.sleep(FLOOD_PACE_S)
            self._report(lines.report(trio.current_time()), label)
        self._lines(lines.end(trio.current_time()), label)
        self._report(lines.report(trio.current_time(), final=True), label)

    def _lines(self, lines: Lines, label: str) -> None:
        for raw in lines.logged:
            self._line(raw.decode(errors="replace").rstrip(), label)
        for raw in lines.watched:  # the ready line, found among the lines left out
            self._line(raw.decode(errors="replace").rstrip(), label)

    def _report(self, suppressed: int, label: str) -> None:
        if suppressed:
            log.warning(
                "[%s] %d line(s) of its %s not logged in the last %g s or less: it wrote "
                "more than %g lines/s after a burst of %d",
                self.name,
                suppressed,
                label,
                REPORT_S,
                RATE_LINES_S,
                BURST_LINES,
            )

    def _line(self, line: str, label: str) -> None:
        if label == "stdout" and line.startswith(READY_PREFIX):
            try:
                report = json.loads(line[len(READY_PREFIX) :])
            except json.JSONDecodeError:
                report = None
            # Only an object is a report: the engine clients read its keys (an array or a
            # string here took the daemon down). Without one they use the model's own.
            if isinstance(report, dict):
                self.ready_info = report
            else:
                log.warning("[%s] unreadable ready line: %s", self.name, line)
            self.ready_event.set()
            return
        log.info("[%s] %s", self.name, line)

    async def wait(self) -> int:
        code = await self.proc.wait()
        self.returncode = code
        self.exited.set()
        return code

    async def exit_code_within(self, seconds: float) -> int | None:
        """The exit code, if the process exits within ``seconds`` (None: it still runs).

        For a peer that left an engine socket: an engine that crashes closes its sockets
        first, and its exit code, which says why, comes a moment later."""
        with trio.move_on_after(seconds):
            await self.exited.wait()
        return self.returncode

    async def stop(self, grace: float = TERMINATE_GRACE_S) -> None:
        """SIGTERM the child itself, SIGKILL its whole process group after ``grace`` seconds.

        Only the leader gets SIGTERM: engines shut their own workers down in order (a vLLM
        engine core whose worker was killed first exits 1 with a traceback). The group kill
        afterwards makes sure nothing of the tree survives.
        """
        try:
            if self.proc.returncode is not None:
                _signal_group(self.proc.pid, signal.SIGKILL)  # stragglers of an exited leader
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
            with trio.move_on_after(grace):
                await self.proc.wait()
            _signal_group(self.proc.pid, signal.SIGKILL)  # anything of the tree still alive
            await self.proc.wait()
        finally:
            self._forget()

    def _forget(self) -> None:
        """Remove the pid file if it still names this child (a relaunch may have replaced it)."""
        if self.pid_file is None:
            return
        record = read_pid_file(self.pid_file)
        if record is not None and record.pid == self.proc.pid:
            with contextlib.suppress(FileNotFoundError):
                self.pid_file.unlink()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def tethered(argv: Sequence[str]) -> list[str]:
    """``argv`` started through the lifeline shim (see the module docstring).

    ``-I -S``: the shim needs nothing but the standard library, and an interpreter without
    site-packages starts in ~10 ms.
    """
    return [sys.executable, "-I", "-S", str(LIFELINE), str(os.getpid()), "--", *argv]


async def spawn(
    nursery: trio.Nursery,
    name: str,
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    pid_file: Path | None = None,
) -> Child:
    """Start ``argv`` in its own session, tied to smgd's life; pump its output into the log.

    With ``pid_file``, record the engine there for :func:`reap_orphans`.
    """
    # systemd's notify/watchdog/socket-activation variables are smgd's own: an engine that
    # inherited them could send READY=1 for smgd or grab the passed listening sockets.
    full_env = {k: v for k, v in os.environ.items() if k not in _DAEMON_ONLY_ENV}
    if env:
        full_env.update(env)
    # The shim execs argv[0]; check it here so a typo is a start-up error, not an exit 127.
    if shutil.which(argv[0], path=full_env.get("PATH", os.defpath)) is None:
        raise TransportError(
            f"engine {name}: cannot launch {argv[0]!r}: not found or not executable"
        )
    log.info("[%s] launching: %s", name, " ".join(argv))
    try:
        # On this (trio's) thread, not a worker thread: the death signal is tied to the
        # thread that forks. Popen uses vfork here: ~0.2 ms of blocking (measured; a few ms
        # when the machine is loaded).
        popen = subprocess.Popen(  # noqa: ASYNC220 - see above
            tethered(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=full_env,
            start_new_session=True,
        )
    except OSError as exc:
        raise TransportError(f"engine {name}: cannot launch {argv[0]!r}: {exc.strerror}") from None
    proc = Process(popen)
    child = Child(name, proc, pid_file)
    try:
        stat = proc_stat(proc.pid)
        if pid_file is not None and stat is not None:
            record = PidRecord(
                engine=name,
                pid=proc.pid,
                start=stat.start,
                smgd_pid=os.getpid(),
                smgd_start=_own_start(),
                command=" ".join(argv),
            )
            try:
                write_pid_file(pid_file, record)
            except OSError as exc:
                log.warning("[%s] cannot write pid file %s: %s", name, pid_file, exc)
        nursery.start_soon(child._pump, proc.stdout, "stdout")
        nursery.start_soon(child._pump, proc.stderr, "stderr")
        await trio.lowlevel.checkpoint()
    except BaseException:
        # Cancelled after the fork (a shutdown or reload while an engine is relaunched): the
        # caller never gets the child, so nothing else would ever stop or reap it.
        with trio.CancelScope(shield=True):
            await child.stop()
        raise
    return child


def mock_argv(wire: str, input_addr: str, output_addr: str, extra: Sequence[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "smgd",
        "mock-engine",
        "--wire",
        wire,
        "--input",
        input_addr,
        "--output",
        output_addr,
        *extra,
    ]


def mock_script_args(engine: EngineConfig, config: Config) -> list[str]:
    """A scripted mock's ``--script`` and the model whose tokenizer writes its replies."""
    if engine.mock.script is None:
        return []
    args = ["--script", str(resolve_path(config, engine.mock.script))]
    args += ["--model-dir", str(resolve_path(config, engine.model_dir))]
    if engine.tokenizer_dir is not None:
        args += ["--tokenizer-dir", str(resolve_path(config, engine.tokenizer_dir))]
    return args


def launcher_script(name: str) -> str:
    return str(LAUNCHERS_DIR / name)
