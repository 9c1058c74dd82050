r"""LoRA adapters on the REAL engines, through the whole daemon, against the engines' own servers.

Needs the engine venvs and tiny models (``.ci/vllm-env.sh``, ``.ci/sglang-env.sh``)::

    set -a; eval "$(bash .ci/vllm-env.sh)"; eval "$(bash .ci/sglang-env.sh)"; set +a
    .venv/bin/python -m pytest -q -m real_engine -s tests/real_engines/test_lora_real.py

Tiny random adapters are written offline by ``make_tiny_lora.py`` (q_proj / v_proj, rank 8,
non-zero B). vLLM: ``smgd serve`` launches the engine core with ``[engines.lora]`` (adapter
``sql`` at start-up, runtime updates allowed) while vLLM's own OpenAI server runs on the same
model with ``--lora-modules sql=...`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``. Greedy
output ids with the adapter differ from the base model's and are identical to vLLM's, by the
adapter's own name and as ``tiny:sql``; an adapter loaded at run time on both
(``/v1/load_lora_adapter``) gives identical output too; unloaded, it is a 404.
SGLang: ``smgd serve`` launches the scheduler with ``[engines.lora]`` (``--lora-paths
sql=...``, ``--lora-backend torch_native``) while SGLang's own offline ``Engine`` (its
TokenizerManager resolves ``lora_path="sql"`` to the adapter's id) runs the same prompts
(``sglang_offline_generate.py``; SGLang's HTTP server needs ``jsonschema``, which the cached
venv lacks): identical greedy ids, different from the base model's. SGLang's LoRA layers ask
for pinned memory, which a CPU-only torch refuses; the launcher's CPU shims drop the request
(``smgd/launchers/cpu_torch/sitecustomize.py``), in both runs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from smgd.launchers import cpu_shims_dir, cpu_torch_dir

from ..engine_harness import short_ipc_dir
from .daemon_real import MODEL, READY_S, serve
from .make_tiny_lora import make
from .oracle_result import oracle_result
from .test_vllm_daemon import ENGINE_ARGS

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]

# Prompts as token ids of the tiny vLLM tokenizer ("def hello(world):", "import os\nimport
# sys\n"); 12 greedy tokens each: enough to see an adapter's effect, cheap on the CPU.
PROMPTS = [[323, 607, 83, 338, 15, 743, 1373, 310], [771, 591, 206, 771, 679, 206]]
MAX_TOKENS = 12
LORA = {"max_loras": 2, "max_lora_rank": 8}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def vllm_server(python: str, model: str, sql: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """vLLM's own OpenAI server on the tiny model with adapter ``sql``: (url, process).
    Started, not waited for (the caller starts smgd meanwhile: :func:`wait_up`)."""
    port = free_port()
    log = (short_ipc_dir() / "vllm-serve.log").open("w+")
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--served-model-name", MODEL, "--host", "127.0.0.1",
        "--port", str(port), *ENGINE_ARGS,
        "--enable-lora", "--max-loras", str(LORA["max_loras"]),
        "--max-lora-rank", str(LORA["max_lora_rank"]), "--lora-modules", f"sql={sql}",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.seek(0)
        tail = log.read()[-3000:]
        log.close()
        print(f"vLLM server log tail:\n{tail}")


def wait_up(url: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vLLM's server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    pytest.fail(f"vLLM's server not up within {READY_S:g} s")


def oracle_ids(url: str, model: str) -> list[tuple[list[int], str]]:
    """Greedy completion token ids (``return_token_ids``) and text from vLLM's server."""
    out = []
    for prompt in PROMPTS:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        out.append((choice["token_ids"], choice["text"]))
    return out


def smgd_ids(url: str, model: str) -> list[tuple[list[int], str]]:
    """Greedy output ids and text from smgd (``/generate``, :func:`oracle_ids`'s sampling).
    The texts too: an output that ends inside a character ends as vLLM ends it."""
    out = []
    for prompt in PROMPTS:
        body = {
            "model": model,
            "input_ids": prompt,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": MAX_TOKENS},
        }
        response = httpx.post(f"{url}/generate", json=body, timeout=120)
        assert response.status_code == 200, response.text
        answer = response.json()
        out.append((answer["output_ids"], answer["text"]))
    return out


def load(url: str, name: str, path: Path) -> httpx.Response:
    body: dict[str, Any] = {"lora_name": name, "lora_path": str(path)}
    return httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=120)


def lora_table(adapters: dict[str, Path], *, runtime: bool) -> str:
    pairs = ", ".join(f'{name} = "{path}"' for name, path in adapters.items())
    return (
        f"[engines.lora]\nadapters = {{{pairs}}}\nmax_loras = {LORA['max_loras']}\n"
        f"max_lora_rank = {LORA['max_lora_rank']}\n"
        f"allow_runtime_updates = {'true' if runtime else 'false'}\n"
    )


def env(*names: str) -> list[str]:
    values = [os.environ.get(n, "") for n in names]
    if not all(values):
        pytest.fail(f"{' / '.join(names)} unset: source .ci/vllm-env.sh and .ci/sglang-env.sh")
    return values


