"""smgd's SGLang engine client against a REAL SGLang 0.5.23 scheduler, launched by smgd.

Needs the venv and model from ``.ci/sglang-env.sh``::

    eval "$(bash .ci/sglang-env.sh)"
    .venv/bin/python -m pytest -m real_engine tests/real_engines/test_sglang_engine.py

One scheduler start (~15-40 s on this CPU) serves the whole scenario, in order: greedy output
is deterministic across two runs, an abort mid-stream leaves the scheduler healthy, stop token
ids are honoured, a request after all that still works, and a scheduler that exits (even with
code 0) fails the in-flight stream with one clear error.
"""

from __future__ import annotations

import os
import uuid

import pytest
import trio

from smgd.config import EngineConfig, TimeoutsConfig, WireFamily
from smgd.engines.sglang import SglangEngineClient
from smgd.engines.state import EngineState
from smgd.errors import EngineDead
from smgd.launchers import sglang_scheduler_script
from smgd.wire.common import (
    EngineInfo,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    Structured,
    StructuredKind,
)
from smgd.wire.sglang.encode import encode_shutdown

from ..engine_harness import short_ipc_dir
from .test_sglang_raw import SCHEDULER_ARGS as RAW_SCHEDULER_ARGS

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]

# Importing sglang (~15 s) plus loading the model; generous for a loaded 2-core CI machine.
READY_TIMEOUT_S = 300.0
PROMPT = [1, 385, 600, 436, 943, 14, 10, 385]
# The same scheduler flags as the raw test: CPU device, capped KV cache, torch-native paths.
SCHEDULER_ARGS = [a for a in RAW_SCHEDULER_ARGS if a != "--skip-tokenizer-init"]


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(f'{name} is not set: run `eval "$(bash .ci/sglang-env.sh)"` first')
    return value


def greedy(max_tokens: int, **extra: object) -> GenerateRequest:
    return GenerateRequest(
        rid=uuid.uuid4().hex,
        prompt_ids=PROMPT,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra),  # type: ignore[arg-type]
    )


async def run(client: SglangEngineClient, req: GenerateRequest) -> tuple[list[int], FinishReason]:
    ids: list[int] = []
    reason = None
    async with client.open_stream(req) as stream:
        async for delta in stream:
            ids.extend(delta.token_ids)
            if delta.finish is not None:
                reason = delta.finish.reason
    assert reason is not None
    return ids, reason


async def test_real_scheduler_through_the_engine_client() -> None:
    python, model = _env("SGLANG_PYTHON"), _env("SGLANG_MODEL")
    ipc = short_ipc_dir()
    argv = [
        python, str(sglang_scheduler_script()),
        "--smgd-input", f"ipc://{ipc}/in.sock", "--smgd-output", f"ipc://{ipc}/out.sock",
        "--cpu-shims", "--model-path", model, *SCHEDULER_ARGS,
    ]  # fmt: skip
    config = EngineConfig(
        name="sglang-real",
        wire=WireFamily.SGLANG,
        models=["tiny"],
        model_dir=model,
        timeouts=TimeoutsConfig(ready_s=READY_TIMEOUT_S, silence_s=60.0),
    )
    client = SglangEngineClient(
        config,
        fallback_info=EngineInfo(max_model_len=512, vocab_size=1024),
        input_path=str(ipc / "in.sock"),
        output_path=str(ipc / "out.sock"),
        launch_argv=argv,
    )
    with pytest.RaisesGroup(EngineDead, flatten_subgroups=True):
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            with trio.fail_after(READY_TIMEOUT_S + 30):
                await client.wait_ready()
            assert client.info is not None
            # The launcher reports the scheduler's own context length (the model's 512).
            assert client.info.max_model_len == 512

            with trio.fail_after(120):
                first, reason1 = await run(client, greedy(8))
                second, reason2 = await run(client, greedy(8))
            assert len(first) == 8
            assert first == second, "greedy output must be deterministic"
            assert reason1 is reason2 is FinishReason.LENGTH

            # Abort mid-stream: leave the stream after the first delta. Meanwhile the load
            # smgd estimates for SGLang (its output socket carries none): one request running,
            # holding its prompt and output tokens of the KV capacity the scheduler reported.
            kv_tokens = client.info.kv_cache_tokens
            assert kv_tokens is not None and kv_tokens > 0
            request = greedy(400)
            with trio.fail_after(60):
                async with client.open_stream(request) as stream:
                    got = len((await stream.receive()).token_ids)
                    busy = client.occupancy()
            assert (busy.running, busy.waiting, busy.estimated) == (1, 0, True)
            assert busy.kv_usage == (len(request.prompt_ids) + got) / kv_tokens
            assert client.in_flight == 0
            assert (client.occupancy().running, client.occupancy().kv_usage) == (0, 0.0)
            with trio.fail_after(60):
                await client.health_check(30.0)
            assert client.state is EngineState.READY

            # This scheduler has no grammar backend (--grammar-backend none, so it runs without
            # a tokenizer): a constrained request is refused for that request alone, as a 400
            # naming its parameter; the scheduler serves on.
            schema = Structured(kind=StructuredKind.JSON, param="response_format", spec={})
            with trio.fail_after(60):
                async with client.open_stream(greedy(8, structured=schema)) as stream:
                    finish = (await stream.receive()).finish
            assert finish is not None
            assert (finish.status_code, finish.param) == (400, "response_format")
            assert "--grammar-backend none" in (finish.message or "")

            stop_id = first[3]
            with trio.fail_after(60):
                ids, reason = await run(client, greedy(50, stop_token_ids=(stop_id,)))
            assert ids[-1] == stop_id and stop_id not in ids[:-1]
            assert reason is FinishReason.STOP

            with trio.fail_after(60):
                again, _ = await run(client, greedy(8))
            assert again == first

            # The scheduler exiting (ShutdownReq → exit code 0) is still an engine death.
            with trio.fail_after(60):
                async with client.open_stream(greedy(400)) as stream:
                    await stream.receive()
                    client._outbox_send.send_nowait([encode_shutdown()])
                    # Whichever signal lands first: the socket peer leaving or the exit code.
                    with pytest.raises(EngineDead, match=r"exited with code 0|disconnected"):
                        while True:
                            await stream.receive()
            assert client.statistics().state == "dead"
            await trio.sleep_forever()
