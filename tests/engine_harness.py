"""Shared helpers: an SGLang engine client wired to a mock engine over real ipc sockets."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
import zmq

from smgd.config import EngineConfig, LimitsConfig, TimeoutsConfig, WireFamily
from smgd.engines import validation
from smgd.engines.base import EngineClient
from smgd.engines.sglang import SglangEngineClient
from smgd.launch import mock_argv
from smgd.mock.engine import MockEngine
from smgd.mock.scheduler import MockScheduler
from smgd.mock.sglang import SglangMockWire
from smgd.wire.common import EngineInfo, GenerateRequest, SamplingParams, TokenDelta

VOCAB = 1024


class VocabularyScans:
    """Records every prompt an engine client scans against its vocabulary (the ids, in
    order), by wrapping ``smgd.engines.validation._check_vocabulary`` for the test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.prompts: list[list[int]] = []
        scan = validation._check_vocabulary

        def counted(ids: list[int], vocab: int | None, param: str) -> None:
            self.prompts.append(list(ids))
            scan(ids, vocab, param)

        monkeypatch.setattr(validation, "_check_vocabulary", counted)

    @property
    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.prompts]


@dataclass
class Pair:
    client: SglangEngineClient
    mock: MockEngine | None
    ipc_dir: Path


def short_ipc_dir() -> Path:
    # pytest's tmp_path can exceed the 107-byte unix socket path limit; /tmp is short.
    return Path(tempfile.mkdtemp(prefix="smgd-t-", dir="/tmp"))


def engine_config(*, max_frame_mb: int | None = None, **timeouts: float) -> EngineConfig:
    limits = LimitsConfig() if max_frame_mb is None else LimitsConfig(max_frame_mb=max_frame_mb)
    return EngineConfig(
        name="e0",
        wire=WireFamily.SGLANG,
        models=["m"],
        model_dir=".",
        timeouts=TimeoutsConfig(**timeouts),
        limits=limits,
    )


@asynccontextmanager
async def sglang_pair(
    *,
    step_s: float = 0.002,
    max_batch: int = 256,
    eos_ids: tuple[int, ...] = (),
    launch_mock: bool = False,
    with_mock: bool = True,
    max_frame_mb: int | None = None,
    **timeouts: float,
) -> AsyncIterator[Pair]:
    ipc_dir = short_ipc_dir()
    launch_argv = None
    if launch_mock:
        launch_argv = mock_argv(
            "sglang",
            f"ipc://{ipc_dir}/in.sock",
            f"ipc://{ipc_dir}/out.sock",
            ["--step-ms", str(step_s * 1000), "--max-batch", str(max_batch)],
        )
    client = SglangEngineClient(
        engine_config(max_frame_mb=max_frame_mb, **timeouts),
        fallback_info=EngineInfo(max_model_len=4096, vocab_size=VOCAB),
        input_path=str(ipc_dir / "in.sock"),
        output_path=str(ipc_dir / "out.sock"),
        launch_argv=launch_argv,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        mock = None
        if with_mock and launch_argv is None:
            wire = SglangMockWire(f"ipc://{ipc_dir}/in.sock", f"ipc://{ipc_dir}/out.sock")
            mock = MockEngine(
                wire, MockScheduler(max_batch=max_batch, eos_ids=eos_ids), step_s=step_s
            )
            await nursery.start(mock.run)
        if with_mock:
            with trio.fail_after(30):
                await client.wait_ready()
        yield Pair(client, mock, ipc_dir)
        nursery.cancel_scope.cancel()


def request(
    rid: str, prompt: list[int], max_tokens: int = 8, **sampling: object
) -> GenerateRequest:
    return GenerateRequest(
        rid=rid,
        prompt_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
    )


async def collect(client: EngineClient, req: GenerateRequest) -> tuple[list[int], TokenDelta]:
    """Run one request to its end: (all output ids in order, the last delta)."""
    ids: list[int] = []
    last = None
    async with client.open_stream(req) as stream:
        async for delta in stream:
            ids.extend(delta.token_ids)
            last = delta
    assert last is not None
    return ids, last


def expected_echo(prompt: list[int], n: int) -> list[int]:
    return [prompt[i % len(prompt)] for i in range(n)]


def send_oversized(endpoint: str, size: int) -> None:
    """Connect a PUSH socket to an engine client's output socket and send it one frame of
    ``size`` bytes (not msgpack: an engine client that took it would report it undecodable);
    the socket is closed once the frame is out (linger), or after 5 s."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 5000)
    push.connect(endpoint)
    push.send(b"\xc1" * size)
    push.close()
    ctx.term()
