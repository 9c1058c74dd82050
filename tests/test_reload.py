"""Reload of changed engines: in place, or replaced after a drain, under load, never fatal.

The in-process daemon (tests/daemon_harness.py) with mock engines as real child processes.
Each case streams on every engine while the reload runs and counts every token.
"""

from __future__ import annotations

import io
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import httpx
import msgspec
import pytest
import trio
import trio.testing

from smgd.admission import Admission
from smgd.assets import TINY_MODEL_DIR
from smgd.config import Config, EngineConfig, TimeoutsConfig, WireFamily, load_config
from smgd.engines.base import EngineClient
from smgd.engines.state import EngineState
from smgd.errors import EngineDead, Overloaded, TransportError
from smgd.gateway import Gateway
from smgd.launch import mock_argv
from smgd.reload import IN_PLACE, keep_running, plan, replace_keys
from smgd.router import Router
from smgd.status import run_reload, target_from_config
from smgd.supervise import Supervised, supervise_engine
from smgd.wire.common import EngineInfo, EngineRequest, GenerateRequest, SamplingParams

from .daemon_harness import (
    config_text,
    engine_toml,
    rewrite_config,
    running_daemon,
    stream_result,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from smgd.reload import ReloadResult
    from smgd.zmq_trio import TrioSocket

PROMPT = "The quick brown fox jumps over the lazy dog"


# --------------------------------------------------------------------------- pure parts


def _engine(**changes: Any) -> EngineConfig:
    base = EngineConfig(name="e", wire=WireFamily.MOCK, models=["m"], model_dir=".")
    return msgspec.structs.replace(base, **changes)


@pytest.mark.parametrize(
    "changes",
    [
        {"max_inflight": 8},
        {"max_queue": 256},
        {"queue_timeout_s": 5.0},
        {"timeouts": TimeoutsConfig(silence_s=5.0, health_interval_s=0.0)},
        {"models": ["m", "alias"]},
        {"required": False},
        {"chat_template": "t.jinja"},
    ],
)
def test_smgd_side_keys_apply_in_place(changes: dict[str, Any]) -> None:
    assert replace_keys(_engine(), _engine(**changes)) == []


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"model_dir": "/other"}, "model_dir"),
        ({"wire": WireFamily.SGLANG}, "wire"),
        ({"max_model_len": 2048}, "max_model_len"),
        ({"ipc_dir": "/run/x"}, "ipc_dir"),
        ({"tokenizer_dir": "/tok"}, "tokenizer_dir"),
    ],
)
def test_engine_side_keys_replace_the_engine(changes: dict[str, Any], key: str) -> None:
    assert replace_keys(_engine(), _engine(**changes, max_queue=5)) == [key]


def test_the_reload_guide_lists_exactly_the_in_place_and_replacing_keys() -> None:
    guide = (Path(__file__).parent.parent / "docs" / "how-to" / "reload.md").read_text()

    def keys(row_start: str) -> set[str]:
        (row,) = [line for line in guide.splitlines() if line.startswith(row_start)]
        cell = row.split("|")[1]
        return {key.removesuffix(".*") for key in re.findall(r"`([^`]+)`", cell)}

    in_place = keys("| an engine changed only in")
    replacing = keys("| an engine changed in any other key")
    assert in_place == IN_PLACE
    every = {f.name for f in msgspec.structs.fields(EngineConfig)} - {"name"}
    assert replacing == every - IN_PLACE


def test_restart_keys_keep_their_running_values(tmp_path: Path) -> None:
    path = tmp_path / "smgd.toml"
    engine = engine_toml("e", "m")  # a config has an engine
    path.write_text('run_dir = "/tmp/a"\n[server]\nport = 1\nmax_body_bytes = 10\n' + engine)
    running = load_config(path, environ={})
    path.write_text('run_dir = "/tmp/b"\n[server]\nport = 2\nmax_body_bytes = 20\n' + engine)
    kept = keep_running(load_config(path, environ={}), running)
    assert (kept.run_dir, kept.server.port) == ("/tmp/a", 1)  # need a restart: the old values
    assert kept.server.max_body_bytes == 20  # applies live: the new value


