"""Launch ``smgd serve`` with one real engine (SGLang 0.5.23's scheduler or vLLM 0.32's engine
core) and the tiny random model, for the real-engine HTTP tests.

Shared by test_structured_real.py and test_tools_real.py: the engine runs with its xgrammar
backend and ``[engines.structured_output] disable_any_whitespace = true`` (a random model given
free whitespace writes whitespace until ``max_tokens``). Needs ``.ci/sglang-env.sh`` and
``.ci/vllm-env.sh`` sourced.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from ..engine_harness import short_ipc_dir
from .test_sglang_raw import SCHEDULER_ARGS as SGLANG_RAW_ARGS
from .test_vllm_daemon import ENGINE_ARGS as VLLM_ARGS

READY_S = 300.0  # an engine start is 40-60 s here; a loaded CI box takes several times that
MODEL = "tiny"
# The SGLang tiny model has no chat template; this one renders a chat the way the vLLM tiny
# model's does.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' }}\n{{ m['content'] }}"
    "{{ '<|end|>' }}\n{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}\n{% endif %}"
)
# Runs with a grammar backend and the tokenizer it compiles against (not --grammar-backend none,
# not --skip-tokenizer-init): what the launcher does by default.
SGLANG_ARGS = [
    "--cpu-shims",
    *(
        a
        for a in SGLANG_RAW_ARGS
        if a not in ("--skip-tokenizer-init", "--grammar-backend", "none")
    ),
]


def _env(*names: str) -> list[str]:
    values = [os.environ.get(n, "") for n in names]
    if not all(values):
        pytest.fail(f"{' / '.join(names)} unset: source .ci/sglang-env.sh and .ci/vllm-env.sh")
    return values


def config(
    engine: str,
    run_dir: Path,
    *,
    template: Path | None = None,
    extra: str = "",
    launch_args: list[str] | None = None,
) -> str:
    """smgd.toml for one launched engine. ``template``: a chat template file for the engine
    (default: the vLLM model's own, and :data:`CHAT_TEMPLATE` for SGLang's, which has none);
    ``extra``: more keys of the ``[[engines]]`` table; ``launch_args``: more engine flags."""
    if engine == "sglang":
        python, model = _env("SGLANG_PYTHON", "SGLANG_MODEL")
        args = SGLANG_ARGS
        if template is None:
            template = run_dir / "chat.jinja"
            template.write_text(CHAT_TEMPLATE)
    else:
        python, model = _env("VLLM_PYTHON", "VLLM_MODEL")
        args = VLLM_ARGS
    if template is not None:
        extra = f'chat_template = "{template}"\n{extra}'
    args = [*args, *(launch_args or [])]
    return (
        f'run_dir = "{run_dir}"\n[server]\nport = 0\ndrain_timeout_s = 5\n'
        '[logging]\nlevel = "info"\n'
        f'[[engines]]\nname = "{engine}"\nwire = "{engine}"\nmodels = ["{MODEL}"]\n'
        f'model_dir = "{model}"\n{extra}'
        f'[engines.launch]\nkind = "{engine}"\npython = "{python}"\nargs = {json.dumps(args)}\n'
        "[engines.structured_output]\ndisable_any_whitespace = true\n"
        f"[engines.timeouts]\nready_s = {READY_S}\n"
    )


@contextmanager
def serve(engine: str, **kwargs: Any) -> Iterator[str]:
    """``smgd serve`` with one launched real engine (:func:`config`); its base URL once ready.
    Stopped with SIGTERM on exit."""
    run_dir = short_ipc_dir()
    path = run_dir / "smgd.toml"
    path.write_text(config(engine, run_dir, **kwargs))
    log = (run_dir / "smgd.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "smgd", "serve", "--config", str(path)],
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield _wait_ready(proc, log)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _wait_ready(proc: subprocess.Popen[str], log: Any) -> str:
    deadline = time.monotonic() + READY_S
    base = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"smgd exited with {proc.returncode}:\n{log.read()[-4000:]}")
        log.seek(0)
        if base is None and (m := re.search(r"listening on (http://\S+)", log.read())):
            base = m.group(1).rstrip(",")
        if base is not None:
            try:
                if httpx.get(f"{base}/readiness", timeout=5).status_code == 200:
                    return base
            except httpx.TransportError:
                pass
        time.sleep(0.5)
    log.seek(0)
    pytest.fail(f"not ready within {READY_S:g} s:\n{log.read()[-4000:]}")


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=120)
