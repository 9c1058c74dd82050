"""smgd's vLLM engine client against a real headless vLLM engine core (CPU, tiny model).

    eval "$(.ci/vllm-env.sh)"   # sets VLLM_PYTHON and VLLM_MODEL
    .venv/bin/python -m pytest -m real_engine -s tests/real_engines/test_vllm_engine.py

The client launches the engine through smgd's launcher, runs the handshake, streams a greedy
request that must stop on EOS only because smgd sent it, aborts one mid-stream (no reply
comes; the client closes it locally and the engine keeps serving), then SIGKILLs the engine
core: every in-flight stream must fail with one EngineDead.
"""

from __future__ import annotations

import os
import signal
import uuid

import pytest
import trio

from smgd.config import EngineConfig, TimeoutsConfig, WireFamily
from smgd.engines.base import EngineState
from smgd.engines.vllm import VllmEngineClient, vllm_argv
from smgd.errors import EngineDead
from smgd.launch import launcher_script
from smgd.wire.common import EngineInfo, FinishReason, GenerateRequest, SamplingParams

from ..engine_harness import short_ipc_dir

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]

STARTUP_S = 300.0  # import ~15 s + worker spawn/load ~20 s on an idle box; generous for CI
EOS = 2
# Streams in flight at the SIGKILL, each long enough (prompt + tokens < max-model-len 512) that
# none can finish between its first token and the kill.
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


def req(max_tokens: int, **sampling: object) -> GenerateRequest:
    return GenerateRequest(
        rid=uuid.uuid4().hex,
        prompt_ids=PROMPT,
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
    )


async def test_real_vllm_engine_client() -> None:
    python, model = os.environ.get("VLLM_PYTHON"), os.environ.get("VLLM_MODEL")
    if not python or not model:
        pytest.fail('VLLM_PYTHON / VLLM_MODEL unset: run `eval "$(.ci/vllm-env.sh)"` first')
    ipc_dir = short_ipc_dir()
    config = EngineConfig(
        name="vllm0", wire=WireFamily.VLLM, models=["tiny"], model_dir=model,
        timeouts=TimeoutsConfig(ready_s=STARTUP_S),
    )  # fmt: skip
    argv = vllm_argv(
        python=python, launcher=launcher_script("vllm_engine.py"), model=model, args=ENGINE_ARGS
    )
    client = VllmEngineClient(
        config,
        fallback_info=EngineInfo(max_model_len=512, vocab_size=2048),
        input_path=str(ipc_dir / "in.sock"),
        output_path=str(ipc_dir / "out.sock"),
        handshake=f"ipc://{ipc_dir}/hs.sock",
        launch_argv=argv,
        eos_token_ids=(EOS,),
    )
    errors: list[EngineDead] = []
    with pytest.RaisesGroup(EngineDead, flatten_subgroups=True):
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            with trio.fail_after(STARTUP_S):
                await client.wait_ready()
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

            # Kill once every doomed stream has its first token, not after a fixed sleep: on a
            # fast machine 400 tokens of the tiny model finish inside any sleep short enough
            # to keep the test quick, and a stream that finished cannot fail.
            started = trio.Semaphore(0)
            finished_normally: list[str] = []

            async def doomed() -> None:
                try:
                    async with client.open_stream(req(DOOMED_TOKENS, ignore_eos=True)) as s:
                        first = True
                        async for delta in s:
                            if first:
                                first = False
                                started.release()
                            if delta.finish is not None:
                                finished_normally.append(delta.finish.reason.value)
                except EngineDead as exc:
                    errors.append(exc)

            async with trio.open_nursery() as inner:
                for _ in range(DOOMED_STREAMS):
                    inner.start_soon(doomed)
                for _ in range(DOOMED_STREAMS):
                    await started.acquire()
                assert client.child is not None
                os.kill(client.child.pid, signal.SIGKILL)
            assert not finished_normally, f"streams ended before the kill: {finished_normally}"
            assert client.state is EngineState.DEAD
            await trio.sleep_forever()
    assert len(errors) == DOOMED_STREAMS
    # One error object per stream (a shared one grew its traceback with every re-raise).
    assert len({id(e) for e in errors}) == DOOMED_STREAMS
    assert len({str(e) for e in errors}) == 1