def test_the_plan_sorts_every_engine_by_what_a_reload_does_to_it() -> None:
    running = Config(
        engines=[
            _engine(name="same"),
            _engine(name="gone"),
            _engine(name="tuned"),
            _engine(name="moved"),
            _engine(name="both"),
        ]
    )
    loaded = msgspec.structs.replace(
        running,
        run_dir="/elsewhere",  # needs a restart: reported, and the running value kept
        engines=[
            _engine(name="same"),
            _engine(name="tuned", max_inflight=3),
            _engine(name="moved", ipc_dir="/x"),
            _engine(name="both", max_queue=9, ipc_dir="/y"),
            _engine(name="new"),
        ],
    )
    todo = plan(running, loaded)
    names = {
        kind: [e.name for e in getattr(todo, kind)]
        for kind in ("added", "removed", "changed", "replaced", "in_place", "starts")
    }
    assert names == {
        "added": ["new"],
        "removed": ["gone"],
        "changed": ["tuned", "moved", "both"],
        "replaced": ["moved", "both"],  # one key outside IN_PLACE is enough
        "in_place": ["tuned"],
        "starts": ["new", "moved", "both"],
    }
    assert todo.needs_restart == ["run_dir"]
    assert todo.config.run_dir == running.run_dir
    assert todo.before["both"] == running.engines[4]
    assert plan(running, running).changed == [] and plan(running, running).needs_restart == []


# --------------------------------------------------------------------------- in place


async def test_a_raised_inflight_cap_admits_waiters_at_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    admission = Admission(max_inflight=1, max_queue=10, queue_timeout_s=60.0)
    admitted: list[int] = []

    async def request(i: int) -> None:
        async with admission.slot(i):
            admitted.append(i)
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(request, i)
        await trio.testing.wait_all_tasks_blocked()
        assert (len(admitted), admission.queue_depth) == (1, 2)
        admission.reconfigure(max_inflight=0, max_queue=10, queue_timeout_s=60.0)  # unlimited
        await trio.testing.wait_all_tasks_blocked()
        assert (sorted(admitted), admission.queue_depth) == ([0, 1, 2], 0)
        admission.reconfigure(max_inflight=1, max_queue=0, queue_timeout_s=60.0)
        with pytest.raises(Overloaded, match="queue is full"):  # 3 running, none may wait
            await request(3)
        nursery.cancel_scope.cancel()


class _Quiet(EngineClient):
    """A ready engine that never says anything (a wedged one), for the watchdogs."""

    wire = "fake"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config, fallback_info=None)
        self.probes: list[float] = []

    def _input_socket(self) -> TrioSocket:
        return cast("TrioSocket", _Silent())

    def _output_socket(self) -> TrioSocket:
        return cast("TrioSocket", _Silent())

    async def _open(self, nursery: trio.Nursery) -> None:
        await trio.lowlevel.checkpoint()

    async def _become_ready(self) -> EngineInfo:
        await trio.lowlevel.checkpoint()
        return EngineInfo(max_model_len=100, vocab_size=10)

    async def _close(self) -> None:
        await trio.lowlevel.checkpoint()

    def _encode_request(self, req: EngineRequest) -> list[bytes]:
        return [b"req"]

    def _encode_abort(self, rid: str) -> list[bytes]:
        return [b"abort"]

    async def probe_health(self, limit_s: float) -> None:
        self.probes.append(trio.current_time())
        await trio.lowlevel.checkpoint()


async def test_a_lowered_silence_limit_applies_at_once(autojump_clock: trio.abc.Clock) -> None:
    engine = _Quiet(_engine(timeouts=TimeoutsConfig(silence_s=60.0, health_interval_s=0.0)))
    request = GenerateRequest(rid="r", prompt_ids=[1], sampling=SamplingParams(max_tokens=5))
    with pytest.RaisesGroup(EngineDead, flatten_subgroups=True):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            await engine.wait_ready()
            async with engine.open_stream(request) as stream:
                await trio.sleep(20)  # silent for 20 s: fine under a 60 s limit
                assert engine.state is EngineState.READY
                engine.reconfigure(_engine(timeouts=TimeoutsConfig(silence_s=5.0)))
                changed_at = trio.current_time()
                with pytest.raises(EngineDead, match="no output for 5 s"):
                    await stream.receive()
                assert trio.current_time() - changed_at < 1.0


async def test_a_health_probe_turned_on_by_a_reload_runs(autojump_clock: trio.abc.Clock) -> None:
    engine = _Quiet(_engine(timeouts=TimeoutsConfig(health_interval_s=0.0)))
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        await engine.wait_ready()
        await trio.sleep(100)
        assert engine.probes == []  # 0: no probe
        engine.reconfigure(_engine(timeouts=TimeoutsConfig(health_interval_s=10.0)))
        await trio.sleep(25)
        assert [round(t - 100) for t in engine.probes] == [10, 20]
        nursery.cancel_scope.cancel()


