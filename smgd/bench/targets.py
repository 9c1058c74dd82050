"""The benchmark's targets, each run against the same mock engine and the same load.

- ``smgd``: ``smgd serve`` with its built-in mock (SGLang wire), driven over HTTP by the loadgen.
- ``smgd-wN``: the same with ``server.workers = N``, one full-batch mock engine per worker.
- ``smgd-tools``: the same with the tools workload: the mock scripted to reply with a reasoning
  block and a hermes tool call, the engine with ``reasoning_parser = "qwen3"`` and
  ``tool_parser = "hermes"``, and streaming chat requests with ``tools``.
- ``smgd-tools-noparse``: the control: the same requests and reply on an engine without
  parsers, so the reply comes back as ``content`` (the chat path without the parsing).
- ``floor``: the bare pyzmq decode loop of :mod:`smgd.bench.floor` on the same mock.
- ``floor-sse``: the same loop writing each delivery to a loopback TCP client as an SSE chunk.
- ``vllm``: vLLM's own OpenAI server with a headless mock engine (:mod:`smgd.bench.vllm_frontend`).

Each target function yields one result dict per concurrency (see :mod:`smgd.bench.report`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from smgd import launch
from smgd.assets import TINY_MODEL_DIR
from smgd.bench import procstat
from smgd.bench.floor import FloorSpec
from smgd.bench.runner import (
    Measured,
    Proc,
    cmdline,
    free_port,
    loadgen_spec,
    measure_http_point,
    start,
    wait_ready,
)
from smgd.bench.workload import (
    REASONING_PARSER,
    TOOL_PARSER,
    Prompt,
    ToolPrompt,
    Workload,
    build_prompt,
    build_tool_prompt,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

log = logging.getLogger("smgd.bench")

SMGD_MODEL = "tiny-mock"
# smgd + mock start in ~2 s here; 60 s only matters on a badly overloaded machine.
SMGD_READY_TIMEOUT_S = 60.0
# A few requests before the first point so lazy imports and first-use caches are not measured.
WARMUP_CONCURRENCY = 4
WARMUP_S = 1.0
MOCK_MARK = "mock-engine"


def _split(pids: list[int]) -> tuple[list[int], list[int]]:
    """(server pids, mock pids) of a process tree: the mock is recognized by its command line."""
    mock = [p for p in pids if MOCK_MARK in cmdline(p)]
    mock_tree: set[int] = set()
    for p in mock:
        mock_tree.update(procstat.descendants(p))
    return [p for p in pids if p not in mock_tree], sorted(mock_tree)


async def _points(
    port: int,
    model: str,
    prompt: Prompt | ToolPrompt,
    workload: Workload,
    concurrencies: Sequence[int],
    measured: Measured,
    extra: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    warm = loadgen_spec(
        port=port,
        model=model,
        prompt=prompt,
        workload=workload,
        concurrency=WARMUP_CONCURRENCY,
        duration_s=WARMUP_S,
        extra=extra,
    )
    await measure_http_point(warm, measured)
    idle_rss = procstat.rss_kib(measured.server())
    results = []
    for c in concurrencies:
        spec = loadgen_spec(
            port=port, model=model, prompt=prompt, workload=workload, concurrency=c, extra=extra
        )
        log.info("point C=%d", c)
        result = await measure_http_point(spec, measured)
        result["idle_rss_kib"] = idle_rss
        results.append(result)
    return results


def smgd_config(
    workload: Workload,
    *,
    port: int,
    run_dir: str,
    workers: int = 1,
    coalesce: bool = True,
    script: str | None = None,
    parsers: bool = True,
) -> str:
    """smgd.toml for a bench run: ``workers`` worker processes, one mock engine each.

    ``coalesce=False`` turns adaptive coalescing off (``server.coalesce_max_ms = 0``).
    ``script`` (the tools workload): the mock's reply script, and (with ``parsers``) the
    engine parses its reasoning and tool calls.

    Each engine has the full ``max_batch``: the kernel spreads connections over the workers by
    hash, not evenly, so engines sized to an exact share would queue the surplus of the busier
    worker and measure that instead of the front end. Up to C = max_batch the offered load is
    the same as with one engine; above it, N engines offer N times as much (the report's
    ``offered`` column says so).
    """
    batch = workload.max_batch
    model_dir = workload.model_dir() or TINY_MODEL_DIR
    lines = [
        f'run_dir = "{run_dir}"',
        "[server]",
        f"port = {port}",
        f"workers = {workers}",
        *([] if coalesce else ["coalesce_max_ms = 0"]),
        "[logging]",
        'level = "warning"',
    ]
    for index in range(workers):
        lines += [
            "[[engines]]",
            f'name = "mock{index}"',
            'wire = "mock"',
            f'models = ["{SMGD_MODEL}"]',
            f'model_dir = "{model_dir}"',
            *(
                []
                if script is None or not parsers
                else [f'tool_parser = "{TOOL_PARSER}"', f'reasoning_parser = "{REASONING_PARSER}"']
            ),
            "[engines.mock]",
            f"step_ms = {workload.step_ms}",
            f"max_batch = {batch}",
            *([] if script is None else [f'script = "{script}"']),
        ]
    return "\n".join(lines) + "\n"


async def run_smgd(
    workload: Workload,
    concurrencies: Sequence[int],
    log_dir: Path,
    *,
    workers: int = 1,
    coalesce: bool = True,
    tools: bool = False,
    parsers: bool = True,
) -> list[dict[str, Any]]:
    port = free_port()
    prompt: Prompt | ToolPrompt
    script = None
    model_dir = workload.model_dir() or TINY_MODEL_DIR
    if tools:
        prompt = build_tool_prompt(model_dir, workload.max_tokens, parsers=parsers)
        # The loadgen's request bounds follow the reply's length, not M.
        workload = dataclasses.replace(workload, max_tokens=prompt.reply_tokens)
        script = "replies.toml"
    else:
        prompt = build_prompt(
            model_dir, workload.prompt_tokens, workload.max_tokens, workload.prompt_text()
        )
    # A private run dir: other smgd instances on this machine use the default one.
    with tempfile.TemporaryDirectory(prefix="smgdb-", dir="/tmp") as run_dir:
        config = Path(run_dir) / "smgd.toml"
        if isinstance(prompt, ToolPrompt):
            (Path(run_dir) / "replies.toml").write_text(prompt.script())
        config.write_text(
            smgd_config(
                workload,
                port=port,
                run_dir=run_dir,
                workers=workers,
                coalesce=coalesce,
                script=script,
                parsers=parsers,
            )
        )
        argv = [sys.executable, "-m", "smgd", "serve", "--config", str(config)]
        name = "smgd" if workers == 1 else f"smgd-w{workers}"
        name += "" if coalesce else "-flat"
        name += "-tools" if tools else ""
        name += "" if parsers else "-noparse"
        proc = await start(name, argv, log_dir)
        try:
            await wait_ready(proc, port, "/readiness", SMGD_READY_TIMEOUT_S)
            if workers > 1:
                await _wait_all_workers_ready(port, workers)

            def server() -> list[int]:
                return _split(proc.tree())[0]

            def mock() -> list[int]:
                return _split(proc.tree())[1]

            points = await _points(
                port, SMGD_MODEL, prompt, workload, concurrencies, Measured(server, mock)
            )
            for point in points:
                point["engines"] = workers
                if isinstance(prompt, ToolPrompt):
                    point["reply_tokens"] = prompt.reply_tokens
            return points
        finally:
            await proc.stop()


async def _wait_all_workers_ready(port: int, workers: int) -> None:
    """/readiness answers from one worker per connection: ask on fresh ones until each said so."""
    import httpx

    ready: set[str] = set()
    with trio.fail_after(SMGD_READY_TIMEOUT_S):
        while len(ready) < workers:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as c:
                response = await c.get("/readiness")
            if response.status_code == 200:
                ready |= set(response.json()["engines"])
            else:
                await trio.sleep(0.05)


async def _floor_point(
    workload: Workload, prompt: Prompt, concurrency: int, skip_ids: str, log_dir: Path, sse: bool
) -> dict[str, Any]:
    name = f"floor{'-sse' if sse else ''}-c{concurrency}"
    with tempfile.TemporaryDirectory(prefix="smgdf-", dir="/tmp") as tmp:
        spec = FloorSpec(
            input_addr=f"ipc://{tmp}/in.sock",
            output_addr=f"ipc://{tmp}/out.sock",
            prompt_ids=prompt.ids,
            expected_ids=prompt.expected_ids,
            max_tokens=workload.max_tokens,
            concurrency=concurrency,
            duration_s=workload.duration_s,
            max_requests=workload.max_requests(concurrency),
            time_limit_s=workload.time_limit_s(concurrency),
            sse=sse,
        )
        floor = await start(
            name,
            [sys.executable, "-m", "smgd.bench.floor"],
            log_dir,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        mock: Proc | None = None
        try:
            assert floor.process.stdin is not None
            assert floor.process.stdout is not None
            await floor.process.stdin.send_all(msgspec.json.encode(spec) + b"\n")
            lines = _LineReader(floor.process.stdout)
            if await lines.next() != "BOUND":
                raise RuntimeError(f"floor did not bind:\n{floor.tail()}")
            mock = await start(
                f"{name}-mock",
                launch.mock_argv(
                    "sglang",
                    spec.input_addr,
                    spec.output_addr,
                    workload.mock_args(skip_ids),
                ),
                log_dir,
                stdout=subprocess.PIPE,
            )
            assert mock.process.stdout is not None
            ready = await _LineReader(mock.process.stdout).next()
            if not ready.startswith("SMGD_READY"):
                raise RuntimeError(f"floor mock did not start:\n{mock.tail()}")
            mock_pids = mock.tree()
            cpu0 = procstat.cpu_sample(mock_pids)
            await floor.process.stdin.send_all(b"GO\n")
            with trio.fail_after(spec.time_limit_s + 30.0):
                line = await lines.next()
            result: dict[str, Any] = msgspec.json.decode(line)
            mock_cpu = procstat.cpu_between(cpu0, procstat.cpu_sample(mock_pids))
            result["mock_cpu_s"] = round(mock_cpu.seconds, 6)
            result["elapsed_s"] = result["wall_s"]
            result["loadavg_1m"] = round(os.getloadavg()[0], 2)
            return result
        finally:
            if mock is not None:
                await mock.stop()
            await floor.stop()


class _LineReader:
    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buf = b""

    async def next(self) -> str:
        while b"\n" not in self.buf:
            data = await self.stream.receive_some(65536)
            if not data:
                break
            self.buf += data
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode().strip()


async def run_floor(
    workload: Workload, concurrencies: Sequence[int], log_dir: Path, *, sse: bool = False
) -> list[dict[str, Any]]:
    from smgd.text.tokenizer import load_tokenizer

    model_dir = workload.model_dir() or TINY_MODEL_DIR
    prompt = build_prompt(
        model_dir, workload.prompt_tokens, workload.max_tokens, workload.prompt_text()
    )
    skip = ",".join(map(str, sorted(load_tokenizer(model_dir).special_ids)))
    results = []
    for c in concurrencies:
        log.info("floor point C=%d%s", c, " (SSE writes)" if sse else "")
        results.append(await _floor_point(workload, prompt, c, skip, log_dir, sse))
    return results
