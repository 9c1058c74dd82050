"""``/v1/embeddings`` through smgd on a real engine, against the engine's OWN front end.

For each engine, a tiny random embedding model (make_tiny_embedder.py: the tiny Llama declared
Matryoshka) is served twice, side by side: by the engine's own front end and by ``smgd serve``
launching the engine with ``task = "embed"``. vLLM's is its OpenAI server (``vllm serve
--runner pooling``). SGLang's OpenAI server does not start from the shared CPU venv (it
imports ``jsonschema``), so SGLang's is its own ``Engine`` (TokenizerManager and scheduler,
``is_embedding``) with its OpenAI embedding class building the answer
(sglang_offline_embed.py). The same requests (a string, a list of strings, token ids, vLLM's
lists of token ids, float and base64, ``dimensions``) must come back the same: the same
shape, the same usage, the same vectors to a few float32 ulps (:data:`FLOAT_TOLERANCE`; an
engine's own output varies in the last bits from run to run); a ``dimensions`` the engine
refuses is a 400 naming it.
Needs ``.ci/sglang-env.sh`` and ``.ci/vllm-env.sh`` sourced.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from smgd.bench.vllm_frontend import _SHIM as VLLM_CLI
from smgd.launchers import cpu_shims

from ..engine_harness import short_ipc_dir
from . import daemon_real
from .make_tiny_embedder import build
from .oracle_result import oracle_result
from .test_vllm_daemon import ENGINE_ARGS as VLLM_ARGS

pytestmark = [pytest.mark.real_engine]

READY_S = daemon_real.READY_S
MODEL = daemon_real.MODEL
TEXTS = ["def hello(world):", "import os, sys", "  return 1 + 2"]
# Requests both servers answer; each is sent with encoding_format float and base64.
REQUESTS: list[dict[str, Any]] = [
    {"input": TEXTS[0]},
    {"input": TEXTS},
    {"input": [323, 607, 83, 338, 15]},
    {"input": TEXTS[1], "dimensions": 16},
]
# SGLang's own server takes no list of token-id lists; vLLM's does.
VLLM_ONLY: list[dict[str, Any]] = [{"input": [[323, 607, 83], [15, 743, 310, 5]]}]
# An engine on CPU is not bit-reproducible from one run to the next. On SGLang a vector depends
# on which requests share its forward pass (the matmul shapes change with the batch; SGLang's
# own front end sends a list's inputs one by one), and even a single input alone in its batch
# came back 1 float32 ulp off in most components when the suite ran beside others on a busy
# 2-core machine (CI, 2026-12-06: 6e-8; the CPU's math library splits its sums by the threads
# it gets, and vLLM runs the same library). So vectors are compared to this bound: float32
# ulps of unit-vector components are ~1e-8, and any real fault (a wrong truncation, no
# normalization) is off by far more; float against base64 and the width are checked apart.
FLOAT_TOLERANCE = 1e-6
# Not one of the model's Matryoshka dimensions: both engines' front ends refuse it.
REFUSED: dict[str, Any] = {"input": "x", "dimensions": 20}
# SGLang's Engine arguments: the flags daemon_real launches SGLang's scheduler with.
SGLANG_ENGINE = {
    "device": "cpu",
    "max_total_tokens": 4096,
    "max_running_requests": 8,
    "dtype": "float32",
    "attention_backend": "torch_native",
    "sampling_backend": "pytorch",
    "disable_overlap_schedule": True,
    "cuda_graph_backend_decode": "disabled",
    "cuda_graph_backend_prefill": "disabled",
    "log_level": "error",
}
SGLANG_ORACLE = Path(__file__).with_name("sglang_offline_embed.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model(engine: str) -> Path:
    """The tiny embedding model, made from the engine's tiny Llama."""
    variable = "SGLANG_MODEL" if engine == "sglang" else "VLLM_MODEL"
    source = os.environ.get(variable)
    if not source:
        pytest.fail(f'{variable} unset: eval "$(bash .ci/{engine}-env.sh)" first')
    model = short_ipc_dir() / "embedder"
    build(Path(source), model)
    return model


@contextmanager
def _smgd(engine: str, model: Path) -> Iterator[str]:
    """``smgd serve`` launching the engine with ``task = "embed"`` on ``model``."""
    variable = "SGLANG_MODEL" if engine == "sglang" else "VLLM_MODEL"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(variable, str(model))
        with daemon_real.serve(engine, extra='task = "embed"\n') as url:
            yield url


def _requests_with_formats(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**body, "encoding_format": fmt} for body in requests for fmt in ("float", "base64")]


