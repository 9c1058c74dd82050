"""smgd's vLLM engine client against a real headless vLLM engine core (CPU, tiny model).

    eval "$(.ci/vllm-env.sh)"   # sets VLLM_PYTHON and VLLM_MODEL
    .venv/bin/python -m pytest -m real_engine -s tests/real_engines/test_vllm_engine.py

The client launches the engine through smgd's launcher, runs the handshake, streams a greedy
request that must stop on EOS only because smgd sent it, aborts one mid-stream (no reply
comes; the client closes it locally and the engine keeps serving), checks the engine core
answers smgd's health probe (the utility call ``is_sleeping``) idle and mid-stream and that the
idle prober, every second, leaves it serving, then SIGKILLs the engine core under four
streams: each stream still open must fail with its own EngineDead.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
import trio

from smgd.config import EngineConfig, TimeoutsConfig, WireFamily
from smgd.engines.state import EngineState
from smgd.engines.vllm import VllmEngineClient, vllm_argv
from smgd.errors import EngineDead
from smgd.launch import launcher_script
from smgd.wire.common import EngineInfo, FinishReason, GenerateRequest, SamplingParams

from ..engine_harness import short_ipc_dir

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]

STARTUP_S = 300.0  # import ~15 s + worker spawn/load ~20 s on an idle box; generous for CI
EOS = 2
# Streams in flight at the SIGKILL, each as long as max-model-len 512 allows (prompt + tokens).
DOOMED_STREAMS = 4
DOOMED_TOKENS = 480
PROMPT = [323, 607, 83, 338, 15, 743, 1373, 310]  # "def hello(world):" in the tiny tokenizer
ENGINE_ARGS = [
    "--dtype", "float32",
    "--max-model-len", "512",
    "--max-num-seqs", "8",
    "--enforce-eager",
    "--kv-cache-memory-bytes", str(64 * 1024 * 1024),
]  # fmt: skip
# The idle prober's period here: several probes run while the test's requests come and go.
HEALTH_INTERVAL_S = 1.0
# How long the test's own probes may take: the engine core answers between two steps, a few
# ms apart for the tiny model; 5 s leaves room for a loaded CI machine.
PROBE_S = 5.0


def req(max_tokens: int, **sampling: object) -> GenerateRequest:
    return GenerateRequest(
        rid=uuid.uuid4().hex,
        prompt_ids=PROMPT,
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
    )


def make_client(python: str, model: str) -> VllmEngineClient:
    ipc_dir = short_ipc_dir()
    config = EngineConfig(
        name="vllm0", wire=WireFamily.VLLM, models=["tiny"], model_dir=model,
        timeouts=TimeoutsConfig(ready_s=STARTUP_S, health_interval_s=HEALTH_INTERVAL_S),
    )  # fmt: skip
    argv = vllm_argv(
        python=python, launcher=launcher_script("vllm_engine.py"), model=model, args=ENGINE_ARGS
    )
    return VllmEngineClient(
        config,
        fallback_info=EngineInfo(max_model_len=512, vocab_size=2048),
        input_path=str(ipc_dir / "in.sock"),
        output_path=str(ipc_dir / "out.sock"),
        handshake=f"ipc://{ipc_dir}/hs.sock",
        launch_argv=argv,
        eos_token_ids=(EOS,),
    )


@dataclass
class KillOutcome:
    killed: bool = False
    errors: list[EngineDead] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # finish reasons of streams that ended


async def kill_under_streams(client: VllmEngineClient, outcome: KillOutcome) -> None:
    """Open DOOMED_STREAMS streams and SIGKILL the engine core once each has its first delta;
    what became of each stream goes into ``outcome`` (a fresh one) as it happens.

    The tiny model writes 480 tokens in ~0.1 s, and on a loaded machine a task woken "once all
    streams started" can run later than that (CI saw all four streams finish before such a
    kill). So the stream whose first delta completes the set kills the engine itself, at once.
    A stream may still have ended before the last one started (on a loaded CI machine, in ten
    rounds running); it counts as finished, and the caller retries if no stream was open.
    """
    assert client.child is not None
    core = client.child.pid
    first_deltas = 0

    async def doomed() -> None:
        nonlocal first_deltas
        try:
            async with client.open_stream(req(DOOMED_TOKENS, ignore_eos=True)) as stream:
                first = True
                async for delta in stream:
                    if first:
                        first = False
                        first_deltas += 1
                        if first_deltas == DOOMED_STREAMS:
                            os.kill(core, signal.SIGKILL)
                            outcome.killed = True
                    if delta.finish is not None:
                        outcome.finished.append(delta.finish.reason.value)
        except EngineDead as exc:
            outcome.errors.append(exc)

    async with trio.open_nursery() as nursery:
        for _ in range(DOOMED_STREAMS):
            nursery.start_soon(doomed)


async def answers_the_probe(client: VllmEngineClient) -> None:
    """The real engine core answers the health probe idle and while it streams (between two
    steps), and the idle prober probes it and leaves it serving."""
    idle_probes = 0
    probe_health = client.probe_health

    async def counted(limit_s: float) -> None:
        nonlocal idle_probes
        idle_probes += 1
        await probe_health(limit_s)

    client.probe_health = counted  # type: ignore[method-assign]
    start = trio.current_time()
    assert await client.answers_probe(PROBE_S)
    print(f"is_sleeping answered in {1000 * (trio.current_time() - start):.1f} ms (idle)")
    async with client.open_stream(req(400, ignore_eos=True)) as stream:
        await stream.receive()
        assert await client.answers_probe(PROBE_S)
        assert not stream.finished, "the probe came after the stream: nothing proven"
    await trio.sleep(3.5 * HEALTH_INTERVAL_S)
    assert idle_probes >= 2, idle_probes
    assert client.state is EngineState.READY, client.last_error
    assert not client._calls
    ids: list[int] = []
    async with client.open_stream(req(4, temperature=0.0, ignore_eos=True)) as stream:
        async for delta in stream:
            ids.extend(delta.token_ids)
    assert len(ids) == 4


@asynccontextmanager
async def until_engine_dead(client: VllmEngineClient) -> AsyncIterator[None]:
    """Run ``client`` (ready when the body starts); the body kills its engine, and the client's
    run failing with EngineDead is what ends the block."""
    with pytest.RaisesGroup(EngineDead, flatten_subgroups=True):
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            with trio.fail_after(STARTUP_S):
                await client.wait_ready()
            yield
            await trio.sleep_forever()


async def test_real_vllm_engine_client() -> None:
    python, model = os.environ.get("VLLM_PYTHON"), os.environ.get("VLLM_MODEL")
    if not python or not model:
        pytest.fail('VLLM_PYTHON / VLLM_MODEL unset: run `eval "$(.ci/vllm-env.sh)"` first')
    client = make_client(python, model)
    outcome = KillOutcome()
    async with until_engine_dead(client):
        assert client.info is not None
        assert client.info.max_model_len == 512

        ids: list[int] = []
        async with client.open_stream(req(64, temperature=0.0)) as stream:
            async for delta in stream:
                ids.extend(delta.token_ids)
                last = delta
        assert last.finish is not None
        assert last.completion_tokens == len(ids)
        assert last.prompt_tokens == len(PROMPT)
        if last.finish.reason is FinishReason.STOP:
            assert ids[-1] == EOS

        async with client.open_stream(req(400, ignore_eos=True)) as stream:
            await stream.receive()
        assert client.in_flight == 0  # closed locally; vLLM sends nothing for an abort
        ids = []
        async with client.open_stream(req(4, temperature=0.0, ignore_eos=True)) as stream:
            async for delta in stream:
                ids.extend(delta.token_ids)
        assert len(ids) == 4

        await answers_the_probe(client)
        await kill_under_streams(client, outcome)
    for _ in range(2):
        if outcome.errors:
            break
        # Every stream had all its output on the way before the kill landed (a loaded
        # machine): nothing was proven, so again on a fresh engine.
        print("every stream finished before the kill took effect; again on a fresh engine")
        client = make_client(python, model)
        outcome = KillOutcome()
        async with until_engine_dead(client):
            await kill_under_streams(client, outcome)
    assert outcome.killed
    assert outcome.errors, "in three tries no stream was still open when the engine died"
    assert client.state is EngineState.DEAD
    # Output the engine sent just before it died can still finish a stream (at its length);
    # every other stream fails with EngineDead.
    assert len(outcome.errors) + len(outcome.finished) == DOOMED_STREAMS, outcome
    assert set(outcome.finished) <= {"length"}, outcome
    # One error object per stream (a shared one grew its traceback with every re-raise).
    assert len({id(e) for e in outcome.errors}) == len(outcome.errors)
    assert len({str(e) for e in outcome.errors}) == 1