# --------------------------------------------------------------------------- supervision


class _Silent:
    """A socket nothing ever arrives on, that takes whatever is sent."""

    async def recv_multipart_batch(self, limit: int) -> list[list[bytes]]:
        await trio.sleep_forever()

    def send_multipart_nowait(self, frames: list[bytes]) -> None:
        pass


def _building(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    make: Callable[[EngineConfig], EngineClient],
) -> Gateway:
    """A gateway whose engine supervisors build their clients with ``make``, with the
    supervisor's warnings captured."""
    monkeypatch.setattr("smgd.supervise.build_engine_client", lambda engine, *_: make(engine))
    caplog.set_level(logging.WARNING, logger="smgd.supervise")
    return Gateway(config=Config(), router=Router(Config().routing))


class _NeverReady(EngineClient):
    """A client whose engine never completes its handshake (as a wedged vLLM engine)."""

    wire = "fake"

    def _input_socket(self) -> TrioSocket:
        return cast("TrioSocket", _Silent())

    def _output_socket(self) -> TrioSocket:
        return cast("TrioSocket", _Silent())

    async def _open(self, nursery: trio.Nursery) -> None:
        await trio.lowlevel.checkpoint()

    async def _become_ready(self) -> EngineInfo:
        ready_s = self.config.timeouts.ready_s
        await trio.sleep(ready_s)
        self.die(f"the engine did not complete the handshake within {ready_s:g} s")
        raise EngineDead(self.last_error or "not ready")

    async def _close(self) -> None:
        await trio.lowlevel.checkpoint()


async def test_a_handshake_loop_names_its_cause_in_the_log_and_in_last_error(
    autojump_clock: trio.abc.Clock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = _engine(timeouts=TimeoutsConfig(ready_s=5.0))
    gateway = _building(monkeypatch, caplog, partial(_NeverReady, fallback_info=None))
    cause = "the engine did not complete the handshake within 5 s"
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(supervise_engine, gateway, Supervised(config)))
        # Attempt 1 fails at t=5, the relaunch (after 1 s) is handshaking at t=6.5.
        await trio.sleep(6.5)
        client = gateway.router.get("e")
        assert client is not None and client.state is EngineState.STARTING
        assert client.last_error == cause  # the new client still says why it was needed
        nursery.cancel_scope.cancel()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"engine e failed: {cause}; restarting in 1.0 s"]


class _Buggy(_NeverReady):
    async def _become_ready(self) -> EngineInfo:
        await trio.sleep(1)
        info: dict[str, EngineInfo] = {}
        return info["the engine's"]  # a bug: KeyError


async def test_a_bug_in_an_engine_client_relaunches_that_engine_not_ends_the_daemon(
    autojump_clock: trio.abc.Clock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = _engine(timeouts=TimeoutsConfig(ready_s=5.0))
    gateway = _building(monkeypatch, caplog, partial(_Buggy, fallback_info=None))
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(supervise_engine, gateway, Supervised(config)))
        await trio.sleep(2.5)  # attempt 1 failed at t=1; attempt 2 started at t=2
        client = gateway.router.get("e")
        assert client is not None and client.state is EngineState.STARTING
        assert gateway.engine_restarts == {"e": 1}
        nursery.cancel_scope.cancel()
    cause = "unexpected error in smgd's engine client: KeyError("
    assert client.last_error is not None and client.last_error.startswith(cause)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage() for r in errors] == ["engine e: unexpected error in its client"]
    assert errors[0].exc_info is not None  # the traceback, for the bug report


class _LoadsLongThenCrashes(_NeverReady):
    """An engine that takes 100 s to load, then crashes 1 s after it is ready."""

    async def _open(self, nursery: trio.Nursery) -> None:
        await trio.lowlevel.checkpoint()
        nursery.start_soon(self._crash_after, 101.0)

    async def _crash_after(self, seconds: float) -> None:
        await trio.sleep(seconds)
        self.die("engine process exited with code 1")

    async def _become_ready(self) -> EngineInfo:
        await trio.sleep(100)
        return EngineInfo(max_model_len=64)