@contextmanager
def _sglang_oracle(model: Path, requests: list[dict[str, Any]]) -> Iterator[Path]:
    """SGLang's own front end answering ``requests``, running meanwhile; its result file."""
    work = model.parent
    job = work / "oracle-job.json"
    job.write_text(json.dumps({"model": str(model), "engine": SGLANG_ENGINE, "requests": requests}))
    result = work / "oracle-result.txt"
    env = {**os.environ, "PYTHONPATH": str(Path(cpu_shims.__file__).parent)}
    with job.open() as stdin, result.open("w") as stdout:
        proc = subprocess.Popen(
            [os.environ["SGLANG_PYTHON"], str(SGLANG_ORACLE)],
            stdin=stdin,
            stdout=stdout,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        try:
            yield result
            proc.wait(timeout=READY_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _oracle_result(result: Path) -> list[dict[str, Any]]:
    responses: list[dict[str, Any]] = oracle_result(result.read_text())["responses"]
    return responses


@contextmanager
def _vllm_server(model: Path, log_path: Path) -> Iterator[str]:
    """``vllm serve --runner pooling``: vLLM's own OpenAI server; its URL (not yet ready)."""
    port = _free_port()
    argv = [os.environ["VLLM_PYTHON"], "-c", VLLM_CLI, "serve", str(model), "--runner", "pooling",
            *VLLM_ARGS, "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", MODEL]  # fmt: skip
    log = log_path.open("w+")
    # Its own session: stopping it reaches the engine core it spawned.
    proc = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, cwd=log_path.parent, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _wait_healthy(base: str) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    pytest.fail(f"{base} not healthy within {READY_S:g} s")


def _embed(base: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{base}/v1/embeddings", json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, (base, body, r.text)
    return r.json()  # type: ignore[no-any-return]


def _post(base: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base}/v1/embeddings", json={"model": MODEL, **body}, timeout=120)


def _gaps(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> list[float | str]:
    """Per item: the largest difference between float vectors (for the failure message)."""
    out: list[float | str] = []
    for g, w in zip(got, want, strict=False):
        a, b = g["embedding"], w["embedding"]
        if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            out.append(max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0))
        else:
            out.append("differs" if a != b else "same")
    return out


def _floats(item: dict[str, Any]) -> list[float]:
    vector = item["embedding"]
    if isinstance(vector, str):
        raw = base64.b64decode(vector)
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    return list(vector)


def _same(got: dict[str, Any], want: dict[str, Any], body: dict[str, Any]) -> None:
    """The same shape of answer (index, object, float list or base64 string of the same
    length), each value within :data:`FLOAT_TOLERANCE` of the engine's, the same usage."""
    shape = [
        (d["index"], d["object"], type(d["embedding"]), len(d["embedding"])) for d in got["data"]
    ]
    assert shape == [
        (d["index"], d["object"], type(d["embedding"]), len(d["embedding"])) for d in want["data"]
    ], (body, _gaps(got["data"], want["data"]))
    for g, w in zip(got["data"], want["data"], strict=True):
        a, b = _floats(g), _floats(w)
        gap = max(abs(x - y) for x, y in zip(a, b, strict=True))
        assert gap <= FLOAT_TOLERANCE, (body, gap)
    usage = want["usage"]
    expected = {"prompt_tokens": usage["prompt_tokens"], "total_tokens": usage["total_tokens"]}
    assert got["usage"] == expected, body


def _generation_refused(smgd: str) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    r = httpx.post(f"{smgd}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "model"


def test_sglang_embeddings_equal_sglangs_own_front_end() -> None:
    model = _model("sglang")
    requests = [*_requests_with_formats(REQUESTS), REFUSED]
    # The oracle runs while smgd starts; it is waited for when both blocks end.
    with _sglang_oracle(model, requests) as result, _smgd("sglang", model) as smgd:
        answers = [_post(smgd, body) for body in requests]
        _generation_refused(smgd)
    wants = _oracle_result(result)
    for body, got, want in zip(requests, answers, wants, strict=True):
        if "error" in want:  # SGLang refuses it: smgd too, naming the parameter
            assert got.status_code == 400, (body, got.text)
            assert got.json()["error"]["param"] == "dimensions"
            continue
        assert got.status_code == 200, (body, got.text)
        _same(got.json(), want, body)


def test_vllm_embeddings_equal_vllms_own_server() -> None:
    model = _model("vllm")
    requests = [*_requests_with_formats(REQUESTS + VLLM_ONLY), REFUSED]
    with _vllm_server(model, model.parent / "vllm-server.log") as own, _smgd("vllm", model) as smgd:
        _wait_healthy(own)
        for body in requests:
            want, got = _post(own, body), _post(smgd, body)
            if want.status_code != 200:
                assert got.status_code == 400, (body, got.text)
                assert got.json()["error"]["param"] == "dimensions"
                continue
            assert got.status_code == 200, (body, got.text)
            _same(got.json(), want.json(), body)
        _generation_refused(smgd)
