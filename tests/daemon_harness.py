"""Run the whole daemon (HTTP + engines launched as mock processes) inside a test."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import trio

from smgd.assets import TINY_MODEL_DIR
from smgd.config import load_config
from smgd.daemon import Running, run_daemon

from .engine_harness import short_ipc_dir


def engine_toml(name: str, model: str, *, step_ms: float = 5.0, extra: str = "") -> str:
    return (
        f'[[engines]]\nname = "{name}"\nwire = "mock"\nmodels = ["{model}"]\n'
        f'model_dir = "{TINY_MODEL_DIR}"\n{extra}'
        f"[engines.mock]\nstep_ms = {step_ms}\n"
    )


def config_text(*engines: str, drain_s: float = 10.0) -> str:
    run = short_ipc_dir()
    return (
        f'run_dir = "{run}"\n[server]\nport = 0\ndrain_timeout_s = {drain_s}\n'
        '[logging]\nlevel = "warning"\n' + "".join(engines)
    )


def rewrite_config(path: Path, *engines: str, drain_s: float = 10.0) -> None:
    """Write a new config for a running daemon: the same run_dir, these engines."""
    run_line = path.read_text().split("\n", 1)[0]
    path.write_text(run_line + "\n" + config_text(*engines, drain_s=drain_s).split("\n", 1)[1])


@asynccontextmanager
async def running_daemon(
    path: Path, *, install_signals: bool = False, wait_ready: bool = True
) -> AsyncIterator[tuple[Running, httpx.AsyncClient]]:
    """The daemon on ``path`` (its state, addresses, reload and drain) and a client of it."""
    config = load_config(path, environ={})
    async with trio.open_nursery() as nursery:
        daemon: Running = await nursery.start(
            lambda task_status: run_daemon(
                config,
                config_path=str(path),
                install_signals=install_signals,
                task_status=task_status,
            )
        )
        if wait_ready:
            with trio.fail_after(30):
                for engine in daemon.gateway.router.engines():
                    await engine.wait_ready()
        async with httpx.AsyncClient(base_url=daemon.binds[0], timeout=60) as client:
            yield daemon, client
        nursery.cancel_scope.cancel()


async def stream_completion(
    client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int
) -> tuple[str, dict[str, object] | None, str | None]:
    """(text, usage, finish_reason) of one streamed completion; an error event fails."""
    text, usage, finish, error = await stream_result(client, model, prompt, max_tokens)
    if error is not None:
        raise AssertionError(f"stream error: {error}")
    return text, usage, finish


async def stream_result(
    client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int
) -> tuple[str, dict[str, object] | None, str | None, dict[str, object] | None]:
    """(text, usage, finish_reason, error event) of one streamed completion."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, usage, finish, error = "", None, None, None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]
                continue  # read to the end ([DONE]) so the response closes cleanly
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                text += choice.get("text", "")
                finish = choice.get("finish_reason") or finish
    return text, usage, finish, error


def serve_process(path: Path) -> subprocess.Popen[str]:
    """`smgd serve --config path` as a child process (stderr piped for the banner)."""
    return subprocess.Popen(
        [sys.executable, "-m", "smgd", "serve", "--config", str(path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


async def wait_url(proc: subprocess.Popen[str]) -> str:
    """The URL from the banner line `smgd listening on ...`."""
    assert proc.stderr is not None
    with trio.fail_after(30):
        while True:
            line = await trio.to_thread.run_sync(proc.stderr.readline)
            if not line:
                raise AssertionError("smgd exited before listening")
            if line.startswith("smgd listening on "):
                return line.split()[-1]