async def test_an_engine_that_crashes_right_after_a_long_load_backs_off_more_each_time(
    autojump_clock: trio.abc.Clock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The backoff starts over after BACKOFF_RESET_S of health: time the engine was ready,
    not time since its launch (a 100 s load counted, and it relaunched every second)."""
    config = _engine()
    gateway = _building(monkeypatch, caplog, partial(_LoadsLongThenCrashes, fallback_info=None))
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(supervise_engine, gateway, Supervised(config)))
        await trio.sleep(4 * 101 + 1 + 2 + 4 + 1)  # four crashes, three waits between
        nursery.cancel_scope.cancel()
    records = [r for r in caplog.records if r.name == "smgd.supervise"]
    delays = [r.getMessage().rsplit(" in ", 1)[1] for r in records]
    assert delays == ["1.0 s", "2.0 s", "4.0 s", "8.0 s"]


class _HealthyAWhileThenCrashes(_LoadsLongThenCrashes):
    """Ready at once, then up for 70 s (more than BACKOFF_RESET_S) before each crash."""

    async def _open(self, nursery: trio.Nursery) -> None:
        await trio.lowlevel.checkpoint()
        nursery.start_soon(self._crash_after, 70.0)

    async def _become_ready(self) -> EngineInfo:
        await trio.lowlevel.checkpoint()
        return EngineInfo(max_model_len=64)


async def test_an_engine_that_was_healthy_a_while_relaunches_after_the_initial_delay(
    autojump_clock: trio.abc.Clock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = _engine()
    gateway = _building(monkeypatch, caplog, partial(_HealthyAWhileThenCrashes, fallback_info=None))
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(supervise_engine, gateway, Supervised(config)))
        await trio.sleep(3 * 71 + 0.5)
        nursery.cancel_scope.cancel()
    records = [r for r in caplog.records if r.name == "smgd.supervise"]
    assert [r.getMessage().rsplit(" in ", 1)[1] for r in records] == ["1.0 s"] * 3


class _CannotBind(_NeverReady):
    async def _open(self, nursery: trio.Nursery) -> None:
        await trio.lowlevel.checkpoint()
        raise TransportError("engine e: cannot bind ipc:///x: Address already in use")


async def test_last_error_is_the_newest_cause_not_the_carried_one(
    autojump_clock: trio.abc.Clock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = _engine(timeouts=TimeoutsConfig(ready_s=5.0))
    kinds = iter([_NeverReady, _CannotBind, _NeverReady])
    gateway = _building(monkeypatch, caplog, lambda engine: next(kinds)(engine, fallback_info=None))
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(supervise_engine, gateway, Supervised(config)))
        await trio.sleep(6.5)  # attempt 1 failed at t=5; attempt 2 failed to bind at t=6
        client = gateway.router.get("e")
        assert client is not None
        assert client.last_error == "engine e: cannot bind ipc:///x: Address already in use"
        nursery.cancel_scope.cancel()
    assert [r.getMessage() for r in caplog.records if r.name == "smgd.supervise"] == [
        "engine e failed: the engine did not complete the handshake within 5 s;"
        " restarting in 1.0 s",
        "engine e failed: engine e: cannot bind ipc:///x: Address already in use;"
        " restarting in 2.0 s",
    ]


# --------------------------------------------------------------------------- the whole daemon


async def _stream_into(
    client: httpx.AsyncClient, model: str, max_tokens: int, results: list[tuple[int, Any]]
) -> None:
    """One stream; appends (completion tokens, error event or None)."""
    _, usage, _, error = await stream_result(client, model, PROMPT, max_tokens)
    results.append((int(usage["completion_tokens"]) if usage else 0, error))  # type: ignore[call-overload]


def _spawn_streams(
    nursery: trio.Nursery,
    client: httpx.AsyncClient,
    plan: dict[str, tuple[int, int]],
) -> dict[str, list[tuple[int, Any]]]:
    """``plan``: model -> (streams, max_tokens). Returns the per-model results lists."""
    results: dict[str, list[tuple[int, Any]]] = {model: [] for model in plan}
    for model, (count, tokens) in plan.items():
        for _ in range(count):
            nursery.start_soon(_stream_into, client, model, tokens, results[model])
    return results


async def _streaming(
    gateway: Gateway, counts: dict[str, int], results: dict[str, list[tuple[int, Any]]]
) -> None:
    """Until each engine named in ``counts`` has had that many streams (engine ``x`` serves
    model ``m-x``): in flight, or already done on a machine slow to start the others."""
    with trio.fail_after(30):
        while not all(  # noqa: ASYNC110 - counts change on the engines' reader tasks
            (e := gateway.router.get(name)) is not None
            and e.in_flight + len(results[f"m-{name}"]) >= n
            for name, n in counts.items()
        ):
            await trio.sleep(0.01)


def _pid(gateway: Gateway, name: str) -> int:
    client = gateway.router.get(name)
    child = getattr(client, "child", None)
    assert child is not None, f"engine {name} has no launched process"
    return int(child.pid)


async def _serves(gateway: Gateway, client: httpx.AsyncClient, name: str, model: str) -> None:
    engine = gateway.router.get(name)
    assert engine is not None
    with trio.fail_after(30):
        await engine.wait_ready()
    _, usage, _, error = await stream_result(client, model, PROMPT, 5)
    assert error is None and usage is not None and usage["completion_tokens"] == 5


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
async def test_admission_limits_and_timeouts_apply_in_place_under_load(tmp_path: Path) -> None:
    path = tmp_path / "smgd.toml"
    keep = engine_toml("keep", "m-keep", step_ms=10)
    path.write_text(config_text(keep, engine_toml("other", "m-other", step_ms=10)))
    async with running_daemon(path) as (daemon, client):
        gateway = daemon.gateway
        before, pid = gateway.router.get("other"), _pid(gateway, "other")
        async with trio.open_nursery() as nursery:
            results = _spawn_streams(nursery, client, {"m-keep": (32, 100), "m-other": (32, 100)})
            await _streaming(gateway, {"keep": 32, "other": 32}, results)
            changed = engine_toml(
                "other",
                "m-other",
                step_ms=10,
                extra="max_queue = 256\nmax_inflight = 40\nqueue_timeout_s = 5.0\n"
                "[engines.timeouts]\nsilence_s = 30.0\n",
            )
            rewrite_config(path, keep, changed)
            result = await daemon.reload()
        assert result.ok and result.changed == ["other"] and result.replaced == []
        # Nothing was interrupted: every token of every stream, the same client and process.
        assert results == {"m-keep": [(100, None)] * 32, "m-other": [(100, None)] * 32}
        engine = gateway.router.get("other")
        assert engine is before and _pid(gateway, "other") == pid
        assert engine is not None and engine.config.timeouts.silence_s == 30.0
        assert (engine.admission.max_queue, engine.admission.queue_timeout_s) == (256, 5.0)
        # The new cap is live: 40 in flight, the 41st waits in the queue.
        async with trio.open_nursery() as nursery:
            _spawn_streams(nursery, client, {"m-other": (41, 300)})
            with trio.fail_after(30):
                while engine.admission.queue_depth < 1:  # noqa: ASYNC110 - admission's own count
                    await trio.sleep(0.01)
            assert engine.admission.in_use == 40
            nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_a_changed_launched_engine_drains_then_is_replaced_under_load(
    tmp_path: Path,
) -> None:
    path = tmp_path / "smgd.toml"
    keep = engine_toml("keep", "m-keep", step_ms=10)
    path.write_text(config_text(keep, engine_toml("other", "m-other", step_ms=10), drain_s=20))
    async with running_daemon(path) as (daemon, client):
        gateway = daemon.gateway
        old, kept = gateway.router.get("other"), gateway.router.get("keep")
        old_pid, keep_pid = _pid(gateway, "other"), _pid(gateway, "keep")
        refused: list[httpx.Response] = []
        async with trio.open_nursery() as nursery:
            results = _spawn_streams(nursery, client, {"m-keep": (32, 100), "m-other": (32, 80)})
            await _streaming(gateway, {"keep": 32, "other": 32}, results)
            rewrite_config(path, keep, engine_toml("other", "m-other", step_ms=4), drain_s=20)
            done: list[ReloadResult] = []

            async def reload() -> None:
                done.append(await daemon.reload())

            nursery.start_soon(reload)
            with trio.fail_after(10):
                while old is not None and old.state_name != "draining":  # noqa: ASYNC110
                    await trio.sleep(0.01)
            # While it drains, its model answers 503 + Retry-After (not 404: it is configured).
            body = {"model": "m-other", "prompt": "x", "max_tokens": 2}
            refused.append(await client.post("/v1/completions", json=body))
        [result] = done
        assert result.ok and result.changed == result.replaced == ["other"], result
        assert refused[0].status_code == 503 and "retry-after" in refused[0].headers
        # Its in-flight streams finished first (drain), the other engine's were never touched.
        assert results == {"m-keep": [(100, None)] * 32, "m-other": [(80, None)] * 32}
        assert not _alive(old_pid)  # fully stopped before the new one bound its sockets
        new = gateway.router.get("other")
        assert new is not old and new is not None and new.config.mock.step_ms == 4
        assert gateway.router.get("keep") is kept and _pid(gateway, "keep") == keep_pid
        await _serves(gateway, client, "other", "m-other")
        assert gateway.engine_restarts == {}


@pytest.mark.slow
async def test_streams_past_the_drain_timeout_end_with_an_error_event(tmp_path: Path) -> None:
    path = tmp_path / "smgd.toml"
    keep = engine_toml("keep", "m-keep", step_ms=10)
    path.write_text(config_text(keep, engine_toml("other", "m-other", step_ms=10), drain_s=0.5))
    async with running_daemon(path) as (daemon, client):
        gateway = daemon.gateway
        async with trio.open_nursery() as nursery:
            results = _spawn_streams(nursery, client, {"m-keep": (16, 150), "m-other": (16, 1000)})
            await _streaming(gateway, {"keep": 16, "other": 16}, results)
            rewrite_config(path, keep, engine_toml("other", "m-other", step_ms=5), drain_s=0.5)
            with trio.fail_after(15):
                result = await daemon.reload()
        assert result.ok and result.replaced == ["other"]
        assert results["m-keep"] == [(150, None)] * 16
        # Cut mid-stream: an error event (then [DONE]), no usage chunk, not a silent truncation.
        assert len(results["m-other"]) == 16
        for tokens, error in results["m-other"]:
            assert tokens == 0 and error is not None, error
            assert error["message"] == "engine other stopped"
        await _serves(gateway, client, "other", "m-other")


@pytest.mark.slow
async def test_a_changed_external_engine_is_replaced_and_reattaches(tmp_path: Path) -> None:
    path = tmp_path / "smgd.toml"
    keep = engine_toml("keep", "m-keep", step_ms=10)
    external = (
        f'[[engines]]\nname = "ext"\nwire = "sglang"\nmodels = ["m-ext"]\n'
        f'model_dir = "{TINY_MODEL_DIR}"\nmax_model_len = {{len}}\n'
    )
    path.write_text(config_text(keep, external.format(len=4096)))
    run_dir = Path(load_config(path, environ={}).run_dir or "")
    argv = mock_argv(
        "sglang",
        f"ipc://{run_dir}/ext/in.sock",
        f"ipc://{run_dir}/ext/out.sock",
        ["--step-ms", "10", "--context-len", "4096"],
    )
    # Not launched by smgd: an engine someone else runs, attached to smgd's sockets.
    engine = await trio.lowlevel.open_process(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        async with running_daemon(path) as (daemon, client):
            gateway = daemon.gateway
            old = gateway.router.get("ext")
            async with trio.open_nursery() as nursery:
                results = _spawn_streams(nursery, client, {"m-keep": (32, 100), "m-ext": (32, 60)})
                await _streaming(gateway, {"keep": 32, "ext": 32}, results)
                rewrite_config(path, keep, external.format(len=2048))
                result = await daemon.reload()
            assert result.ok and result.replaced == ["ext"], result
            assert results == {"m-keep": [(100, None)] * 32, "m-ext": [(60, None)] * 32}
            assert gateway.router.get("ext") is not old
            await _serves(gateway, client, "ext", "m-ext")  # the same engine process re-attached
            assert engine.returncode is None
            models = (await client.get("/v1/models")).json()["data"]
            assert {m["id"]: m["max_model_len"] for m in models}["m-ext"] == 2048
    finally:
        engine.kill()
        with trio.CancelScope(shield=True):
            await engine.wait()


@pytest.mark.slow
async def test_every_engine_changed_at_once_under_load(tmp_path: Path) -> None:
    path = tmp_path / "smgd.toml"
    names = ("a", "b", "c")
    path.write_text(config_text(*(engine_toml(n, f"m-{n}", step_ms=10) for n in names)))
    async with running_daemon(path) as (daemon, client):
        gateway = daemon.gateway
        old = {n: gateway.router.get(n) for n in names}
        async with trio.open_nursery() as nursery:
            plan = {f"m-{n}": (21 + (n == "a"), 100) for n in names}  # 64 streams
            results = _spawn_streams(nursery, client, plan)
            await _streaming(gateway, dict.fromkeys(names, 21), results)
            rewrite_config(
                path,
                engine_toml("a", "m-a", step_ms=5),  # replaced
                engine_toml("b", "m-b", step_ms=5, extra="max_queue = 8\n"),  # replaced
                engine_toml("c", "m-c", step_ms=10, extra="max_queue = 8\n"),  # in place
            )
            result = await daemon.reload()
        assert result.ok and result.changed == ["a", "b", "c"] and result.replaced == ["a", "b"]
        assert results == {f"m-{n}": [(100, None)] * (21 + (n == "a")) for n in names}
        assert gateway.router.get("c") is old["c"]
        for n in names:
            await _serves(gateway, client, n, f"m-{n}")
        new_b = gateway.router.get("b")
        assert new_b is not None and new_b.admission.max_queue == 8


@pytest.mark.slow
async def test_a_reload_that_cannot_be_applied_is_refused_whole(tmp_path: Path) -> None:
    # A model without a context length in its config.json, on a wire that needs one.
    model = tmp_path / "model"
    shutil.copytree(TINY_MODEL_DIR, model)
    config_json = (model / "config.json").read_text()
    (model / "config.json").write_text(config_json.replace('"max_position_embeddings"', '"x"'))
    path = tmp_path / "smgd.toml"
    keep = engine_toml("keep", "m-keep", step_ms=10)
    path.write_text(config_text(keep))
    async with running_daemon(path) as (daemon, client):
        gateway = daemon.gateway
        before, pid, config = gateway.router.get("keep"), _pid(gateway, "keep"), gateway.config
        bad = (
            f'[[engines]]\nname = "bad"\nwire = "sglang"\nmodels = ["m-bad"]\n'
            f'model_dir = "{model}"\n'
        )
        rewrite_config(path, engine_toml("keep", "m-keep", step_ms=5), bad)
        result = await daemon.reload()
        assert not result.ok
        assert "$.engines[1].max_model_len" in (result.error or "")
        # Nothing changed: not the valid half either.
        assert gateway.config is config
        assert gateway.router.get("keep") is before and _pid(gateway, "keep") == pid
        assert gateway.router.get("bad") is None
        await _serves(gateway, client, "keep", "m-keep")


@pytest.mark.slow
async def test_a_reload_to_a_file_without_an_engine_is_refused(tmp_path: Path) -> None:
    # An editor's or a deploy tool's half-written file: a reload must not remove every engine.
    path = tmp_path / "smgd.toml"
    path.write_text(config_text(engine_toml("keep", "m-keep", step_ms=10)))
    async with running_daemon(path) as (daemon, client):
        gateway = daemon.gateway
        before, config = gateway.router.get("keep"), gateway.config
        run_line = path.read_text().split("\n", 1)[0]
        for text in ("", run_line + "\n[server]\n"):
            path.write_text(text)
            result = await daemon.reload()
            assert not result.ok
            assert (result.error or "").startswith("config error at $.engines: no engine")
        assert gateway.config is config and gateway.router.get("keep") is before
        await _serves(gateway, client, "keep", "m-keep")


@pytest.mark.slow
async def test_a_bug_in_checking_a_reload_refuses_it_and_smgd_serves_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "smgd.toml"
    path.write_text(config_text(engine_toml("keep", "m-keep", step_ms=10)))
    async with running_daemon(path) as (daemon, client):
        gateway = daemon.gateway
        before, config = gateway.router.get("keep"), gateway.config

        def broken_plan(*args: object) -> None:
            raise RuntimeError("a bug in planning")

        monkeypatch.setattr("smgd.supervise.plan", broken_plan)
        rewrite_config(path, engine_toml("keep", "m-keep", step_ms=5))
        result = await daemon.reload()
        assert not result.ok
        assert result.error == "internal error: RuntimeError: a bug in planning"
        assert gateway.config is config and gateway.router.get("keep") is before
        assert gateway.reload_failures_total == 1
        await _serves(gateway, client, "keep", "m-keep")


@pytest.mark.slow
async def test_a_reload_while_smgd_drains_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "smgd.toml"
    path.write_text(config_text(engine_toml("keep", "m-keep", step_ms=10), drain_s=30))
    async with running_daemon(path) as (daemon, client):
        gateway = daemon.gateway
        config = gateway.config
        async with trio.open_nursery() as nursery:
            results = _spawn_streams(nursery, client, {"m-keep": (4, 100)})
            await _streaming(gateway, {"keep": 4}, results)
            daemon.drain()
            rewrite_config(
                path, engine_toml("keep", "m-keep", step_ms=10), engine_toml("new", "m-new")
            )
            result = await daemon.reload()
        assert not result.ok and result.error == "smgd is draining (shutting down)"
        assert gateway.config is config and gateway.router.get("new") is None
        assert results == {"m-keep": [(100, None)] * 4}  # the drain ran on, untouched


@pytest.mark.slow
async def test_an_engine_that_cannot_start_after_a_reload_leaves_smgd_serving(
    tmp_path: Path,
) -> None:
    path = tmp_path / "smgd.toml"
    keep = engine_toml("keep", "m-keep", step_ms=10)
    other = engine_toml("other", "m-other", step_ms=10)
    path.write_text(config_text(keep, other))
    broken = (
        '[[engines]]\nname = "other"\nwire = "sglang"\nmodels = ["m-other"]\n'
        f'model_dir = "{TINY_MODEL_DIR}"\n'
        '[engines.launch]\nkind = "command"\ncommand = ["/nonexistent/engine"]\n'
    )
    async with running_daemon(path) as (daemon, client):
        gateway = daemon.gateway
        target = target_from_config(load_config(path, environ={}))
        out, err = io.StringIO(), io.StringIO()
        async with trio.open_nursery() as nursery:
            results = _spawn_streams(nursery, client, {"m-keep": (16, 60)})
            await _streaming(gateway, {"keep": 16}, results)
            rewrite_config(path, keep, broken)
            code = await run_reload(target, out=out, err=err)  # what `smgd reload` does
        # Applied, but an engine is not up: said so, exit 1.
        assert code == 1
        assert out.getvalue() == "reload applied: changed other; replaced other\n"
        assert err.getvalue().startswith(
            "smgd: engine other did not start: engine other: cannot launch '/nonexistent/engine'"
        )
        assert results == {"m-keep": [(60, None)] * 16}
        ready = (await client.get("/readiness")).json()["engines"]
        assert ready["other"]["ready"] is False
        assert "cannot launch" in ready["other"]["last_error"]
        await _serves(gateway, client, "keep", "m-keep")
        # Fixing the file brings it back, without a restart of smgd.
        rewrite_config(path, keep, other)
        result = await daemon.reload()
        assert result.ok and result.replaced == ["other"] and result.failed == {}
        await _serves(gateway, client, "other", "m-other")


@pytest.mark.slow
async def test_readiness_shows_the_cause_through_a_crash_loop(tmp_path: Path) -> None:
    # An engine process that exits after 0.3 s, every time, without attaching.
    crash = (
        '[[engines]]\nname = "crash"\nwire = "sglang"\nmodels = ["m-crash"]\n'
        f'model_dir = "{TINY_MODEL_DIR}"\n'
        f'[engines.launch]\nkind = "command"\ncommand = ["{sys.executable}", "-c", '
        '"import time, sys; time.sleep(0.3); sys.exit(3)"]\n'
    )
    path = tmp_path / "smgd.toml"
    path.write_text(config_text(crash))
    async with running_daemon(path, wait_ready=False) as (daemon, client):
        gateway = daemon.gateway
        with trio.fail_after(20):
            while True:
                report = (await client.get("/readiness")).json()["engines"]["crash"]
                if report["restarts"] >= 1 and report["state"] == "starting":
                    break  # a relaunched engine that has not failed (yet) this time
                await trio.sleep(0.02)
        assert report["last_error"] == "engine process exited with code 3"
        admin = [e.statistics() for e in gateway.router.engines()]  # what `smgd status` shows
        assert admin[0].last_error == "engine process exited with code 3"


@pytest.mark.slow
async def test_sighup_with_a_changed_engine_keeps_smgd_running(tmp_path: Path) -> None:
    """The issue's reproduction: only max_queue changed, then SIGHUP; smgd used to exit 1."""
    path = tmp_path / "smgd.toml"
    text = config_text(engine_toml("mock", "m", step_ms=10))
    path.write_text(text)
    async with running_daemon(path, install_signals=True) as (daemon, client):
        gateway = daemon.gateway
        path.write_text(text.replace('wire = "mock"', 'wire = "mock"\nmax_queue = 256'))
        before = gateway.reloads_total
        os.kill(os.getpid(), signal.SIGHUP)
        with trio.fail_after(10):
            while gateway.reloads_total == before:  # noqa: ASYNC110 - counter, no event
                await trio.sleep(0.02)
        await _serves(gateway, client, "mock", "m")
        path.write_text(text.replace("step_ms = 10", "step_ms = 4"))
        before = gateway.reloads_total
        os.kill(os.getpid(), signal.SIGHUP)
        with trio.fail_after(20):
            while gateway.reloads_total == before:  # noqa: ASYNC110 - counter, no event
                await trio.sleep(0.02)
        assert gateway.reload_failures_total == 0
        await _serves(gateway, client, "mock", "m")
        engine = gateway.router.get("mock")
        assert engine is not None and engine.config.mock.step_ms == 4
