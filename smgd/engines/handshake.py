"""The engine-dials-in topology shared by vLLM and TokenSpeed: handshake, ranks, re-attach.

smgd binds three sockets and the engine connects to them:

- a handshake ROUTER: each engine rank (DEALER, ZMQ identity = its index as 2 bytes LE) sends
  HELLO, smgd answers INIT with the data-plane addresses, the rank answers READY;
- an input ROUTER (``ROUTER_MANDATORY``: a send to a rank whose DEALER is gone fails at once with
  ``EHOSTUNREACH`` instead of being dropped); each rank's first message on it is its
  registration (ready response: context length, KV size...);
- an output PULL shared by all ranks; every output batch names its rank in-band.

A rank is *registered* once HELLO, READY and its registration arrived (READY and registration
may come in either order). The engine is ready when the expected number of ranks registered.

Sans-IO cores here: :class:`HandshakeTracker` (the per-identity state machine) and
:class:`RankTable` (least-load rank selection with per-rank in-flight sets). The trio shell is
:class:`HandshakeEngineClient`; subclasses supply the wire's codec through small hooks.

Re-attach: at readiness the client writes the ranks and what they registered to a state file
next to its ipc sockets. A client that starts on the same addresses while that engine still
runs (a daemon restart) sees the ranks' DEALERs reconnect on their own (ZMQ reconnects) and
is ready again without a handshake, which engines only do at their own start-up.

Death, beyond the base class's rules: the ``ENGINE_CORE_DEAD`` frame, a rank's DEALER leaving
the input socket (socket monitor), ``EHOSTUNREACH`` on send, a registered rank saying HELLO
again (it restarted: its requests are gone), the launched process's exit.

A stuck handshake is an error with a reason, never a silent wait: a rank that said READY but
whose registration does not follow within :data:`REGISTRATION_GRACE_S` is one whose input
connection the ROUTER refused because another process already holds its identity there (an
engine left over by an earlier smgd: ZMQ refuses a second connection with a known identity).
The error names the processes connected to the input socket that smgd did not launch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
import trio
import zmq

from smgd import ipc, launch
from smgd.engines.base import EngineClient
from smgd.engines.output_watch import watch_output
from smgd.engines.state import EngineState
from smgd.errors import EngineDead, TransportError, WireError
from smgd.wire.common import EngineInfo, EngineLoad, EngineRequest, TokenDelta
from smgd.zmq_trio import TrioSocket, open_monitor

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from smgd.config import EngineConfig
    from smgd.wire.common import LoraAdapter

log = logging.getLogger("smgd.engine.handshake")

ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
HELLO = "HELLO"
READY = "READY"
STATE_FILE = "engine-state.json"
# A rank sends its registration (on the input socket) and READY (on the handshake socket) back
# to back; they arrive within milliseconds of each other, in either order. A registration
# still missing this long after READY never left the rank's DEALER: the ROUTER refused the
# connection. 10 s is far beyond any scheduling delay on a loaded machine.
REGISTRATION_GRACE_S = 10.0
# Both engines use unlimited HWMs on their side (vLLM's make_zmq_socket): a bounded HWM on
# ours would drop (ROUTER) or stall (PULL) a burst the engine itself would have absorbed.
UNLIMITED_HWM = 0
# SMG's least-load penalty (#2131): a rank with a queue whose KV cache is over half full will
# preempt or stall new work, so each waiting request there costs up to 3 extra "slots" (6 x 0.5
# at a full cache). Below half full the queue drains by itself and only the counts matter.
KV_PRESSURE_FROM = 0.5
KV_PRESSURE_WEIGHT = 6.0


# --------------------------------------------------------------------------- sans-IO: handshake


@dataclass
class RankProgress:
    identity: bytes
    hello: bool = False
    ready: bool = False
    info: EngineInfo | None = None
    dp_size: int = 1
    ready_at: float | None = None  # when READY came (for REGISTRATION_GRACE_S)
    hellos: int = 0  # HELLOs before registration (a repeat: a second process or a restart)

    @property
    def index(self) -> int:
        return identity_index(self.identity)

    @property
    def registered(self) -> bool:
        return self.hello and self.ready and self.info is not None


class HelloAction(NamedTuple):
    send_init: bool
    restarted: bool  # a registered rank said HELLO again: its process restarted


def identity_index(identity: bytes) -> int:
    """2-byte little-endian engine index; other identities (not an engine's) map to -1."""
    return int.from_bytes(identity, "little") if len(identity) == 2 else -1


class HandshakeTracker:
    """Per-identity HELLO → INIT → READY (+ registration) progress. Pure; no sockets."""

    def __init__(self) -> None:
        self.ranks: dict[bytes, RankProgress] = {}

    def on_hello(self, identity: bytes) -> HelloAction:
        known = self.ranks.get(identity)
        restarted = known is not None and known.registered
        # A repeated HELLO before registration is the rank retrying (or a second process
        # with its identity): start it over, and count it so the caller can say so.
        hellos = known.hellos + 1 if known is not None and not restarted else 1
        self.ranks[identity] = RankProgress(identity, hello=True, hellos=hellos)
        return HelloAction(send_init=True, restarted=restarted)

    def on_ready(self, identity: bytes, now: float = 0.0) -> bool:
        """False when READY comes from an identity that never said HELLO (protocol error)."""
        rank = self.ranks.get(identity)
        if rank is None or not rank.hello:
            return False
        rank.ready = True
        rank.ready_at = now
        return True

    def on_registration(self, identity: bytes, info: EngineInfo, dp_size: int = 1) -> bool:
        rank = self.ranks.setdefault(identity, RankProgress(identity))
        if rank.info is not None:
            return False  # duplicate registration: ignore it, keep the first
        rank.info, rank.dp_size = info, dp_size
        return True

    def registered(self) -> list[RankProgress]:
        return sorted((r for r in self.ranks.values() if r.registered), key=lambda r: r.index)

    def complete(self, expected: int) -> list[RankProgress] | None:
        done = self.registered()
        return done if len(done) >= expected else None

    def overdue(self, now: float, grace: float) -> list[RankProgress]:
        """Ranks that said READY at least ``grace`` ago and still have no registration."""
        return [r for r in self._waiting() if r.ready_at is not None and now - r.ready_at >= grace]

    def next_deadline(self, grace: float) -> float:
        """When the next rank becomes :meth:`overdue` (inf: none is waiting)."""
        times = [r.ready_at + grace for r in self._waiting() if r.ready_at is not None]
        return min(times, default=math.inf)

    def _waiting(self) -> list[RankProgress]:
        return [r for r in self.ranks.values() if r.hello and r.ready and r.info is None]

    def describe(self) -> str:
        """Where the handshake stands, for an error message."""
        if not self.ranks:
            return "no engine rank said HELLO"
        parts = []
        for rank in sorted(self.ranks.values(), key=lambda r: r.index):
            if rank.registered:
                state = "registered"
            elif not rank.hello:
                state = "registration without HELLO"
            elif not rank.ready and rank.info is None:
                state = "INIT sent, no READY and no registration yet"
            elif not rank.ready:
                state = "registered, no READY yet"
            else:
                state = "READY, no registration"
            parts.append(f"rank {rank.index}: {state}")
        return "; ".join(parts)


def merge_info(
    infos: Iterable[EngineInfo], fallback: EngineInfo | None, cap: int | None
) -> EngineInfo:
    """One EngineInfo for all ranks: the smallest context (every rank must fit the request)."""
    items = list(infos)
    if not items:
        raise ValueError("no rank registered")
    max_len = min(i.max_model_len for i in items)
    if cap:
        max_len = min(max_len, cap)
    kv = [i.kv_cache_tokens for i in items if i.kv_cache_tokens is not None]
    seqs = [i.max_num_seqs for i in items if i.max_num_seqs is not None]
    vocab = items[0].vocab_size or (fallback.vocab_size if fallback else None)
    return EngineInfo(
        max_model_len=max_len,
        vocab_size=vocab,
        max_num_seqs=sum(seqs) if seqs else None,
        kv_cache_tokens=sum(kv) if kv else None,
        version=items[0].version,
    )


# --------------------------------------------------------------------------- sans-IO: ranks


@dataclass
class Rank:
    index: int
    identity: bytes
    in_flight: set[str] = field(default_factory=set)
    load: EngineLoad | None = None
    # When the rank last sent a message, or got a request while it had none in flight: the
    # start of its silence (ClientCore._silent_since), so that one rank wedged beside others
    # that stream is found as the whole engine's silence is.
    last_frame: float = 0.0

    def score(self) -> float:
        """SMG's least-load score: the larger of what we sent and what the rank reports."""
        own = len(self.in_flight)
        if self.load is None:
            return float(own)
        reported = self.load.running + self.load.waiting
        score = float(max(own, reported))
        if self.load.waiting and self.load.kv_usage is not None:
            pressure = max(self.load.kv_usage - KV_PRESSURE_FROM, 0.0)
            score += self.load.waiting * KV_PRESSURE_WEIGHT * pressure
        return score


class RankTable:
    """Which rank holds which request; least-load pick with a rotating tie-break."""

    def __init__(self, ranks: Iterable[tuple[int, bytes]]) -> None:
        self.ranks: list[Rank] = [Rank(index, identity) for index, identity in ranks]
        if not self.ranks:
            raise ValueError("a rank table needs at least one rank")
        self._by_index = {r.index: r for r in self.ranks}
        self._owner: dict[str, Rank] = {}
        self._next = 0

    def pick(self, rid: str) -> Rank:
        n = len(self.ranks)
        start, self._next = self._next, (self._next + 1) % n
        best = self.ranks[start]
        best_score = best.score()
        for k in range(1, n):
            rank = self.ranks[(start + k) % n]
            score = rank.score()
            if score < best_score:
                best, best_score = rank, score
        best.in_flight.add(rid)
        self._owner[rid] = best
        return best

    def owner(self, rid: str) -> Rank | None:
        return self._owner.get(rid)

    def by_index(self, index: int) -> Rank | None:
        return self._by_index.get(index)

    def release(self, rid: str) -> Rank | None:
        """Forget ``rid`` (idempotent); returns the rank that held it."""
        rank = self._owner.pop(rid, None)
        if rank is not None:
            rank.in_flight.discard(rid)
            if not rank.in_flight and rank.load is not None:
                # The last snapshot predates the final finish: do not let it repel new work.
                rank.load = msgspec.structs.replace(rank.load, running=0, waiting=0)
        return rank

    def update_load(self, index: int, load: EngineLoad) -> None:
        rank = self._by_index.get(index)
        if rank is not None:
            rank.load = load

    def total_load(self) -> EngineLoad | None:
        loads = [r.load for r in self.ranks if r.load is not None]
        if not loads:
            return None
        kv = [x.kv_usage for x in loads if x.kv_usage is not None]
        return EngineLoad(
            running=sum(x.running for x in loads),
            waiting=sum(x.waiting for x in loads),
            kv_usage=max(kv) if kv else None,
        )


# --------------------------------------------------------------------------- re-attach state


class SavedRank(msgspec.Struct):
    index: int
    info: EngineInfo


class SavedState(msgspec.Struct):
    wire: str
    input: str
    output: str
    ranks: list[SavedRank]


def load_state(path: Path, *, wire: str, input: str, output: str) -> SavedState | None:
    """The saved state if it exists and describes this wire on these addresses."""
    try:
        state = msgspec.json.decode(path.read_bytes(), type=SavedState)
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError) as exc:
        log.warning("ignoring unreadable engine state %s: %s", path, exc)
        return None
    if (state.wire, state.input, state.output) != (wire, input, output) or not state.ranks:
        return None
    return state