def test_vllm_adapter_output_is_vllms_own_servers(tmp_path: Path) -> None:
    python, model = env("VLLM_PYTHON", "VLLM_MODEL")
    sql = make(Path(model), tmp_path / "sql", seed=0)
    chat = make(Path(model), tmp_path / "chat", seed=1)
    t0 = time.monotonic()
    with (
        vllm_server(python, model, sql) as (oracle, proc),
        serve("vllm", extra=lora_table({"sql": sql}, runtime=True)) as url,
    ):
        wait_up(oracle, proc)
        print(f"TIMING lora_vllm_both_up {time.monotonic() - t0:.1f}")
        base = smgd_ids(url, MODEL)
        assert base == oracle_ids(oracle, MODEL)
        with_sql = smgd_ids(url, "sql")
        assert with_sql == oracle_ids(oracle, "sql")
        assert with_sql != base  # the adapter changes the greedy output
        assert smgd_ids(url, f"{MODEL}:sql") == with_sql

        for where in (url, oracle):
            response = load(where, "chat", chat)
            assert response.status_code == 200, response.text
            assert response.text == "Success: LoRA adapter 'chat' added successfully."
        with_chat = smgd_ids(url, "chat")
        assert with_chat == oracle_ids(oracle, "chat")
        assert with_chat not in (base, with_sql)

        unload = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "chat"})
        assert unload.status_code == 200, unload.text
        gone = httpx.post(
            f"{url}/v1/completions", json={"model": "chat", "prompt": PROMPTS[0], "max_tokens": 2}
        )
        assert gone.status_code == 404
        assert smgd_ids(url, "sql") == with_sql  # the start-up adapter serves on
    print(f"TIMING lora_vllm_total {time.monotonic() - t0:.1f}")


SGLANG_SCRIPT = Path(__file__).with_name("sglang_offline_generate.py")
# The tiny SGLang model's vocabulary is 1024.
SGLANG_PROMPTS = [[1, 385, 600, 436, 943, 14, 10, 385], [1, 771, 591, 206, 100, 200]]
# sglang.Engine keyword arguments equal to the daemon's launch flags (daemon_real.SGLANG_ARGS
# and [engines.lora]); the grammar backend does not touch unconstrained requests.
SGLANG_ENGINE = {
    "device": "cpu",
    "max_total_tokens": 4096,
    "max_running_requests": 8,
    "dtype": "float32",
    "attention_backend": "torch_native",
    "sampling_backend": "pytorch",
    "disable_overlap_schedule": True,
    "grammar_backend": "none",
    "cuda_graph_backend_decode": "disabled",
    "cuda_graph_backend_prefill": "disabled",
    "enable_lora": True,
    "max_loras_per_batch": LORA["max_loras"],
    "max_lora_rank": LORA["max_lora_rank"],
    "lora_backend": "torch_native",
}


def test_sglang_adapter_output_is_sglangs(tmp_path: Path) -> None:
    python, model = env("SGLANG_PYTHON", "SGLANG_MODEL")
    sql = make(Path(model), tmp_path / "sql", seed=0)
    requests = [
        {"input_ids": ids, "max_new_tokens": MAX_TOKENS, "lora_path": lora}
        for lora in (None, "sql")
        for ids in SGLANG_PROMPTS
    ]
    job = {
        "engine": {**SGLANG_ENGINE, "model_path": model, "lora_paths": [f"sql={sql}"]},
        "requests": requests,
    }
    t0 = time.monotonic()
    (tmp_path / "job.json").write_text(json.dumps(job))
    # Files, not pipes: nobody reads the oracle's output until smgd's checks are done.
    with (tmp_path / "job.json").open() as stdin, (tmp_path / "oracle.out").open("w+") as out_f:
        oracle = subprocess.Popen(
            [python, str(SGLANG_SCRIPT)],
            stdin=stdin,
            stdout=out_f,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONPATH": f"{cpu_shims_dir()}:{cpu_torch_dir()}"},
        )
    try:
        lora = lora_table({"sql": sql}, runtime=False)
        with serve("sglang", extra=lora, launch_args=["--lora-backend", "torch_native"]) as url:
            print(f"TIMING lora_sglang_smgd_up {time.monotonic() - t0:.1f}")
            base = sglang_ids(url, MODEL)
            with_sql = sglang_ids(url, "sql")
            assert sglang_ids(url, f"{MODEL}:sql") == with_sql
        oracle.wait(timeout=READY_S)
    finally:
        if oracle.poll() is None:
            oracle.kill()
            oracle.wait()
    out = (tmp_path / "oracle.out").read_text()
    expected = oracle_result(out, ok=oracle.returncode == 0)["outputs"]
    print(f"TIMING lora_sglang_total {time.monotonic() - t0:.1f}")
    n = len(SGLANG_PROMPTS)
    assert base == expected[:n]
    assert with_sql == expected[n:]
    assert with_sql != base  # the adapter changes the greedy output


def sglang_ids(url: str, model: str) -> list[list[int]]:
    out = []
    for prompt in SGLANG_PROMPTS:
        body = {
            "model": model,
            "input_ids": prompt,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": MAX_TOKENS},
        }
        response = httpx.post(f"{url}/generate", json=body, timeout=120)
        assert response.status_code == 200, response.text
        out.append(response.json()["output_ids"])
    return out