def save_state(path: Path, state: SavedState) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.encode(state))
    os.replace(tmp, path)  # atomic: a reader never sees half a file


# --------------------------------------------------------------------------- the trio shell


class Batch(NamedTuple):
    """One decoded output message, engine-neutral."""

    deltas: list[TokenDelta]
    engine_index: int
    load: EngineLoad | None
    # rid -> seconds it waited in the engine's own queue (wires whose engine reports it)
    queue_times: dict[str, float] | None = None


class HandshakeEngineClient(EngineClient):
    """Base for engines that dial in; subclasses implement the ``_wire_*`` hooks."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        fallback_info: EngineInfo | None,
        input_path: str,
        output_path: str,
        handshake: str,
        launch_argv: list[str] | None = None,
        launch_env: dict[str, str] | None = None,
        ranks: int = 1,
        state_path: str | None = None,
        adapters: Sequence[LoraAdapter] = (),
    ) -> None:
        super().__init__(config, fallback_info=fallback_info, adapters=adapters)
        self.input_endpoint = config.addresses.input or f"ipc://{input_path}"
        self.output_endpoint = config.addresses.output or f"ipc://{output_path}"
        self.handshake_endpoint = handshake
        self.launch_argv = launch_argv
        self.launch_env = launch_env
        self.expected_ranks = ranks
        self.ipc_dir = Path(input_path).parent
        self.state_path = Path(state_path or self.ipc_dir / STATE_FILE)
        self.registration_grace_s = REGISTRATION_GRACE_S
        self.child: launch.Child | None = None
        self.tracker = HandshakeTracker()
        self.table: RankTable | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._hs: TrioSocket | None = None
        self._in: TrioSocket | None = None
        self._out: TrioSocket | None = None
        self._progress = trio.Event()
        self._saved: SavedState | None = None
        self._zmtp_peers = 0  # completed ZMTP handshakes on the input socket
        # Identities that said HELLO but are not an engine index (2 bytes): refused.
        self._not_ranks: set[bytes] = set()
        # Why a registration from an identity did not decode: the reason its start fails.
        self._bad_registrations: dict[bytes, str] = {}
        self._peers: set[int] = set()  # connected input-socket peers, by connection fd
        self._peer_pids: dict[int, int] = {}  # their processes (ipc only), by connection fd

    # ------------------------------------------------------------------ wire hooks

    def _wire_status(self, payload: bytes) -> str:
        """HELLO/READY payload → its status. Raises WireError."""
        raise NotImplementedError

    def _wire_init(self, inputs: list[str], outputs: list[str]) -> list[bytes]:
        raise NotImplementedError

    def _wire_registration(self, payload: bytes) -> tuple[EngineInfo, int]:
        """Registration payload → (its info, the data-parallel size it reports)."""
        raise NotImplementedError

    def _wire_add(self, req: EngineRequest) -> list[bytes]:
        """ADD frames without the identity. May raise InvalidRequest."""
        raise NotImplementedError

    def _wire_abort(self, rid: str) -> list[bytes]:
        raise NotImplementedError

    def _wire_outputs(self, frames: list[Any]) -> Batch:
        raise NotImplementedError

    def _ranks_hint(self, dp_size: int) -> int:
        """How many ranks to wait for, given what a registration reported."""
        return self.expected_ranks

    # ------------------------------------------------------------------ lifecycle hooks

    async def _open(self, nursery: trio.Nursery) -> None:
        # Before binding: an engine an earlier smgd left running would connect at once.
        await launch.reap_orphans(self.ipc_dir, self.name)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._ctx = ctx
        inp, out, hs = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL), ctx.socket(zmq.ROUTER)
        for sock in (inp, out, hs):
            sock.setsockopt(zmq.LINGER, 0)
            # Every frame the engine sends: outputs, and its handshake and registration (a
            # few hundred bytes) too, so that no socket reads an engine's multi-GB frame.
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        inp.setsockopt(zmq.ROUTER_MANDATORY, 1)
        inp.setsockopt(zmq.SNDHWM, UNLIMITED_HWM)
        out.setsockopt(zmq.RCVHWM, UNLIMITED_HWM)
        self._in, self._out, self._hs = TrioSocket(inp), TrioSocket(out), TrioSocket(hs)
        # Data plane first, so the addresses INIT hands out are already bound.
        for endpoint, sock in ((self.input_endpoint, inp), (self.output_endpoint, out)):
            _bind(self.name, sock, endpoint)
        self.handshake_endpoint = _bind(self.name, hs, self.handshake_endpoint)
        self._saved = load_state(
            self.state_path, wire=self.wire, input=self.input_endpoint, output=self.output_endpoint
        )
        await nursery.start(self._watch_peers)
        await nursery.start(watch_output, self)
        nursery.start_soon(self._handshake_task)
        if self.launch_argv is not None:
            argv = [self._fill(a) for a in self.launch_argv]
            ipc.prepare_ipc_dir(self.ipc_dir)  # holds the pid file, even with tcp addresses
            self.child = await launch.spawn(
                nursery,
                self.name,
                argv,
                env=self.launch_env,
                pid_file=self.ipc_dir / launch.PID_FILE,
            )
            nursery.start_soon(self._watch_child, self.child)

    def _fill(self, arg: str) -> str:
        """Launch-argv placeholders: the handshake address is known only once bound."""
        host, _, port = self.handshake_endpoint.rpartition(":")
        return (
            arg.replace("{handshake}", self.handshake_endpoint)
            .replace("{handshake_host}", host.removeprefix("tcp://"))
            .replace("{handshake_port}", port)
        )

    async def _watch_peers(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        assert self._in is not None
        kinds = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
        async with open_monitor(self._in, kinds) as events:
            task_status.started()
            async for event in events:
                if event.kind == "accepted":
                    self._peers.add(event.value)
                    pid = ipc.peer_pid(event.value)
                    if pid is not None:
                        self._peer_pids[event.value] = pid
                elif event.kind == "handshake_succeeded":
                    # Only a ZMQ peer gets here; a stale-socket probe connects and leaves raw.
                    self._zmtp_peers += 1
                    self._notify()
                elif event.kind == "disconnected":
                    self._peers.discard(event.value)
                    self._peer_pids.pop(event.value, None)
                    ranks = len(self.table.ranks) if self.table else 0
                    if self.state is EngineState.READY and len(self._peers) < ranks:
                        why = "an engine rank disconnected from the input socket"
                        await self.die_after_peer_left(self.child, why)
                        return

    async def _handshake_task(self) -> None:
        assert self._hs is not None
        while True:
            frames = await self._hs.recv_multipart(copy=True)
            if len(frames) != 2:
                log.warning(
                    "engine %s: handshake message of %d frames ignored", self.name, len(frames)
                )
                continue
            identity, payload = frames
            try:
                status = self._wire_status(payload)
            except WireError as exc:
                log.warning("engine %s: bad handshake message: %s", self.name, exc)
                continue
            index = identity_index(identity)
            if index < 0:
                # Not an engine core (its identity is its 2-byte index): the rank table is
                # built from indexes, and one it cannot name would end the engine's start.
                if identity not in self._not_ranks:
                    self._not_ranks.add(identity)
                    log.warning(
                        "engine %s: handshake from identity %r refused: not an engine index",
                        self.name,
                        identity,
                    )
                continue
            if status == HELLO:
                if self.state is EngineState.READY and identity not in self.tracker.ranks:
                    log.warning(
                        "engine %s: rank %d said HELLO after readiness; restart the engine entry "
                        "to add ranks",
                        self.name,
                        index,
                    )
                    continue
                action = self.tracker.on_hello(identity)
                if action.restarted:
                    self.die(f"engine rank {index} restarted (a new HELLO)")
                    return
                if self.tracker.ranks[identity].hellos > 1:
                    log.warning(
                        "engine %s: rank %d said HELLO again before registering (it restarted, "
                        "or a second process has its identity); starting its handshake over",
                        self.name,
                        index,
                    )
                inputs, outputs = [self.input_endpoint], [self.output_endpoint]
                await self._hs.send_multipart([identity, *self._wire_init(inputs, outputs)])
                log.info("engine %s: rank %d said HELLO; INIT sent", self.name, index)
            elif status == READY and not self.tracker.on_ready(identity, trio.current_time()):
                log.warning("engine %s: READY from rank %d before its HELLO", self.name, index)
            self._notify()

    def _notify(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    async def _become_ready(self) -> EngineInfo:
        ready_s = self.config.timeouts.ready_s
        ranks: list[tuple[int, EngineInfo]] | None = None
        grace = self.registration_grace_s
        refused: RankProgress | None = None
        with trio.move_on_after(ready_s):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._registration_task)
                while True:
                    ranks = self._registered() or self._reattached()
                    if ranks is not None:
                        break
                    overdue = self.tracker.overdue(trio.current_time(), grace)
                    if overdue:
                        refused = overdue[0]
                        break
                    with trio.move_on_at(self.tracker.next_deadline(grace)):
                        await self._progress.wait()
                nursery.cancel_scope.cancel()
        if refused is not None:
            self.die(self._refused_message(refused, grace))
            raise EngineDead(self.last_error or "not ready")
        if ranks is None:
            not_ranks = "".join(
                f"; refused identity {identity!r}: not an engine index (2 bytes)"
                for identity in sorted(self._not_ranks)
            )
            self.die(
                f"the engine did not complete the handshake within {ready_s:g} s "
                f"({self.tracker.describe()}{not_ranks}){self._foreign_peers()}"
            )
            raise EngineDead(self.last_error or "not ready")
        self.table = RankTable((index, index.to_bytes(2, "little")) for index, _ in ranks)
        info = merge_info((i for _, i in ranks), self._fallback_info, self.config.max_model_len)
        saved = SavedState(
            wire=self.wire,
            input=self.input_endpoint,
            output=self.output_endpoint,
            ranks=[SavedRank(index=index, info=i) for index, i in ranks],
        )
        try:
            save_state(self.state_path, saved)
        except OSError as exc:
            log.warning("engine %s: cannot save re-attach state: %s", self.name, exc)
        return info

    def _refused_message(self, rank: RankProgress, grace: float) -> str:
        bad = self._bad_registrations.get(rank.identity)
        if bad is not None:  # it came, but smgd could not read it: no identity conflict
            return (
                f"engine rank {rank.index} said READY but its registration was refused: "
                f"{bad} (does smgd speak this engine's version?)"
            )
        return (
            f"engine rank {rank.index} said READY but its registration did not reach "
            f"{self.input_endpoint} within {grace:g} s: the socket refused its connection, "
            f"because another process holds rank {rank.index}'s identity there (an engine "
            "left running by an earlier smgd, or one configured with the same addresses)"
            f"{self._foreign_peers()}; stop it"
        )

    def _foreign_peers(self) -> str:
        """The input socket's peers that are not part of the launched engine, for a message."""
        child = self.child
        if child is None:
            return ""  # an external engine's ranks may be any processes
        pids = sorted({pid for pid in self._peer_pids.values() if not child.owns(pid)})
        if not pids:
            return ""
        described = ", ".join(f"pid {pid} ({ipc.command_line(pid) or 'gone'})" for pid in pids)
        return f"; connected to it but not launched by smgd: {described}"

    def _registered(self) -> list[tuple[int, EngineInfo]] | None:
        done = self.tracker.registered()
        if not done:
            return None
        expected = max([self.expected_ranks] + [self._ranks_hint(r.dp_size) for r in done])
        if len(done) < expected:
            return None
        return [(r.index, r.info) for r in done if r.info is not None]

    def _reattached(self) -> list[tuple[int, EngineInfo]] | None:
        saved = self._saved
        if saved is None or self.child is not None or self.tracker.ranks:
            return None  # nothing saved, a fresh engine launched, or one is handshaking
        if self._zmtp_peers < len(saved.ranks) or len(self._peers) < len(saved.ranks):
            return None
        log.info("engine %s: re-attached to %d running rank(s)", self.name, len(saved.ranks))
        return [(r.index, r.info) for r in saved.ranks]

    async def _registration_task(self) -> None:
        """Owns the input socket until readiness (the sender has nothing to send before)."""
        assert self._in is not None
        while True:
            frames = await self._in.recv_multipart(copy=True)
            if len(frames) != 2 or not frames[1]:
                log.warning("engine %s: malformed registration (%d frames)", self.name, len(frames))
                continue
            identity, payload = frames
            try:
                info, dp_size = self._wire_registration(payload)
                if info.max_model_len < 1:  # every request would be refused as too long
                    raise WireError(f"max_model_len {info.max_model_len} is no context length")
            except WireError as exc:
                log.warning("engine %s: bad registration: %s", self.name, exc)
                self._bad_registrations[identity] = exc.message
                continue
            if self.tracker.on_registration(identity, info, dp_size):
                log.info(
                    "engine %s: rank %d registered (max_model_len=%d)",
                    self.name,
                    identity_index(identity),
                    info.max_model_len,
                )
            self._notify()

    async def _close(self) -> None:
        if self.child is not None:
            await self.child.stop()
        if self._death is not None or self.child is not None:
            # The engine is gone (dead, or ours and stopped): nothing to re-attach to.
            with contextlib.suppress(OSError):
                self.state_path.unlink(missing_ok=True)
        for sock in (self._hs, self._in, self._out):
            if sock is not None:
                sock.close()
        if self._ctx is not None:
            self._ctx.term()

    def _input_socket(self) -> TrioSocket:
        assert self._in is not None
        return self._in

    def _output_socket(self) -> TrioSocket:
        assert self._out is not None
        return self._out

    # ------------------------------------------------------------------ data plane

    def _encode_request(self, req: EngineRequest) -> list[bytes]:
        frames = self._wire_add(req)  # raises before a rank is reserved
        assert self.table is not None
        rank = self.table.pick(req.rid)
        if len(rank.in_flight) == 1:  # it had none: its silence counts from this request
            rank.last_frame = trio.current_time()
        return [rank.identity, *frames]

    def _encode_abort(self, rid: str) -> list[bytes]:
        assert self.table is not None
        rank = self.table.release(rid) or self.table.ranks[0]
        return [rank.identity, *self._wire_abort(rid)]

    def _forget(self, rid: str) -> None:
        if self.table is not None:
            self.table.release(rid)

    def _silent_since(self) -> float:
        """The engine's last frame, or the oldest last frame of a rank with requests in
        flight if that is older: a data-parallel engine is one engine to smgd (a rank that
        dies kills it), and one rank wedged beside others that stream went unnoticed (its
        requests hung, and the least-load pick kept sending it more)."""
        since = self._last_frame
        if self.table is not None and len(self.table.ranks) > 1:
            for rank in self.table.ranks:
                if rank.in_flight and rank.last_frame < since:
                    since = rank.last_frame
        return since

    def _decode_frames(self, frames: list[Any]) -> Sequence[TokenDelta]:
        head = memoryview(frames[0])
        if head.nbytes == len(ENGINE_CORE_DEAD) and head == ENGINE_CORE_DEAD:
            self.die("the engine sent ENGINE_CORE_DEAD")
            return ()
        batch = self._wire_outputs(frames)
        if self.table is not None and (rank := self.table.by_index(batch.engine_index)):
            rank.last_frame = self._last_frame  # the reader's time of this message
        if batch.load is not None and self.table is not None:
            self.table.update_load(batch.engine_index, batch.load)
            self.load = self.table.total_load()
        if batch.queue_times:
            for rid, waited in batch.queue_times.items():
                stream = self._streams.get(rid)
                if stream is not None:
                    stream.queued_s += waited
        return batch.deltas

    def rank_statistics(self) -> list[dict[str, Any]]:
        """Per-rank in-flight count and last reported load (for /metrics and ops)."""
        if self.table is None:
            return []
        return [
            {"rank": r.index, "in_flight": len(r.in_flight), "load": msgspec.to_builtins(r.load)}
            for r in self.table.ranks
        ]


def _bind(name: str, sock: zmq.Socket[bytes], endpoint: str) -> str:
    """Bind (after ipc hygiene); returns the bound endpoint (``tcp://host:*`` gets its port)."""
    if endpoint.startswith("ipc://"):
        ipc.prepare_ipc_endpoint(endpoint[len("ipc://") :])
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise TransportError(f"engine {name}: cannot bind {endpoint}: {exc.strerror}") from None
    if endpoint.startswith("tcp://"):
        bound = sock.getsockopt(zmq.LAST_ENDPOINT)
        return bound.decode() if isinstance(bound, bytes) else str(bound)
    return endpoint


def derive_handshake_port(path: str) -> int:
    """SMG's handshake port for an ipc base path: 20000 + FNV-1a-64(path) % 10000.

    A pure function of the path, so a launcher can compute the same port without asking us;
    the 20000-29999 band stays below Linux's ephemeral range (32768+).
    """
    h = 0xCBF29CE484222325
    for byte in path.encode():
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return 20000 + h % 10000
